"""What this machine can do, asked in one place so that a run's precision means the same to every part: the
CPU's flags and usable cores, whether bf16 is native, and the autocast context for ``none`` / ``bf16`` / ``fp16``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import torch

# torch.compile's modes ("reduce-overhead" replays CUDA graphs), and "none"
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # autocast precisions; "none" runs in fp32


@functools.cache
def _cpuinfo() -> tuple[frozenset[str], str | None]:
    """(the flags of /proc/cpuinfo's first processor, its model name); empty and None off Linux."""
    flags: frozenset[str] = frozenset()
    name: str | None = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "flags" and not flags:
                    flags = frozenset(value.split())
                elif key == "model name" and name is None:
                    name = value.strip()
                if flags and name is not None:
                    break
    except OSError:
        pass
    return flags, name


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this CPU (``avx512_bf16``, ``amx_int8``, ...); empty where unknown."""
    return _cpuinfo()[0]


def cpu_model_name() -> str | None:
    """The CPU's model name as /proc/cpuinfo gives it, or None where unknown."""
    return _cpuinfo()[1]


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity mask where the OS has one (containers, taskset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def busy_core_seconds() -> float | None:
    """CPU seconds the cores this process may use have spent busy so far, every process's (and a hypervisor's
    steal) together, from /proc/stat (Linux); None elsewhere."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    mine = {f"cpu{i}" for i in os.sched_getaffinity(0)}
    ticks = 0
    for name, *fields in (line.split() for line in lines if line.startswith("cpu")):
        if name in mine:  # user nice system idle iowait irq softirq steal ...: all but idle and iowait
            values = [int(v) for v in fields[:8]]
            ticks += sum(values) - values[3] - values[4]
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_has_fast_bf16() -> bool:
    """True when this CPU multiplies bf16 natively (AMX-BF16 or AVX512-BF16); otherwise bf16 is emulated."""
    flags = cpu_flags()
    if not flags:  # not Linux: trust oneDNN's own check
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cpu_has_vnni() -> bool:
    """True when this CPU has 8-bit dot-product instructions (AVX512-VNNI, AVX-VNNI or AMX-INT8)."""
    return not cpu_flags().isdisjoint({"avx512_vnni", "avx_vnni", "amx_int8"})


def bf16_is_fast(device: torch.device) -> bool:
    """Whether bf16 matmuls are native on device (CUDA with bf16 support, or a CPU with AMX / AVX512-BF16)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_fast_bf16()


def cpu_autocast_is_bf16() -> bool:
    """Whether CPU autocast is on here and computes in bf16 (what the bf16 CPU paths of attention and Dense ask)."""
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def seed_rng(seed: int, device: torch.device | None = None) -> None:
    """Seed the CPU's generator and a CUDA device's: torch.manual_seed's work, without its cost per backend."""
    torch.default_generator.manual_seed(seed)
    if device is not None and device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


def autocast(device: torch.device | str, amp: str) -> contextlib.AbstractContextManager[object]:
    """The mixed-precision context for amp (``none``: a no-op, ``bf16`` or ``fp16``: torch.autocast) on device."""
    if amp == "none":
        return contextlib.nullcontext()
    if amp not in AMP_DTYPES:
        raise ValueError(f"amp {amp!r}: expected none or one of {sorted(AMP_DTYPES)}")
    return torch.autocast(torch.device(device).type, dtype=AMP_DTYPES[amp])
