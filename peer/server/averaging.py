"""Averaging among the replicas of one part, with hivemind's DecentralizedAverager.

What is averaged is the replicas' mean gradients (gradient mode) or their pseudo-gradients (local
mode); either way a sample-weighted mean, compressed on the wire by `compression.averaging`.

With peer.server.hivemind_averager (which holds all that touches hivemind's internals), the one place
of the runtime that uses hivemind's averaging. Replicas are matched through
the DHT under one prefix per stage; the group key carries the epoch, so replicas at different
optimizer steps never average together, and the expected group size (the replicas that accepted
the round's invitation), so a group never grows past what one of its members expects (hivemind's
key manager fails a member whose group outgrows its target). The target group size is set to
that size before each round, so a full group starts at once instead of waiting out the
matchmaking window.

A round steps whole groups only: each member gathers the peer ids it expects, and a group that
lacks one of them is discarded by all its members (two groups at one step would otherwise step
apart and leave the stage's replicas with different weights for good)."""

from __future__ import annotations

import collections
import logging
import math
import signal
from dataclasses import dataclass

import torch

from dht.node import SwarmDHT
from peer.config import RunSpec
from peer.model import allocation
from peer.server.averaging_codec import averaging_codec
from peer.server.hivemind_averager import StageAverager, peer_name
from peer.server.robust import claimed_samples

logger = logging.getLogger(__name__)


EPOCH_BITS = 16  # the group key carries the epoch modulo 2**16: replicas at different steps never meet


SIZE_BITS = 10  # and the expected group size: a group never grows past what any member expects


def group_bits(epoch: int, size: int) -> str:
    """hivemind's group key bits for a round at `epoch` of `size` replicas."""
    return format(epoch % (1 << EPOCH_BITS), f"0{EPOCH_BITS}b") + format(size % (1 << SIZE_BITS), f"0{SIZE_BITS}b")


def whole_group_missing(infos: list[dict], members: list[str], max_group_size: int) -> list[str]:
    """Replicas some member expected in the round but the group lacks (none when it is whole).

    Every member runs this on the same gathered data, so all reach the same verdict. Beyond
    `max_group_size` replicas a stage averages in several groups by design, and none is whole.
    """
    expected = set().union(*(set(info.get("expected", [])) for info in infos))
    if len(expected) > max_group_size:
        return []
    return sorted(expected - set(members))


@dataclass
class RoundResult:
    gradients: list[torch.Tensor]  # the group's sample-weighted mean gradients
    group_samples: int  # samples accounted by the whole group
    group_size: int
    members: list[str]  # peer ids of the group
    coverage: dict[str, tuple[int, int]]  # peer id -> (incarnation, seq): the accumulator additions it brought


