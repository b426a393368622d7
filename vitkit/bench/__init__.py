"""Benchmarks: images/s, FLOPs, utilisation and memory, side by side with peers (``vitkit bench``).

flops.py counts model FLOPs from the config, memory.py measures step memory and the largest batch within a
budget, harness.py builds, checks parity, times alternating and reports.
"""

from .flops import layer_flops, model_flops, vit_flops
from .harness import (
    ATTN_IMPLS,
    DTYPES,
    MODES,
    PEERS,
    BenchConfig,
    BenchReport,
    Measurement,
    best_rows,
    check_parity,
    hf_peer,
    make_step,
    matmul_probe,
    measure_matmul_peak,
    run_bench,
    time_alternating,
)
from .memory import find_max_batch, format_bytes, measure_step_memory, parse_bytes, resident_bytes

__all__ = [
    "ATTN_IMPLS",
    "DTYPES",
    "MODES",
    "PEERS",
    "BenchConfig",
    "BenchReport",
    "Measurement",
    "best_rows",
    "check_parity",
    "find_max_batch",
    "format_bytes",
    "hf_peer",
    "layer_flops",
    "make_step",
    "matmul_probe",
    "measure_matmul_peak",
    "measure_step_memory",
    "model_flops",
    "parse_bytes",
    "resident_bytes",
    "run_bench",
    "time_alternating",
    "vit_flops",
]
