"""Load balancing: which stage a server should serve so that the slowest stage goes fastest.

The swarm's throughput is bounded by its bottleneck, the stage with the least total throughput
over its servers. A server joins the weakest stage, and later moves only when moving raises the
bottleneck by a margin; it never leaves its own stage without a server, and a server that just
moved waits out a cooldown, so servers do not oscillate. A server that means to move first
announces it (a claim in its record) and looks again after a settle time: of servers that saw the
same numbers, the one with the earliest claim goes and the others, counting it as gone, stay.
"""

from __future__ import annotations

from collections.abc import Iterable

from dht.records import ServerRecord

ACTIVE = ("joining", "serving")


def _cap(records: list[dict[str, ServerRecord]], claim_cap: float) -> float:
    """The most throughput one record counts for: `claim_cap` x the lower median of the active records' claims (one
    record announcing 10^12 samples/s must not make its stage look served for everyone; inf while none claims)."""
    claims = sorted(max(r.throughput, 0.0) for servers in records for r in servers.values() if r.state in ACTIVE)
    median = claims[(len(claims) - 1) // 2] if claims else 0.0
    return claim_cap * median if median > 0 else float("inf")


def stage_totals(
    records: Iterable[dict[str, ServerRecord]],
    num_stages: int,
    before: tuple[float, str] | None = None,
    claim_cap: float = 4.0,
) -> tuple[list[float], list[int]]:
    """Per stage (records by peer id): total announced throughput (each record's at most `claim_cap` x the run's
    median claim: server.balance_claim_cap) and number of servers joining or serving.

    A server that announced it means to move counts in the stage it moves to, if its claim goes
    before `before` (the asking server's own claim as (moving_since, endpoint); None: every claim).
    Claims are ordered by their announced numbers, so every server orders them alike. A server
    that left to move counts there too until its new record (same peer id) shows up, so a move in
    progress is never taken for a server gone.
    """
    records = [dict(servers) for servers in records]
    totals, counts, cap = [0.0] * num_stages, [0] * num_stages, _cap(records, claim_cap)
    for stage, servers in enumerate(records):
        for pid, r in servers.items():
            if r.stage != stage:
                continue
            claimed = 0 <= r.moving_to < num_stages and (before is None or (r.moving_since, r.endpoint) < before)
            if r.state in ACTIVE:
                where = r.moving_to if claimed else stage
            elif claimed and r.state in ("leaving", "left") and pid not in records[r.moving_to]:
                where = r.moving_to  # on its way there
            else:
                continue
            totals[where] += min(max(r.throughput, 0.0), cap)
            counts[where] += 1
    return totals, counts


def weakest_stage(totals: list[float], allowed: set[int] | None = None) -> int:
    """The stage with the least total throughput (the lowest index on ties), among `allowed` (None: all)."""
    return min((s for s in range(len(totals)) if allowed is None or s in allowed), key=lambda s: (totals[s], s))


def plan_move(
    totals: list[float],
    counts: list[int],
    stage: int,
    throughput: float,
    margin: float,
    allowed: set[int] | None = None,
) -> int | None:
    """The stage a server of `stage` with `throughput` should move to, or None to stay.

    It moves only if the bottleneck after the move exceeds the bottleneck now by `margin`
    (a fraction), never away from a stage it would leave unserved, never to its own stage, and
    only to a stage in `allowed` (None: any; a tensor-parallel peer cannot split every stage).
    """
    if counts[stage] < 2 or throughput <= 0:
        return None
    now = min(totals)
    best, best_bottleneck = None, now * (1 + margin)
    for target in range(len(totals)):
        if target == stage or (allowed is not None and target not in allowed):
            continue
        after = list(totals)
        after[stage] -= throughput
        after[target] += throughput
        if min(after) > best_bottleneck:
            best, best_bottleneck = target, min(after)
    return best