class GradientAverager:
    """Averages a stage's gradients with its replicas; must be created on the main thread."""

    def __init__(self, dht: SwarmDHT, prefix: str, template: list[torch.Tensor], spec: RunSpec):
        self.cfg = cfg = spec.averaging
        compression = averaging_codec(spec.compression.averaging, spec.compression.block_size)
        # local mode with a lossy codec: error feedback. What the codec rounded off this replica's last
        # pseudo-gradient is added to its next one, so int4's error is sent a round later instead of lost
        self._codec = compression if spec.local_updates and spec.compression.averaging != "none" else None
        self.residual: list[torch.Tensor] = []  # the rounding error not yet sent (empty: none)
        # the epoch whose round the residual belongs to: the one after the round it came from. A replica that
        # loaded another's state (it resynced past a step) starts anew: its old rounding is of another trajectory
        self.residual_epoch = -1
        previous = signal.getsignal(signal.SIGINT)
        self._averager = StageAverager(
            # hivemind forks: no CUDA tensors; shared, in memory once a round writes them
            [allocation.shared_zeros(t.shape, t.dtype) for t in template],
            dht=dht.dht,
            prefix=prefix,
            start=True,
            target_group_size=cfg.max_group_size,
            min_group_size=2,
            min_matchmaking_time=cfg.min_matchmaking_time,
            request_timeout=min(cfg.request_timeout, cfg.min_matchmaking_time * 0.75),
            allreduce_timeout=cfg.averaging_timeout,
            next_chunk_timeout=cfg.averaging_timeout / 2,
            allow_state_sharing=False,  # state travels over our gRPC GetState, not hivemind's
            compression=compression,
            aggregate=cfg.aggregate,
            max_weight_ratio=cfg.max_weight_ratio,
        )
        signal.signal(signal.SIGINT, previous)  # hivemind's averager sets SIGINT to ignored in its creator
        self.accepted_norms: collections.deque[float] = collections.deque(maxlen=16)  # of the last means taken
        self.refused_in_a_row = 0  # means refused as implausible since the last one taken
        # step after the round -> its group's members, for the last rounds whose mean was refused: a replica
        # that stepped such a group took poison (peer.server.replica_state will not take its state)
        self.refused_groups: collections.OrderedDict[int, list[str]] = collections.OrderedDict()

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

        `covers` is (incarnation, seq): the accumulator additions these gradients hold, recorded
        with the step by every member, so that whoever looks later knows exactly what it counted.

        A round steps only a whole group: one that lacks a replica any member expected (two groups
        formed at one step, or one member saw a partner the others missed) is discarded by every
        member alike, since they all judge the same gathered data. With `admitted`, only those peer
        ids may be in the group (the others are refused).
        """
        gather = {"epoch": epoch, "samples": samples, "expected": sorted(expected)}
        gather.update(incarnation=covers[0], seq=covers[1])
        pending = None
        if self._codec is not None:
            gradients, pending = self._rounded(gradients, epoch)
        try:
            gathered = self._round(gradients, samples, epoch, len(expected), admitted, gather)
        except Exception as e:  # a failed round must not take the server down
            logger.warning("averaging for step %d failed: %s", epoch, e)
            return None
        infos = {peer_name(pid): info for pid, info in (gathered or {}).items()}
        if not self._whole(infos, epoch):
            return None
        # what the members hold, as they said (the mean's weights are these, capped: peer.server.robust)
        total = sum(claimed_samples(i) for i in infos.values())
        if total <= 0:  # the weights were all 0: the mean is 0/0; every member sees the same total and skips
            logger.warning("averaging group for step %d brought no samples: nobody steps", epoch)
            return None
        with self._averager.get_tensors() as tensors:
            averaged = [t.clone() for t in tensors]
        if not all(torch.isfinite(t).all() for t in averaged):  # the same mean on every member: all skip alike
            logger.warning("averaging group for step %d produced a mean that is not finite: nobody steps", epoch)
            return None
        if not self._plausible(averaged, gradients, samples, epoch, sorted(infos)):
            return None
        coverage = {pid: (int(i.get("incarnation", 0)), int(i.get("seq", 0))) for pid, i in infos.items()}
        if pending is not None and samples > 0:  # stepped with our part in it: its rounding goes with the next round
            # (a non-finite contribution, left out of the mean by the robust aggregates, leaves no residual)
            finite = all(bool(torch.isfinite(r).all()) for r in pending)
            self.residual, self.residual_epoch = (pending, epoch + 1) if finite else ([], -1)
        return RoundResult(averaged, total, len(infos), sorted(infos), coverage)

    def _rounded(self, gradients: list[torch.Tensor], epoch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Error feedback: these pseudo-gradients plus the last residual, rounded by the codec here, and what the
        rounding left out (the residual once the round steps).

        Rounded here, a contribution crosses the codec unchanged (its blocks are the parts' blocks), so the mean
        every member reduces is of exactly these values, and what is left out is exactly known. Only the mean's
        way back to the members is rounded again (hivemind's delta to a part's reducer), not fed back.
        """
        if self.residual and epoch == self.residual_epoch:
            gradients = [g + r for g, r in zip(gradients, self.residual, strict=True)]
        rounded = [self._codec.roundtrip(g) for g in gradients]
        return rounded, [g - q for g, q in zip(gradients, rounded, strict=True)]

    def _plausible(self, averaged, own, samples: int, epoch: int, members: list[str]) -> bool:
        """Whether a group's mean may be stepped: its norm within averaging.max_norm_ratio of the median of the
        last means taken (all replicas that stepped together judge alike), or before 4 of those, of our own."""
        ratio, norm = self.cfg.max_norm_ratio, _norm(averaged)
        if len(self.accepted_norms) >= 4:
            reference = sorted(self.accepted_norms)[len(self.accepted_norms) // 2]
        else:
            reference = _norm(own) if samples > 0 else 0.0
        if ratio > 0 and reference > 0 and norm > ratio * reference:
            self.refused_in_a_row += 1
            self.refused_groups[epoch + 1] = members
            while len(self.refused_groups) > 64:
                self.refused_groups.popitem(last=False)
            logger.warning(
                "refused the mean of the averaging group for step %d (%s): its norm %.3g is %.0f times the usual "
                "%.3g (averaging.max_norm_ratio); a member sent poison",
                epoch,
                ", ".join(members),
                norm,
                norm / reference,
                reference,
            )
            return False
        self.refused_in_a_row = 0
        self.accepted_norms.append(norm)
        return True

    def _round(self, gradients, samples: int, epoch: int, expected: int, admitted, gather: dict) -> dict | None:
        """hivemind's round: its group key, the tensors in, then the step; what every member gathered."""
        size = max(2, min(expected, self.cfg.max_group_size))
        self._averager.set_target_group_size(size, timeout=self.cfg.request_timeout * 5)
        self._averager.set_admitted(admitted, timeout=self.cfg.request_timeout * 5)
        self._averager.set_group_bits(group_bits(epoch, size))
        with self._averager.get_tensors() as tensors:
            for dst, src in zip(tensors, gradients, strict=True):
                dst.copy_(src)
        control = self._averager.step(
            gather=gather,
            weight=float(samples),
            timeout=min(self.cfg.group_timeout, self.cfg.averaging_timeout),  # to find the whole group
            allow_retries=False,  # a failed round steps nobody; the next round comes soon
            wait=False,
        )
        try:  # hivemind waits for a round's end without a bound: a stopped averager would hang us
            return control.result(timeout=self.cfg.group_timeout + self.cfg.averaging_timeout + 1.0)
        except TimeoutError:
            control.cancel()
            raise TimeoutError("the averager did not finish the round in time") from None

    def _whole(self, infos: dict[str, dict], epoch: int) -> bool:
        """Whether the group may step: all at `epoch`, and holding every replica a member expected."""
        if not infos:
            return False
        if any(not isinstance(i, dict) or i.get("epoch") != epoch for i in infos.values()):
            logger.warning("averaging group for step %d mixed epochs: %s", epoch, list(infos.values()))
            return False
        missing = whole_group_missing(list(infos.values()), sorted(infos), self.cfg.max_group_size)
        if missing:
            logger.warning(
                "averaging group for step %d (%d members) lacks %s, whom a member expected: nobody steps",
                epoch,
                len(infos),
                ", ".join(missing),
            )
        return not missing

    def shutdown(self) -> None:
        try:
            self._averager.shutdown()
        except Exception as e:  # shutting down must go on whatever hivemind raises
            logger.warning("averager shutdown: %s", e)


def _norm(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of tensors taken as one vector."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in tensors))
