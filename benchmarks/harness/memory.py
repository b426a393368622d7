"""Peak memory of one step, what stays resident, and the largest batch within a budget (paper Fig 12).

CUDA: the allocator's peak during one step over what was allocated before it. CPU: there is no allocator to
ask, so the rise of the process's peak resident set during one step (Linux: VmHWM, reset through
/proc/self/clear_refs; freed heap is trimmed first so the baseline is what is live).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vitkit.errors import UserError


def parse_bytes(text: str) -> int:
    """'8GB', '512MiB', '1.5G', '1000000' -> bytes (GB and GiB both mean 2**30 here, as memory sizes usually do)."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise UserError(f"memory size {text!r}: expected a number with an optional unit, e.g. '8GB' or '512MiB'")
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[match.group(2).upper()]
    return int(float(match.group(1)) * scale)


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(f"/proc/self/status has no {key}")


def memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return "CUDA allocator peak during one step (torch.cuda.max_memory_allocated) over what was allocated before"
    if os.path.exists("/proc/self/clear_refs"):
        return "CPU: rise of the process's peak resident set during one step (Linux VmHWM reset via clear_refs)"
    return "not measured on this platform (needs CUDA or Linux /proc)"


def measure_step_memory(step: Callable[[], Any], device: torch.device, reset_cpu_peak: bool = False) -> int | None:
    """Bytes one call of step needs above what is already resident (see memory_method for how).

    On the CPU the measurement resets the process's peak resident set through /proc/self/clear_refs and hands
    freed heap back to the system: process-wide acts, done only when the caller asks (``reset_cpu_peak``, as
    the benchmark does); otherwise None there.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    if not reset_cpu_peak:
        return None
    try:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so the baseline is what is live
        before = _proc_status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        step()
        return (_proc_status_kib("VmHWM") - before) * 1024
    except (OSError, KeyError):
        return None


def resident_bytes(model: nn.Module, mode: str) -> int:
    """Weights and buffers; in training also gradients and AdamW's two moments (all in the parameter dtype)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return params * (4 if mode == "train" else 1) + buffers


def find_max_batch(fits: Callable[[int], bool], limit: int = 1 << 16) -> int:
    """The largest batch for which fits(batch) holds: doubling from 1, then bisection (0 if none fits)."""
    if not fits(1):
        return 0
    lo = 1
    while lo * 2 <= limit and fits(lo * 2):
        lo *= 2
    hi = min(lo * 2, limit + 1)  # fits(lo) holds; fits(hi) fails or hi is beyond the limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
