"""Where a page was made: library versions, the device and the threads."""

from __future__ import annotations

import os
import platform
import sys
from datetime import datetime, timezone

import torch


def environment(device: torch.device) -> list[tuple[str, str]]:
    """(what, value) pairs of this process: versions, the device it computes on, threads, time."""
    import matplotlib
    import numpy

    if device.type == "cuda":
        name = f"{device} ({torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda})"
    else:
        name = f"{device} ({platform.processor() or platform.machine()})"
    return [
        ("vitkit", _vitkit_version()),
        ("python", sys.version.split()[0]),
        ("torch", torch.__version__),
        ("numpy", numpy.__version__),
        ("matplotlib", matplotlib.__version__),
        ("platform", platform.platform()),
        ("device", name),
        ("torch threads", f"{torch.get_num_threads()} (of {os.cpu_count()} CPUs)"),
        ("written", datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")),
    ]


def _vitkit_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vitkit")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"
