"""How a round cuts a part's tensors: the bounds of a round (from the run spec), each member's slice, the pieces
that stream, and the tensors seen as one flat float32 vector (peer.server.allreduce)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Limits:
    """The bounds and deadlines of a round (from the run spec's [averaging])."""

    piece_elements: int  # elements per piece (whole codec blocks)
    read_timeout: float  # s without bytes from a member whose pieces are due: it is lost
    group_timeout: float  # s an owner waits for every member's first frame (and its own round to start)
    round_timeout: float  # s for one whole call
    max_attempts: int  # attempts of a round, each without the members the one before lost
    aggregate: str  # peer.server.robust's kind
    max_weight_ratio: float  # peer.server.robust.fixed_weights' cap
    max_failed_rounds: int = 3  # a member that failed this many of our rounds in a row is left out of them
    failed_ban: float = 30.0  # s it is left out the first time, doubling each time after
    max_failed_ban: float = 480.0  # s it is left out at most

    @classmethod
    def from_spec(cls, spec) -> Limits:
        cfg, block = spec.averaging, spec.compression.block_size
        piece = max(block, cfg.piece_bytes // 4 // block * block)
        return cls(
            piece,
            cfg.read_timeout,
            cfg.group_timeout,
            cfg.averaging_timeout,
            cfg.max_attempts,
            cfg.aggregate,
            cfg.max_weight_ratio,
            cfg.max_failed_rounds,
            cfg.failed_ban,
            cfg.max_failed_ban,
        )


def slice_bounds(total: int, members: int, block: int) -> list[tuple[int, int]]:
    """[start, end) of each member's slice of `total` elements: equal, in whole blocks of `block`."""
    share = -(-total // max(members, 1))  # ceil
    step = -(-share // block) * block
    return [(min(i * step, total), min((i + 1) * step, total)) for i in range(members)]


def piece_bounds(start: int, end: int, piece: int) -> list[tuple[int, int]]:
    return [(s, min(s + piece, end)) for s in range(start, end, piece)]


class Flat:
    """Tensors seen as one flat float32 vector, read by ranges without copying what lies in one tensor."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = [t.detach().reshape(-1) for t in tensors]
        self.offsets = [0]
        for t in self.tensors:
            self.offsets.append(self.offsets[-1] + t.numel())
        self.numel = self.offsets[-1]

    def read(self, start: int, end: int) -> torch.Tensor:
        parts = []
        for i, t in enumerate(self.tensors):
            lo, hi = max(start, self.offsets[i]), min(end, self.offsets[i + 1])
            if lo < hi:
                parts.append(t[lo - self.offsets[i] : hi - self.offsets[i]])
        if len(parts) == 1:
            return parts[0].float()
        return torch.cat([p.float() for p in parts]) if parts else torch.empty(0)
