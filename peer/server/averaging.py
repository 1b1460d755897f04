"""Averaging among the replicas of one part, by our own all-reduce (peer.server.allreduce) in this process.

What is averaged is the replicas' mean gradients (gradient mode) or their pseudo-gradients (local
mode); either way a sample-weighted mean (or a robust aggregate), compressed on the wire by
`compression.averaging`.

The group is the one the replicas' round protocol fixed (peer.server.replica_round: the replicas that
accepted the round's invitation). The all-reduce goes on without a member it loses mid-round (dead,
stopped, or sending what it should not), with a quorum of the group; every member then steps the same
average and records the same coverage (what each member's step counted), so trainers replay exactly
the samples of the members left out."""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from peer.config import RunSpec
from peer.server.allreduce import AllReduce, Limits
from peer.server.owned_slice import norm_claim
from peer.server.piece_codec import PieceCodec
from peer.server.slice_word import NONCE_BYTES
from protocols import averaging_pb2

logger = logging.getLogger(__name__)


@dataclass
class RoundResult:
    gradients: list[torch.Tensor]  # the group's sample-weighted mean gradients
    group_samples: int  # samples accounted by the whole group
    group_size: int
    members: list[str]  # peer ids of the group
    coverage: dict[str, tuple[int, int]]  # peer id -> (incarnation, seq): the accumulator additions it brought


