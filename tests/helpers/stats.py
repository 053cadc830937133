"""Statistics of the sampling tests: the chi-square quantile their statistics are held to."""

from __future__ import annotations

import math


def chi2_limit(df: int, z: float = 3.719) -> float:
    """The chi-square quantile at 1 - 1e-4 (Wilson-Hilferty; z the normal's)."""
    a = 2.0 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3
