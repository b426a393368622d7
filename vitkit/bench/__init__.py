"""Benchmarks: images/s, FLOPs, utilisation and memory, side by side with peers (``vitkit bench``).

flops.py counts model FLOPs from the config, memory.py measures step memory and the largest batch within a
budget, harness.py builds, checks parity, times alternating and reports, stats.py says how sure each ratio is.
"""

from .flops import layer_flops, model_flops, vit_flops
from .harness import (
    ATTN_IMPLS,
    DTYPES,
    MODES,
    PEERS,
    BenchConfig,
    BenchReport,
    MatmulProbe,
    Measurement,
    best_rows,
    check_parity,
    dense_bf16_peak,
    fastest_calls,
    hf_peer,
    make_step,
    matmul_probe,
    measure_matmul_peak,
    paired_ratio_intervals,
    paired_utilisation,
    probe_kernels,
    probe_size,
    run_bench,
    step_seconds,
    time_alternating,
)
from .memory import find_max_batch, format_bytes, measure_step_memory, parse_bytes, resident_bytes
from .stats import RatioStats, load_average, load_warnings, paired_ratio_stats, settled

__all__ = [
    "ATTN_IMPLS",
    "DTYPES",
    "MODES",
    "PEERS",
    "BenchConfig",
    "BenchReport",
    "MatmulProbe",
    "Measurement",
    "RatioStats",
    "best_rows",
    "check_parity",
    "dense_bf16_peak",
    "fastest_calls",
    "find_max_batch",
    "format_bytes",
    "hf_peer",
    "load_average",
    "load_warnings",
    "layer_flops",
    "make_step",
    "matmul_probe",
    "measure_matmul_peak",
    "measure_step_memory",
    "model_flops",
    "paired_ratio_intervals",
    "paired_ratio_stats",
    "paired_utilisation",
    "probe_kernels",
    "probe_size",
    "parse_bytes",
    "resident_bytes",
    "run_bench",
    "settled",
    "step_seconds",
    "time_alternating",
    "vit_flops",
]
