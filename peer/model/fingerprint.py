"""Parameter fingerprints compared: replicas of a part at one step must hold the same parameters.

A fingerprint is, per parameter, its sum and then its sum of squares, in float64, followed by the same of each
parameter's AdamW state, or in local mode of its outer momentum (peer.model.part_state.state_fingerprint).
Replicas that average every step hold equal parameters up to the rounding of a compressed all-reduce,
so two fingerprints of one step that differ beyond `TOLERANCE` mean the replicas went apart: one
started from other weights (the seed beside trained replicas) or stepped on its own. A single step
taken apart moves a sum of squares by about (lr / rms of the weights)^2 of itself: caught after a few
steps, not always after one. No torch here: `peer status` and the coordinator compare announced lists.
"""

from __future__ import annotations

import math

TOLERANCE = 1e-4  # relative difference of a parameter's sum of squares (or its sum, against its norm) allowed
# with a lossy averaging codec, each replica applies the average with its own codec error, and in local mode
# that adds up over outer steps (docs/architecture.md, known limits): only replicas that went far apart differ
LOSSY_TOLERANCE = 5e-2


def tolerance(averaging_codec: str) -> float:
    """How far apart replicas at one step may be, with the run's `compression.averaging` codec."""
    return TOLERANCE if averaging_codec in ("", "none") else LOSSY_TOLERANCE


def first_difference(a: list[float], b: list[float], tolerance: float = TOLERANCE) -> int | None:
    """The index of the first parameter whose fingerprints differ; None if they agree or either is unknown (empty).

    Fingerprints of different lengths (other models) differ at parameter 0."""
    if not a or not b:
        return None
    if len(a) != len(b):
        return 0
    for index in range(len(a) // 2):
        (sum_a, squares_a), (sum_b, squares_b) = a[2 * index : 2 * index + 2], b[2 * index : 2 * index + 2]
        if not all(math.isfinite(x) for x in (sum_a, squares_a, sum_b, squares_b)):
            return index
        squares = max(abs(squares_a), abs(squares_b))
        norm = math.sqrt(squares)
        if abs(squares_a - squares_b) > tolerance * squares + 1e-12:
            return index
        if abs(sum_a - sum_b) > tolerance * (norm + max(abs(sum_a), abs(sum_b))) + 1e-12:
            return index
    return None


def held_at(history, epoch: int, values: list[float], tolerance: float = TOLERANCE) -> bool | None:
    """Whether a replica's recent steps (an Info answer's `history`: items with `epoch` and `values`) hold `epoch`
    with these parameters: True, False (other parameters, or none said), None (that step is not among them)."""
    steps = [f for f in history if f.epoch == epoch]
    if not steps:
        return None
    said = list(steps[-1].values)
    return bool(said) and bool(values) and first_difference(said, values, tolerance) is None


def short(values: list[float]) -> str:
    """A fingerprint in a few characters, for messages: its total sum of squares."""
    return f"{sum(values[1::2]):.6g}" if values else "unknown"
