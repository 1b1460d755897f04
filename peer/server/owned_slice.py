"""The slice of a round that one member reduces (peer.server.allreduce): every member's pieces in, checked and
aggregated as they come, the averaged pieces out, encoded once; and why an attempt fails (`Failed`)."""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field

import torch

from peer.model.numerics import all_finite
from peer.server.piece_codec import PieceCodec, PieceError
from peer.server.robust import aggregate, fixed_weights
from peer.server.slice_word import new_digest
from peer.server.slicing import Flat, Limits, piece_bounds
from protocols import averaging_pb2
from protocols.averaging_frames import piece_frame

logger = logging.getLogger(__name__)
MAX_QUEUED = 2  # pieces of one member read ahead of the reduction


def contribution_key(c: averaging_pb2.Contribution) -> tuple:
    """What owners must report alike of a member's contribution: a member that told them differently is left out."""
    return c.peer_id, c.samples, c.incarnation, c.seq, norm_claim(c), bytes(c.nonce), norm_claim(c, "reference")


def norm_claim(c: averaging_pb2.Contribution, field: str = "norm") -> float | None:
    """The norm a member says it sent (or, `field` "reference", the one it holds a lone claimant to), as the
    plausibility check reads it (peer.server.averaging): None when it said none, or nothing that is a finite
    number >= 0."""
    if not c.HasField(field) or not math.isfinite(value := getattr(c, field)) or value < 0:
        return None
    return float(value)


@dataclass
class Attempt:
    """One attempt of a round, as this member runs it."""

    epoch: int
    attempt: int
    group: list[str]
    me: averaging_pb2.Contribution
    flat: Flat
    out: torch.Tensor  # the averaged flat vector, filled as owners answer
    lost: set[str] = field(default_factory=set)


class Failed(Exception):
    """An attempt (or one owner's slice of it) went on without members: `lost`, and why. `claimants`: the
    owners on whose word it ended (a failed verdict), checked later where it ends the round for good (a verdict
    that they already stepped it, or one that came after our slice's average went out: peer.server.round_failures)."""

    def __init__(
        self,
        lost: set[str],
        reason: str,
        group: list[str] | None = None,
        stepped: bool = False,
        claimants: set[str] | None = None,
    ):
        super().__init__(reason)
        self.lost, self.reason, self.group, self.stepped = set(lost), reason, group, stepped
        self.claimants = set(claimants or ())