class GradientAverager:
    """Averages a part's gradients with its replicas; its all-reduce serves their calls on the replica's loop."""

    def __init__(self, spec: RunSpec, block_size: int | None = None):
        self.cfg = spec.averaging
        block = block_size or spec.compression.block_size
        compression = PieceCodec(spec.compression.averaging, block)
        self.allreduce = AllReduce(Limits.from_spec(spec), compression, block)
        # local mode with a lossy codec: error feedback. What the codec rounded off this replica's last
        # pseudo-gradient is added to its next one, so int4's error is sent a round later instead of lost
        self._codec = compression if spec.local_updates and compression.lossy else None
        self.residual: list[torch.Tensor] = []  # the rounding error not yet sent (empty: none)
        # the epoch whose round the residual belongs to: the one after the round it came from. A replica that
        # loaded another's state (it resynced past a step) starts anew: its old rounding is of another trajectory
        self.residual_epoch = -1
        self.refused_in_a_row = 0  # means refused as implausible since the last one taken
        # what this replica states a round with one claimant should be held to (`own_reference`; the group judges
        # by the lower median of its members' statements): the references of the last rounds taken with two
        # claimants or more, and this replica's own norms when it brought samples (its own word is honest to itself)
        self.references: collections.deque[float] = collections.deque(maxlen=16)
        # step after the round -> its group's members, for the last rounds whose mean was refused: a replica
        # that stepped such a group took poison (peer.server.replica_state will not take its state)
        self.refused_groups: collections.OrderedDict[int, list[str]] = collections.OrderedDict()
        self.loop: asyncio.AbstractEventLoop | None = None  # the replica's, where the all-reduce runs

    def average(
        self,
        gradients: list[torch.Tensor],
        samples: int,
        epoch: int,
        expected: list[str],
        admitted: set[str] | None = None,
        covers: tuple[int, int] = (0, 0),
    ) -> RoundResult | None:
        """One round at `epoch` with the replicas `expected` (peer ids, ours included); None if it failed.

        Called off the replica's loop (its round thread). `covers` is (incarnation, seq): the accumulator
        additions these gradients hold, recorded with the step by every member, so that whoever looks later
        knows exactly what it counted. With `admitted`, only those peer ids are in the group.
        """
        group = [p for p in expected if admitted is None or p in admitted]
        pending = None
        if self._codec is not None:
            gradients, pending = self._rounded(gradients, epoch)
        me = averaging_pb2.Contribution(
            peer_id=self.allreduce.peer_id,
            samples=max(0, samples),
            incarnation=covers[0],
            seq=covers[1],
            norm=_norm(gradients),
            nonce=os.urandom(NONCE_BYTES),  # this round's alone (peer.server.slice_word)
            reference=self.own_reference(),
        )
        self.remember_own(me.norm, samples)
        try:
            outcome = self._round(gradients, me, epoch, group)
        except Exception as e:  # a failed round must not take the server down
            logger.warning("averaging for step %d failed: %s", epoch, e)
            return None
        if outcome is None:
            return None
        members = [c.peer_id for c in outcome.gathered]
        total = sum(int(c.samples) for c in outcome.gathered)
        if total <= 0:  # the weights were all 0: the mean is 0/0; every member sees the same total and skips
            logger.warning("averaging group for step %d brought no samples: nobody steps", epoch)
            self.unstep(epoch)
            return None
        averaged = outcome.averaged
        gathered = outcome.gathered
        if not self._plausible(averaged, epoch, members, claimed_norms(gathered), stated_references(gathered)):
            # every member judges alike (the same claims and references, from the owners' verdicts): the
            self.unstep(epoch)  # next round at this step is a new one
            return None
        coverage = {c.peer_id: (int(c.incarnation), int(c.seq)) for c in outcome.gathered}
        if pending is not None and samples > 0:  # stepped with our part in it: its rounding goes with the next round
            self.residual, self.residual_epoch = (pending, epoch + 1) if pending else ([], -1)
        return RoundResult(averaged, total, len(members), members, coverage)

    def unstep(self, epoch: int) -> None:
        """From any thread: the average of the round for `epoch` was not stepped (peer.server.allreduce.unstep)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.allreduce.unstep, epoch)

    def _round(self, gradients, me, epoch: int, group: list[str]):
        """The all-reduce on the replica's loop, waited for here within the round's bound."""
        if self.loop is None:
            raise RuntimeError("the averager is not bound to its replica's event loop yet")
        future = asyncio.run_coroutine_threadsafe(self.allreduce.round(gradients, me, epoch, group), self.loop)
        bound = self.cfg.max_attempts * (self.cfg.group_timeout + self.cfg.averaging_timeout) + 1.0
        try:
            return future.result(timeout=bound)
        except FutureTimeout:
            future.cancel()
            raise TimeoutError(f"the round did not finish in {bound:.0f} s") from None

    def _rounded(self, gradients: list[torch.Tensor], epoch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Error feedback: these pseudo-gradients plus the last residual, rounded by the codec here, and what the
        rounding left out (the residual once the round steps).

        Rounded here over the flat vector (the all-reduce's blocks are the flat vector's), a contribution crosses
        the codec unchanged, so the mean every owner reduces is of exactly these values, and what is left out is
        exactly known. Only the mean's way back to the members is rounded again, not fed back.
        """
        if self.residual and epoch == self.residual_epoch:
            gradients = [g + r for g, r in zip(gradients, self.residual, strict=True)]
        flat = torch.cat([g.detach().reshape(-1).float() for g in gradients])
        rounded = self._codec.roundtrip(flat)
        residual = flat - rounded
        if not bool(torch.isfinite(residual).all()):  # a non-finite contribution leaves no residual
            residual = torch.zeros(0)
        return _shaped(rounded, gradients), (_shaped(residual, gradients) if residual.numel() else [])

    def _plausible(self, averaged, epoch: int, members: list[str], claims: list[float], stated=()) -> bool:
        """Whether a group's mean may be stepped: finite, and its norm within averaging.max_norm_ratio of a reference.
        With two claims or more (`claimed_norms`: the norms the members with samples said they sent, the same in
        every member's verdicts), the lower median of the claims: one member can lower it (its rounds are refused
        then, as when it sends poison), never raise it above an honest claimant's own norm while honest members
        are at least half of the claimants; a reference of past means let one member raise it round by round,
        100x every ~9 rounds. With one claim (one member brought samples: the mean is its vector), the lower
        median of the references its members `stated` (`stated_references`: each member's `own_reference`), which
        one member can lower but not raise above an honest one's while honest members are at least half; with
        none stated, that claim (a lone member's mean goes unchecked then). Each replica once held such rounds to
        its own references: they differ, one stepped a poison-sized mean another refused, and the refuser could
        load nobody's state (`refused_groups`) while the others stepped on."""
        ratio, norm = self.cfg.max_norm_ratio, _norm(averaged)
        if len(claims) >= 2:
            reference = sorted(claims)[(len(claims) - 1) // 2]
        elif stated:
            reference = sorted(stated)[(len(stated) - 1) // 2]
        else:
            reference = claims[0] if claims else math.inf
        # a mean that is not finite is no honest group's (NaN compares False with everything: checked first)
        if not math.isfinite(norm) or (ratio > 0 and norm > ratio * reference):
            self.refused_in_a_row += 1
            self.refused_groups[epoch + 1] = members
            while len(self.refused_groups) > 64:
                self.refused_groups.popitem(last=False)
            logger.warning(
                "refused the mean of the averaging group for step %d (%s): its norm %.3g is %.0f times the "
                "reference %.3g, of the norms its members said they sent or (one sent samples) of the references "
                "they stated (averaging.max_norm_ratio); a member sent poison",
                epoch,
                ", ".join(members),
                norm,
                norm / reference if reference > 0 else math.inf,
                reference,
            )
            return False
        self.refused_in_a_row = 0
        if len(claims) >= 2:
            self.references.append(reference)
        return True

    def own_reference(self) -> float | None:
        """What this replica holds a round with one claimant to, stated with its contribution: the median of its
        references once it has 4 (None before)."""
        if len(self.references) < 4:
            return None
        return sorted(self.references)[len(self.references) // 2]

    def remember_own(self, norm: float, samples: int) -> None:
        """This replica's own contribution's norm, a reference for rounds with one claimant, when it brought samples."""
        if samples > 0 and math.isfinite(norm):
            self.references.append(norm)

    def shutdown(self) -> None:
        self.allreduce.shutdown()


def claimed_norms(gathered) -> list[float]:
    """The norms the members that brought samples said they sent; a member that said none, or no finite number
    >= 0, claims nothing (it cannot lower the reference by leaving its claim out)."""
    return [x for c in gathered if c.samples > 0 and (x := norm_claim(c)) is not None]


def stated_references(gathered) -> list[float]:
    """The references the members stated (`GradientAverager.own_reference`): absent, or no finite number >= 0,
    states nothing."""
    return [x for c in gathered if (x := norm_claim(c, "reference")) is not None]


def _norm(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of tensors taken as one vector."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in tensors))


def _shaped(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat`, shaped as the tensors `like`."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out
