"""How sure a speed ratio is: paired ratios, their median with a bootstrap interval, and the machine's load.

On shared cores one call can take 30% longer than the next for reasons that have nothing to do with the code.
Implementations are therefore timed in alternation (timing.time_alternating), and each round gives one paired
ratio (peer seconds / ours seconds, taken seconds apart, so a change of load between rounds cancels out). The
figure reported is the median of those ratios with a percentile-bootstrap interval of that median, and rounds
continue until the interval is narrow enough (``settled``) or a cap is hit.

    stats = paired_ratio_stats(peer_seconds, our_seconds)   # RatioStats: 1.08x (95% CI 1.03-1.12, ...)
    if stats.inconclusive: ...                              # |ratio - 1| < half-width: no lead shown
"""

from __future__ import annotations

import os
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

CONFIDENCE = 0.95
BOOTSTRAP_SAMPLES = 2000


@dataclass(frozen=True)
class RatioStats:
    """The median of paired ratios (> 1: the reference is faster), its bootstrap interval and quartiles."""

    median: float
    low: float  # the interval of the median at ``confidence``
    high: float
    q1: float  # quartiles of the ratios themselves: the round-to-round spread
    q3: float
    n: int
    confidence: float = CONFIDENCE

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    @property
    def inconclusive(self) -> bool:
        """The interval is wider than the effect: the data do not show which side is faster."""
        return abs(self.median - 1.0) < self.half_width

    def __str__(self) -> str:
        return (
            f"{self.median:.3f}x ({self.confidence:.0%} CI {self.low:.3f}-{self.high:.3f}, "
            f"IQR {self.q1:.3f}-{self.q3:.3f}, {self.n} rounds)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "half_width": self.half_width, "inconclusive": self.inconclusive}


def paired_ratio_stats(
    numerator_s: Sequence[float],
    denominator_s: Sequence[float],
    confidence: float = CONFIDENCE,
    samples: int = BOOTSTRAP_SAMPLES,
    seed: int = 0,
) -> RatioStats:
    """Statistics of numerator_s[i] / denominator_s[i] (seconds of the same round): pass the peer's seconds first
    for "how many times faster we are".

    The interval is the percentile bootstrap of the median (resampling rounds with replacement, seeded, so a
    report is reproducible from its timings). With fewer than 3 rounds it spans the ratios' full range.
    """
    if len(numerator_s) != len(denominator_s) or not numerator_s:
        raise ValueError(
            f"paired ratios need equally many timings on each side, got {len(numerator_s)} and {len(denominator_s)}"
        )
    ratios = sorted(t / v for t, v in zip(numerator_s, denominator_s))
    n = len(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if n > 1 else (ratios[0],) * 3
    if n < 3:
        low, high = ratios[0], ratios[-1]
    else:
        rng = random.Random(seed)
        medians = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(samples))
        tail = (1 - confidence) / 2
        low, high = medians[int(tail * (samples - 1))], medians[int(round((1 - tail) * (samples - 1)))]
    return RatioStats(statistics.median(ratios), low, high, q1, q3, n, confidence)


def settled(stats: Sequence[RatioStats], target: float, min_rounds: int = 5) -> bool:
    """Whether every interval's half-width is within ``target`` of its median (0.02: +-2%) after min_rounds."""
    return all(s.n >= min_rounds and s.half_width <= target * s.median for s in stats)


# ------------------------------------------------------------------------------------------------- load
def load_average() -> float | None:
    """The 1-minute load average (runnable processes, ours included), None where the system has none."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def load_warnings(before: float | None, after: float | None, threads: int, cores: int | None = None) -> list[str]:
    """Warnings when other work shared the cores: before the run the load should be near 0, after it near our
    own thread count (the 1-minute average lags: it mostly sees the last minute of the run).
    """
    cores = cores or os.cpu_count() or 1
    out = []
    if before is not None and before > 0.5 * cores:
        out.append(f"load average {before:.2f} on {cores} cores before the run: other work was running")
    if after is not None and after > min(threads, cores) + 0.5 * cores:
        out.append(
            f"load average {after:.2f} on {cores} cores after the run (this process accounts for about "
            f"{min(threads, cores)}): other work was running"
        )
    return out