class OwnedSlice:
    """The slice this member reduces in one attempt: every member's pieces in, the averaged pieces out."""

    def __init__(self, attempt: Attempt, bounds: tuple[int, int], limits: Limits, codec: PieceCodec, pool, sign):
        self.attempt, self.limits, self.codec, self.pool = attempt, limits, codec, pool
        self.sign = sign  # (nonces, digest) -> our signature of this slice's statement (peer.server.slice_word)
        self.digest = new_digest()  # of the averaged pieces' bytes, in order: what every member gets
        self._signature: bytes | None = None
        self.confirm: averaging_pb2.Confirm | None = None  # ours, once our side of the attempt has every verdict
        self.pieces = piece_bounds(*bounds, limits.piece_elements)
        self.others = [p for p in attempt.group if p != attempt.me.peer_id]
        self.queues: dict[str, asyncio.Queue] = {}
        self.contributions: dict[str, averaging_pb2.Contribution] = {attempt.me.peer_id: attempt.me}
        self.arrived = asyncio.Event()  # every other member's header is in
        self.results: list[bytes] = []
        self.changed = asyncio.Condition()
        self.failure: Failed | None = None
        self.done = False

    def register(self, contribution: averaging_pb2.Contribution) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue(MAX_QUEUED)
        self.queues[contribution.peer_id] = queue
        self.contributions[contribution.peer_id] = contribution
        if all(p in self.queues for p in self.others):
            self.arrived.set()
        return queue

    async def fail(self, failure: Failed) -> None:
        if self.failure is None and not self.done:
            self.failure = failure
        async with self.changed:
            self.changed.notify_all()

    async def reduce(self) -> None:
        """Reduce every piece in order; the slice's failure (a lost member) ends it."""
        try:
            try:
                await asyncio.wait_for(self.arrived.wait(), self.limits.group_timeout)
            except TimeoutError:
                missing = {p for p in self.others if p not in self.queues}
                raise Failed(missing, f"no frame from {sorted(missing)} in {self.limits.group_timeout:.1f} s") from None
            group = self.attempt.group
            claims = [int(self.contributions[p].samples) for p in group]
            weights = fixed_weights(claims, self.limits.max_weight_ratio)
            loop = asyncio.get_running_loop()
            for start, end in self.pieces:
                if self.failure is not None:
                    raise self.failure
                received = await asyncio.gather(*(self._next(p) for p in self.others))
                encoded = await loop.run_in_executor(self.pool, self._reduce_piece, start, end, received, weights)
                async with self.changed:
                    self.results.append(encoded)
                    self.changed.notify_all()
            self.done = True
            logger.debug("step %d attempt %d: our slice reduced", self.attempt.epoch, self.attempt.attempt)
            async with self.changed:
                self.changed.notify_all()
        except Failed as e:
            await self.fail(e)
        except Exception as e:  # anything else ends the slice too, never the server
            logger.warning("averaging slice failed: %s", e)
            await self.fail(Failed(set(), f"{type(e).__name__}: {e}"))

    async def _next(self, peer: str) -> tuple[str, bytes]:
        if self.failure is not None:
            raise self.failure
        try:
            item = await asyncio.wait_for(self.queues[peer].get(), self.limits.read_timeout)
        except TimeoutError:
            raise Failed({peer}, f"{peer}: no piece in {self.limits.read_timeout:.1f} s") from None
        if isinstance(item, Failed):
            raise item
        return peer, item

    def _reduce_piece(
        self, start: int, end: int, received: list[tuple[str, memoryview]], weights: list[float]
    ) -> bytes:
        """On the averaging thread: decode the members' pieces, check them, aggregate, encode once into the frame
        every member gets; our own copy of the result is what they decode of it."""
        numel = end - start
        by_peer = {self.attempt.me.peer_id: self.attempt.flat.read(start, end)}
        bad = {}
        for peer, data in received:
            try:
                values = self.codec.decode(data, numel)
            except PieceError as e:
                bad[peer] = str(e)
                continue
            if not all_finite(values):
                bad[peer] = "values that are not finite"
                continue
            by_peer[peer] = values
        if bad:
            raise Failed(set(bad), "; ".join(f"{p} sent {why}" for p, why in sorted(bad.items())))
        parts = [by_peer[p] for p in self.attempt.group]
        result = (
            _mean(parts, weights)
            if self.limits.aggregate == "mean"
            else aggregate(parts, weights, self.limits.aggregate)
        )
        encoded = self.codec.encode(result)
        self.digest.update(encoded)  # pieces are reduced one at a time, in order
        frame = piece_frame(encoded)
        self.attempt.out[start:end] = result if not self.codec.lossy else self.codec.decode(encoded, numel)
        return frame

    async def result(self, index: int) -> bytes | None:
        """The frame of averaged piece `index` once reduced; None once the slice failed."""
        async with self.changed:
            while len(self.results) <= index and self.failure is None:
                await self.changed.wait()
            return self.results[index] if len(self.results) > index else None

    def verdict(self) -> averaging_pb2.AverageVerdict:
        if self.failure is not None:
            return averaging_pb2.AverageVerdict(
                ok=False, lost=sorted(self.failure.lost), reason=self.failure.reason, group=self.attempt.group
            )
        gathered = [self.contributions[p] for p in self.attempt.group]
        digest = self.digest.digest()
        if self._signature is None:
            self._signature = self.sign([c.nonce for c in gathered], digest)
        return averaging_pb2.AverageVerdict(
            ok=True, gathered=gathered, group=self.attempt.group, digest=digest, signature=self._signature
        )

    async def set_confirm(self, confirm: averaging_pb2.Confirm) -> None:
        """Our confirm (or why there is none), for the members our calls answer."""
        if self.confirm is None:
            self.confirm = confirm
        async with self.changed:
            self.changed.notify_all()

    async def confirmation(self, timeout: float) -> averaging_pb2.Confirm:
        """Our confirm once our side has it; a failed one if it did not come within `timeout`, which is then ours for
        good: a member told that we do not step checks nothing of ours, so we must not step (AllReduce._attempt)."""
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.confirm is not None), timeout)
            except TimeoutError:
                if self.confirm is None:
                    why = f"our side had not every verdict in {timeout:.1f} s"
                    self.confirm = averaging_pb2.Confirm(ok=False, reason=why)
        return self.confirm


def _mean(parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """The weighted mean of the pieces (zero weight: left out), summed in place: no stack of all of them."""
    total = sum(w for w in weights if w > 0)
    out = torch.zeros_like(parts[0], dtype=torch.float32)
    if total <= 0:
        return out
    for w, part in zip(weights, parts, strict=True):
        if w > 0:
            out.add_(part, alpha=w / total)
    return out


def liars_among(told_apart: set[str], verdicts: dict, me: str) -> set[str]:
    """Whoever told owners apart: for each member whose contribution the owners' verdicts name differently, the
    member itself, unless its own verdict names what it sent us (we saw it arrive): then the owners that name
    something else are the liars."""
    ours = {c.peer_id: contribution_key(c) for c in verdicts[me].gathered}
    liars = set()
    for member in told_apart:
        own = {contribution_key(c) for c in verdicts[member].gathered if c.peer_id == member}
        if member == me or own == {ours.get(member)}:
            liars |= {
                o
                for o, v in verdicts.items()
                if any(c.peer_id == member and contribution_key(c) != ours.get(member) for c in v.gathered)
            }
        else:
            liars.add(member)
    return liars
