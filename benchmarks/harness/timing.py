"""Seconds of one call, and calls timed in alternation so that a change of machine load hits every one alike."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

SETTLE_S = 0.2  # idle time between timed calls, see time_alternating


def time_call(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call of fn, the device synchronised before and after."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_seconds(step: Callable[[], Any], device: torch.device) -> float:
    """One call's seconds, after a first call (which may compile): how long the matmul probe should last."""
    step()
    return time_call(step, device)


def time_alternating(
    steps: dict[str, Callable[[], Any]],
    repeats: int,
    warmup: int,
    device: torch.device,
    settle_s: float = SETTLE_S,
    until: Callable[[dict[str, list[float]]], bool] | None = None,
    max_repeats: int = 0,
) -> dict[str, list[float]]:
    """Seconds per call of each step, the steps taking turns within every round (after warm-up rounds).

    ``repeats`` rounds are timed; then, with ``until`` and ``max_repeats``, further rounds until until(times) is
    true or max_repeats rounds are done (see stats.settled). Between calls the process idles for settle_s (not
    timed): thread pools (OpenMP, onnxruntime) spin for a while after their work, and would otherwise steal the
    cores from whichever step runs next.
    """
    times: dict[str, list[float]] = {name: [] for name in steps}
    rounds = 0
    while rounds < warmup + repeats or (until is not None and rounds < warmup + max_repeats and not until(times)):
        for name, step in steps.items():
            time.sleep(settle_s)
            elapsed = time_call(step, device)
            if rounds >= warmup:
                times[name].append(elapsed)
        rounds += 1
    return times
