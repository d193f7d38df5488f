"""The least-squares fit the calibration uses: relative errors, coefficients >= 0."""

from __future__ import annotations

import numpy as np


def nonnegative_fit(features: np.ndarray, target: np.ndarray,
                    scale: np.ndarray) -> tuple[float, ...]:
    """Least squares of `target` on the columns of `features` (one row per measurement),
    relative to each row's `scale`, every coefficient >= 0: one that comes out negative is held
    at 0 and the others fitted again. A coefficient the rows cannot tell from the ones before
    it (a model too short for the long-context decode) is held at 0 too."""
    # Divided by its own scale, each row counts by its relative error.
    weights = 1.0 / np.maximum(scale, 1e-9)
    rows = features * weights[:, None]
    seconds = target * weights
    free: list[int] = []
    for column in range(rows.shape[1]):
        if np.linalg.matrix_rank(rows[:, free + [column]]) > len(free):
            free.append(column)
    coefficients = np.zeros(rows.shape[1])
    while free:
        fitted, *_ = np.linalg.lstsq(rows[:, free], seconds, rcond=None)
        negative = [column for column, value in zip(free, fitted) if value < 0]
        if not negative:
            coefficients[free] = fitted
            break
        free = [column for column in free if column not in negative]
    return tuple(float(c) for c in coefficients)
