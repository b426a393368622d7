"""What a benchmark reports: each implementation's timings (Measurement), and the whole run (BenchReport) as a
table or JSON, with vitkit's speed over each peer's paired round by round."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from vitkit.accel.training import cpu_allocator_tuned
from vitkit.device import cpu_model_name
from vitkit.io import atomic_write_text

from .memory import format_bytes
from .stats import RatioStats, paired_ratio_stats

RATIO_FIELDS = ("median", "low", "high", "q1", "q3", "n", "confidence")


@dataclass
class Measurement:
    """One implementation's timings; images/s is the median over repeats, with its min and max."""

    name: str
    images_per_s: float
    images_per_s_min: float
    images_per_s_max: float
    step_s: list[float]
    utilisation: float  # model FLOPs per second over the matmul peak, round by round (peak.paired_utilisation)
    hardware_utilisation: float  # executed FLOPs per second over the matmul peak, likewise
    step_memory_bytes: int | None = None
    resident_bytes: int | None = None
    parity_max_abs: float | None = None


@dataclass
class BenchReport:
    config: dict[str, Any]
    environment: dict[str, Any]
    gflops_per_image: float  # forward, the model's FLOPs
    executed_gflops_per_image: float  # what vitkit's forward executes (less where its last block is the class token's)
    gflops_per_step: float  # forward (infer) or 3x forward (train), whole batch
    matmul_peak_gflops: float
    matmul_peak_kernel: str  # which kernel the peak probe ran (peak.matmul_probe: the fastest here)
    matmul_peak_size: str  # its product's shape and repeats (MatmulProbe.size)
    matmul_peak_s: list[float]  # its seconds in each round, paired with each Measurement.step_s
    memory_method: str
    measurements: list[Measurement]
    ratios: dict[str, float]  # vitkit's speed over each peer's, best rows, paired by repeat (see paired_ratios)
    max_batch: dict[str, Any] | None = None
    ratio_stats: dict[str, dict[str, Any]] = field(default_factory=dict)  # RatioStats.to_dict() per peer
    warnings: list[str] = field(default_factory=list)  # load, and ratios whose interval is wider than the effect

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save_json(self, path: str | Path) -> Path:
        path = Path(path)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    def table(self) -> str:
        c = self.config
        w = max(8, *(len(m.name) for m in self.measurements))
        compile_modes = ",".join(c.get("compile_modes") or [c["compile"]])
        lines = [
            f"{c['model']} {c['mode']} img {c['img_size']} batch {c['batch_size']} {c['dtype']} attn={c['attn']} "
            f"compile={compile_modes} on {self.environment['device']} ({self.environment['threads']} threads, "
            f"load {self.environment['load_avg']})",
            f"model: {self.gflops_per_image:.4g} GFLOP/image forward (vitkit executes "
            f"{self.executed_gflops_per_image:.4g}); {c['dtype']} matmul peak {self.matmul_peak_gflops:.1f} GFLOP/s "
            f"({self.matmul_peak_kernel}, {self.matmul_peak_size}, timed alongside)",
            f"{'impl':<{w}} {'img/s':>9} {'min-max':>17} {'mfu':>6} {'hw':>6} {'step mem':>10} {'resident':>10} "
            f"{'parity':>9}",
        ]
        for m in self.measurements:
            parity = "-" if m.parity_max_abs is None else f"{m.parity_max_abs:.1e}"
            lines.append(
                f"{m.name:<{w}} {m.images_per_s:>9.2f} {m.images_per_s_min:>8.2f}-{m.images_per_s_max:<8.2f} "
                f"{m.utilisation:>6.1%} {m.hardware_utilisation:>6.1%} {format_bytes(m.step_memory_bytes):>10} "
                f"{format_bytes(m.resident_bytes):>10} {parity:>9}"
            )
        for peer, ratio in self.ratios.items():
            st = self.ratio_stats.get(peer)
            shown = str(RatioStats(**{k: st[k] for k in RATIO_FIELDS})) if st else f"{ratio:.3f}x"
            lines.append(f"vitkit / {peer} (best rows, paired by repeat): {shown}")
        lines += [f"WARNING: {w}" for w in self.warnings]
        lines.append(f"memory: {self.memory_method}")
        if self.max_batch:
            mb = self.max_batch
            lines.append(f"largest batch within {mb['budget']}: {mb['batch_size']} ({mb['method']})")
        return "\n".join(lines)


def best_rows(measurements: Sequence[Measurement]) -> dict[str, Measurement]:
    """Each implementation's fastest row (highest median images/s) over its compile modes ("hf/none", ...)."""
    best: dict[str, Measurement] = {}
    for m in measurements:
        impl = m.name.split("/")[0]
        if impl not in best or m.images_per_s > best[impl].images_per_s:
            best[impl] = m
    return best


def paired_ratios(measurements: Sequence[Measurement]) -> dict[str, float]:
    """vitkit's speed over each peer's: the best row (median images/s over compile modes) of each implementation,
    then the median over repeats of peer seconds / vitkit seconds within the same repeat.

    Both calls of a pair ran seconds apart, so a change of machine load between repeats cancels out, where a
    ratio of two medians would still carry it.
    """
    best = best_rows(measurements)
    ours = best["vitkit"].step_s
    return {
        impl: statistics.median(t / v for t, v in zip(m.step_s, ours)) for impl, m in best.items() if impl != "vitkit"
    }


def paired_ratio_intervals(measurements: Sequence[Measurement]) -> dict[str, RatioStats]:
    """paired_ratios with the spread: each peer's best row against vitkit's, as RatioStats (stats.py)."""
    best = best_rows(measurements)
    ours = best["vitkit"].step_s
    return {impl: paired_ratio_stats(m.step_s, ours) for impl, m in best.items() if impl != "vitkit"}


def environment(device: torch.device) -> dict[str, Any]:
    """The device, torch version, threads, CPU capability, load average and allocator setting of this run."""
    env = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_avg": "n/a",
        "cores": os.cpu_count(),
        "cpu_allocator": "freed memory kept (tune_cpu_allocator)" if cpu_allocator_tuned() else "default",
    }
    with contextlib.suppress(OSError, AttributeError):
        env["load_avg"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
    if device.type == "cpu":
        env["device"] = cpu_model_name() or env["device"]
    return env
