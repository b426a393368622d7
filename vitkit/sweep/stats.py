"""The test of a claimed ordering of two rows of a sweep: the difference of their means over seeds, its 95% confidence
interval and two-sided p-value, by a paired t-test on the seeds both rows have (a seed's runs share their
initialisation and data order) when there are two or more, else Welch's t-test. The t distribution's tail is the
regularised incomplete beta function, evaluated by its continued fraction (Numerical Recipes, 3rd ed., sec 6.4).
A spec's claims are a family: the verdicts read their p-values after Holm's step-down adjustment (``holm``), so the
chance of calling any claim of a spec shown or reversed whose two rows do not differ stays under 5%.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# the confidence intervals' level; a claim is shown when its Holm-adjusted p < 1 - LEVEL and its difference is > 0
LEVEL = 0.95


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b), by the modified Lentz method."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), for a, b > 0 and x in [0, 1]."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def t_two_sided(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with df degrees of freedom."""
    return incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


def t_critical(df: float, level: float = LEVEL) -> float:
    """The t with P(|T| >= t) = 1 - level (bisection: the tail falls monotonically in t)."""
    low, high = 0.0, 1e6
    for _ in range(200):
        mid = (low + high) / 2.0
        low, high = (mid, high) if t_two_sided(mid, df) > 1.0 - level else (low, mid)
    return (low + high) / 2.0


@dataclass(frozen=True)
class Comparison:
    """higher - lower: the difference of the means, its LEVEL confidence interval, the two-sided p-value, and that p
    adjusted for the claims tested with it (``holm``; the same p when tested alone)."""

    diff: float
    low: float
    high: float
    p: float
    test: str  # "paired (n seeds)" or "Welch (n1, n2 seeds)"
    p_holm: float

    @property
    def verdict(self) -> str:
        if self.p_holm >= 1.0 - LEVEL or self.diff == 0.0:
            return "not shown"
        return "shown" if self.diff > 0 else "reversed"


def compare(higher: dict[int, float], lower: dict[int, float]) -> Comparison | None:
    """The test of higher > lower (seed -> value of each row); None with fewer than two seeds on a side."""
    common = sorted(set(higher) & set(lower))
    if len(common) >= 2:
        diffs = [higher[s] - lower[s] for s in common]
        diff, se, df = statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs)), len(diffs) - 1.0
        test = f"paired ({len(common)} seeds)"
    elif len(higher) >= 2 and len(lower) >= 2:
        a, b = list(higher.values()), list(lower.values())
        va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
        diff, se = statistics.fmean(a) - statistics.fmean(b), math.sqrt(va + vb)
        df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)) if se > 0 else 1.0
        test = f"Welch ({len(a)}, {len(b)} seeds)"
    else:
        return None
    if se == 0.0:  # every seed gave the same difference: no spread to test against
        p = 0.0 if diff else 1.0
        return Comparison(diff, diff, diff, p, test, p)
    half, p = t_critical(df) * se, t_two_sided(diff / se, df)
    return Comparison(diff, diff - half, diff + half, p, test, p)


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjustment of a family's p-values, in their order: the i-th smallest times (m - i + 1), kept
    from falling below the one before it, at most 1. A claim whose adjusted p is under a level is rejected with the
    family's error rate under that level (Holm 1979), whatever the dependence between the claims."""
    adjusted = [0.0] * len(ps)
    running = 0.0
    for rank, i in enumerate(sorted(range(len(ps)), key=ps.__getitem__)):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adjusted[i] = running
    return adjusted
