"""What most of a part's replicas say: the step a minority of hostile replicas cannot move.

Any admitted peer may announce any step in its record or in an answer. A reader therefore takes
the step that at least half of a part's serving replicas have reached (the upper median), and
treats a replica further ahead than a few steps of that as not credible: not routed to, not a
donor of state, not a sign that the run has ended. At least half, not more than half: of two
replicas, one just behind (stopped a while, or one round late) must not hold the other back, and
counting cannot tell two replicas apart anyway (docs/security.md says what is not defended). What is
taken for good on a step (the run has ended, a checkpoint bears it) needs more than half of them: `backed`.
"""

from __future__ import annotations

from collections.abc import Iterable


def agreed(steps: Iterable[int]) -> int:
    """The highest step that at least half of `steps` are at or above (0 for none)."""
    ordered = sorted(steps)
    return ordered[len(ordered) // 2] if ordered else 0


def backed(steps: Iterable[int]) -> int:
    """The highest step more than half of `steps` are at or above (the lower median; 0 for none): what anything
    taken for good rests on (the run's end, the step a checkpoint is named by). Of two replicas, both must be
    there: one of them alone, at half, is its own word."""
    ordered = sorted(steps)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0


def credible_limit(steps: Iterable[int], jump: int) -> int:
    """The furthest step a replica may credibly claim among replicas at `steps`: the agreed one plus `jump`."""
    return agreed(steps) + jump
