"""Small statistics shared by the reports (:mod:`lopd.compare`, :mod:`lopd.chain`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["fmt", "mean_se", "side", "verdict"]


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (sample std / sqrt(n)) of ``values``; the error is NaN for one
    value (unknown, not zero)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_se of no values")
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def fmt(mean: float, se: float, digits: int = 3) -> str:
    """``0.123 ± 0.045`` (``0.123`` when the error is unknown), ``digits`` after the point."""
    if math.isnan(se):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


def side(diff: float, se: float) -> str:
    """Which side of zero a difference lies on and whether beyond two standard errors, in
    words (the two-sided counterpart of :func:`verdict`)."""
    if diff == 0:
        return "equal"
    where = "above" if diff > 0 else "below"
    if math.isnan(se):
        return f"{where} (one seed: no stderr)"
    return f"{where}, > 2 stderr" if abs(diff) > 2 * se else f"{where}, within 2 stderr"


def verdict(diff: float, se: float) -> str:
    """Whether a difference is positive beyond two standard errors, in words."""
    if math.isnan(se):
        if diff == 0:
            return "no (equal)"
        return "higher (one seed: no stderr)" if diff > 0 else "no"
    if diff > 2 * se:
        return "yes (difference > 2 stderr)"
    if diff > 0:
        return "higher, but within 2 stderr (not significant)"
    return "no (equal)" if diff == 0 else "no"
