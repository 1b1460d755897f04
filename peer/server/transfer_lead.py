"""Which donor leads a state transfer (peer.server.replica_state): of the donors at the step a transfer is pinned
to, those holding the parameters most of them say they held at that step (their Info answers' recent steps), the
ones that stepped in a group before one that stepped alone, then the fastest.

A replica whose invitations reached nobody stepped alone: its weights went apart from its partners' for good
(replicas average gradients, not weights) until it takes their state (peer.server.replica_belief `_rejoin`). Led
by step and speed alone, a transfer could take its weights instead of the group's; led by the parameters most
donors hold, one apart replica (or one hostile replica that sends a state of its own) is outvoted by two."""

from __future__ import annotations

from dht.records import ServerRecord
from peer.model.fingerprint import first_difference


def said_at(info, epoch: int) -> list[float]:
    """The fingerprint an Info answer gives for step `epoch` (empty: not among its recent steps, or unknown)."""
    steps = [f for f in info.history if f.epoch == epoch] if info is not None else []
    return list(steps[-1].values) if steps else []


def stepped_alone(info, owner: str) -> bool:
    """Whether an Info answer's recent steps include one this replica took alone with parameters it still vouches
    for (a replica that took its partners' state since blanked those: peer.server.replica_belief)."""
    return info is not None and any(list(f.members) == [owner] and f.values for f in info.history)


def lead_first(donors: list[ServerRecord], infos: list, epoch: int, tolerance: float) -> list[ServerRecord]:
    """`donors` (with their Info answers, None where none came) to take the state of step `epoch` from, the lead
    first: those in the largest set that said the same parameters at that step, each set ordered by whether it
    stepped alone, then by throughput. When nobody said parameters at that step, all of them, fastest first."""
    said = [said_at(info, epoch) for info in infos]
    groups: list[list[int]] = []
    for i, fp in enumerate(said):
        if not fp:
            continue
        group = next((g for g in groups if first_difference(said[g[0]], fp, tolerance) is None), None)
        if group is None:
            groups.append([i])
        else:
            group.append(i)

    def order(i: int) -> tuple[bool, float]:
        return not stepped_alone(infos[i], donors[i].owner), donors[i].throughput

    if not groups:
        return sorted(donors, key=lambda r: r.throughput, reverse=True)
    best = max(groups, key=lambda g: (len(g), max(order(i) for i in g)))
    return [donors[i] for i in sorted(best, key=order, reverse=True)]
