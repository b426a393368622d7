"""The benchmark scripts' harness: images/s, utilisation and memory, side by side with peers, and result files.

A package beside the scripts, not in vitkit (as timm keeps benchmark.py beside its package): a script imports it
as ``from harness import ...`` (its own directory is on sys.path), the tests put benchmarks/ on sys.path.
config.py (BenchConfig), steps.py (what is timed: vitkit under its switches, the peers as built), peers.py
(transformers, timm), switches.py and accuracy.py (each library's precision switch, and its accuracy cost),
parity.py, timing.py (alternating rounds), peak.py (the matmul peak), stats.py (paired ratios and their
intervals), memory.py, report.py, run.py (run_bench), results.py (benchmarks/results/ files).
FLOPs are vitkit.models.flops.
"""

from .accuracy import accuracy_lines, digits_model, official_model, switch_accuracy
from .config import DTYPES, MODES, PARITY_TOL, PEERS, BenchConfig
from .memory import find_max_batch, format_bytes, measure_step_memory, memory_method, parse_bytes, resident_bytes
from .parity import batched_logits, check_parity, logit_agreement, model_output
from .peak import (
    DENSE_BF16_TFLOPS,
    MatmulProbe,
    dense_bf16_peak,
    fastest_calls,
    matmul_probe,
    measure_matmul_peak,
    paired_utilisation,
    probe_kernels,
    probe_size,
)
from .peers import PEER_MODULES, PEER_NAMES, hf_peer, timm_peer
from .report import BenchReport, Measurement, best_rows, environment, paired_ratio_intervals, paired_ratios
from .results import command_line, machine, recorded, write_results
from .run import estimate_max_batch, run_bench
from .stats import RatioStats, load_average, load_warnings, paired_ratio_stats, settled
from .steps import build_model, executes_first_token, make_step, peer_step, vitkit_step
from .switches import PEERS_SWITCH, check_rows, int8_compile_note, peer_switch, precision_rows, vitkit_switch
from .timing import SETTLE_S, step_seconds, time_alternating, time_call

__all__ = [
    "DENSE_BF16_TFLOPS",
    "DTYPES",
    "MODES",
    "PARITY_TOL",
    "PEERS",
    "PEERS_SWITCH",
    "PEER_MODULES",
    "PEER_NAMES",
    "SETTLE_S",
    "BenchConfig",
    "BenchReport",
    "MatmulProbe",
    "Measurement",
    "RatioStats",
    "accuracy_lines",
    "batched_logits",
    "best_rows",
    "build_model",
    "check_parity",
    "check_rows",
    "command_line",
    "dense_bf16_peak",
    "digits_model",
    "environment",
    "estimate_max_batch",
    "executes_first_token",
    "fastest_calls",
    "find_max_batch",
    "format_bytes",
    "hf_peer",
    "int8_compile_note",
    "load_average",
    "load_warnings",
    "logit_agreement",
    "machine",
    "make_step",
    "peer_step",
    "matmul_probe",
    "measure_matmul_peak",
    "measure_step_memory",
    "memory_method",
    "model_output",
    "official_model",
    "paired_ratio_intervals",
    "paired_ratio_stats",
    "paired_ratios",
    "paired_utilisation",
    "parse_bytes",
    "peer_switch",
    "precision_rows",
    "probe_kernels",
    "probe_size",
    "recorded",
    "resident_bytes",
    "run_bench",
    "settled",
    "step_seconds",
    "switch_accuracy",
    "time_alternating",
    "time_call",
    "timm_peer",
    "vitkit_step",
    "vitkit_switch",
    "write_results",
]
