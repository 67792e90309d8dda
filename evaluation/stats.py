"""The statistics the release gate judges with: exact where the data are counts.

Every function is pure and never raises on bad data: impossible counts (negative, k > n,
n = 0, bools, non-integers) or a confidence outside (0, 1) give NaN, and NaN fails any
gate check it reaches (fail closed). Notation: n trials, k events, c the confidence level
of a one-sided bound, alpha = 1 - c.

- `clopper_pearson_upper` / `wilson_upper`: upper bounds of a binomial rate (negative-flip
  rate; share of a released skill's problems lost).
- `mcnemar_exact_p`: is a paired pass/fail difference more than chance? (reported, not gated)
- `t_upper`: upper bound of a mean from a small sample of continuous values.
- `min_n_for_zero`: how many trials a rate limit needs to be provable at all.

scipy is imported inside the functions: importing this module stays free.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from statistics import NormalDist
from typing import Optional

RATE_BOUNDS = ("wilson", "clopper-pearson")


def is_count(v) -> bool:
    """An integer that is not a bool (True would pass as 1)."""
    return isinstance(v, Integral) and not isinstance(v, bool)


def _confidence_ok(confidence) -> bool:
    return isinstance(confidence, Real) and not isinstance(confidence, bool) and 0.0 < confidence < 1.0


def _counts_ok(k, n, confidence) -> bool:
    """Integer counts 0 <= k <= n, n >= 1 (of any size), and a confidence strictly inside (0, 1)."""
    return is_count(k) and is_count(n) and 0 <= k <= n and n >= 1 and _confidence_ok(confidence)


def wilson_upper(k: int, n: int, confidence: float = 0.95) -> float:
    """One-sided Wilson score upper bound of a binomial rate p = k/n:

        (p + z^2/2n + z * sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n),   z = Phi^-1(c),

    capped at 1. At k = 0 it is z^2 / (n + z^2). An approximation (the score test inverted),
    a little less conservative than Clopper-Pearson. NaN for impossible counts."""
    if not _counts_ok(k, n, confidence):
        return math.nan
    z, n = NormalDist().inv_cdf(confidence), float(n)
    p = k / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z * z / n))


def clopper_pearson_upper(k: int, n: int, confidence: float = 0.95) -> float:
    """One-sided exact (Clopper-Pearson) upper bound of a binomial rate: the p at which
    P(X <= k | n, p) = alpha, i.e. the c-quantile of Beta(k + 1, n - k); 1 at k = n, and
    1 - alpha^(1/n) at k = 0. Computed with the inverse regularised incomplete beta (no
    binomial sums, so no overflow at any n). Exact: it covers p with probability >= c for
    every n and p. NaN for impossible counts."""
    if not _counts_ok(k, n, confidence):
        return math.nan
    if k >= n:
        return 1.0
    from scipy.special import betaincinv

    return float(betaincinv(k + 1, n - k, confidence))


def rate_upper(k: int, n: int, confidence: float, bound: str) -> float:
    """`bound`'s one-sided upper bound of k/n ('wilson' or 'clopper-pearson')."""
    if bound not in RATE_BOUNDS:
        raise ValueError(f"bound: expected one of {RATE_BOUNDS}, got {bound!r}")
    return (wilson_upper if bound == "wilson" else clopper_pearson_upper)(k, n, confidence)


def mcnemar_exact_p(lost: int, gained: int) -> float:
    """Exact two-sided McNemar p-value of paired pass/fail results: under "no change" each of
    the m = lost + gained discordant problems is lost or gained with probability 1/2, so

        p = min(1, 2 * P(X <= min(lost, gained))),   X ~ Binomial(m, 1/2);

    1.0 when no problem changed (m = 0). NaN for impossible counts."""
    if not (is_count(lost) and is_count(gained) and lost >= 0 and gained >= 0):
        return math.nan
    m = lost + gained
    if m == 0:
        return 1.0
    from scipy.special import bdtr

    return float(min(1.0, 2.0 * bdtr(min(lost, gained), m, 0.5)))


def t_upper(mean: float, sd: float, n: int, confidence: float = 0.95) -> float:
    """One-sided upper confidence bound of a population mean from n values with sample mean
    `mean` and SAMPLE standard deviation `sd` (divisor n - 1):

        mean + t_{c, n-1} * sd / sqrt(n),   t_{c, n-1} the Student t quantile.

    Exact for normal values, and wider than the normal approximation at small n. NaN when
    n < 2 (no spread can be estimated from one value), for a negative or non-finite sd or mean,
    or a confidence outside (0, 1)."""
    numbers = all(isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v) for v in (mean, sd))
    if not (numbers and is_count(n) and n >= 2 and sd >= 0 and _confidence_ok(confidence)):
        return math.nan
    from scipy.special import stdtrit

    return float(mean + stdtrit(n - 1, confidence) * sd / math.sqrt(n))


def min_n_for_zero(limit: float, confidence: float = 0.95, bound: str = "clopper-pearson") -> Optional[int]:
    """The smallest n at which k = 0 events gives an upper bound <= `limit`: below it the limit
    cannot be met whatever the data, so a policy asking for it can never pass.

        clopper-pearson: 1 - alpha^(1/n) <= limit  <=>  n >= ln(alpha) / ln(1 - limit)
        wilson:          z^2 / (n + z^2) <= limit   <=>  n >= z^2 (1 - limit) / limit

    None when limit <= 0 (a bound is > 0 at every n: unprovable); 1 when limit >= 1. The closed
    form is checked against the bound itself, so the answer agrees with what the gate computes."""
    if bound not in RATE_BOUNDS:
        raise ValueError(f"bound: expected one of {RATE_BOUNDS}, got {bound!r}")
    if not _confidence_ok(confidence):
        raise ValueError(f"confidence: expected a value in (0, 1), got {confidence!r}")
    if not (isinstance(limit, Real) and not math.isnan(limit)):
        raise ValueError(f"limit: expected a number, got {limit!r}")
    if limit <= 0:
        return None
    if limit >= 1:
        return 1
    if bound == "clopper-pearson":
        n = math.ceil(math.log(1 - confidence) / math.log1p(-limit))
    else:
        z2 = NormalDist().inv_cdf(confidence) ** 2
        n = math.ceil(z2 * (1 - limit) / limit)
    n = max(1, n)
    while n > 1 and rate_upper(0, n - 1, confidence, bound) <= limit:  # rounding of the closed form
        n -= 1
    while rate_upper(0, n, confidence, bound) > limit:
        n += 1
    return n
