"""Averaging among the replicas of one part, with hivemind's DecentralizedAverager.

What is averaged is the replicas' mean gradients (gradient mode) or their pseudo-gradients (local
mode); either way a sample-weighted mean, compressed on the wire by `compression.averaging`.

The one module of the runtime that imports hivemind's averaging. Replicas are matched through
the DHT under one prefix per stage; the group key carries the epoch, so replicas at different
optimizer steps never average together, and the expected group size (the replicas that accepted
the round's invitation), so a group never grows past what one of its members expects (hivemind's
key manager fails a member whose group outgrows its target). The target group size is set to
that size before each round, so a full group starts at once instead of waiting out the
matchmaking window.

A round steps whole groups only: each member gathers the peer ids it expects, and a group that
lacks one of them is discarded by all its members (two groups at one step would otherwise step
apart and leave the stage's replicas with different weights for good).
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from typing import AsyncIterator  # noqa: UP035 - hivemind reads typing's alias to see a streaming RPC

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture

from dht.node import SwarmDHT
from peer.averaging_codec import averaging_codec
from peer.config import RunSpec

logger = logging.getLogger(__name__)
EPOCH_BITS = 16  # the group key carries the epoch modulo 2**16: replicas at different steps never meet
SIZE_BITS = 10  # and the expected group size: a group never grows past what any member expects


def group_bits(epoch: int, size: int) -> str:
    """hivemind's group key bits for a round at `epoch` of `size` replicas."""
    return format(epoch % (1 << EPOCH_BITS), f"0{EPOCH_BITS}b") + format(size % (1 << SIZE_BITS), f"0{SIZE_BITS}b")


def _name(peer) -> str:
    """A peer id as text (hivemind hands PeerID objects)."""
    return peer.to_base58() if hasattr(peer, "to_base58") else str(peer)


def whole_group_missing(infos: list[dict], members: list[str], max_group_size: int) -> list[str]:
    """Replicas some member expected in the round but the group lacks (none when it is whole).

    Every member runs this on the same gathered data, so all reach the same verdict. Beyond
    `max_group_size` replicas a stage averages in several groups by design, and none is whole.
    """
    expected = set().union(*(set(info.get("expected", [])) for info in infos))
    if len(expected) > max_group_size:
        return []
    return sorted(expected - set(members))


def round_loss(runner) -> str | None:
    """What a finished hivemind all-reduce runner lost, if anything: results a reducer never returned,
    or senders whose tensors our own reducer went on without (banned mid-stream)."""
    if runner is None:
        return None
    if runner.tensor_part_container.failed_size:
        return "all-reduce returned only part of the averaged tensors"
    if runner.banned_senders:
        return f"all-reduce reduced our part without the tensors of {sorted(_name(p) for p in runner.banned_senders)}"
    return None


class _StageAverager(DecentralizedAverager):
    """hivemind's averager plus a way to change the target group size between rounds, and admission.

    hivemind authorizes nobody: any libp2p peer that finds the group key may ask to join. Here the
    leader refuses a join request from a peer id outside the admitted set, and a member refuses to
    run a group that lists one. libp2p authenticates peer ids (the Noise handshake proves the key the
    id is derived from), and our peer id is that same Ed25519 key, so the check is of the real peer.
    """

    _admitted: frozenset[str] | None = None  # peer ids that may average with us; None: anyone (admission off)

    def set_admitted(self, peers: set[str] | None, timeout: float) -> None:
        future = MPFuture()
        admitted = None if peers is None else sorted(peers)
        self._outer_pipe.send(("_set_admitted", [], dict(peers=admitted, future=future)))
        future.result(timeout=timeout)

    async def _set_admitted(self, peers: list[str] | None, future: MPFuture) -> None:
        self._admitted = None if peers is None else frozenset(peers)
        future.set_result(None)

    def _refused(self, peer_id) -> bool:
        return self._admitted is not None and peer_id.to_base58() not in self._admitted

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if self._refused(context.remote_id):
            logger.warning("refused an averaging join request from %s: not an admitted replica", context.remote_id)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    def set_target_group_size(self, size: int, timeout: float) -> None:
        future = MPFuture()
        self._outer_pipe.send(("_set_target_group_size", [], dict(size=size, future=future)))
        future.result(timeout=timeout)

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        """hivemind's all-reduce, made strict: a round that lost any part of the result fails.

        hivemind keeps the local values of parts a failed peer never returned, and averages the
        parts it reduces without a sender that failed mid-stream, and reports success either way;
        replicas would then step from different gradients (one side fails, the other steps). A
        round that lost anything instead fails on every side that saw the loss.
        """
        strangers = [p.to_base58() for p in group_info.peer_ids if self._refused(p)]
        if strangers:
            raise AllreduceException(f"the group lists peers that are not admitted replicas: {strangers}")
        await super()._run_allreduce_inplace_(tensors, group_info, group_id=group_id, **kwargs)
        future = self._running_groups.get(group_info.group_id if group_id is None else group_id)
        runner = future.result() if future is not None and future.done() else None
        loss = round_loss(runner)
        if loss:
            raise AllreduceException(loss)

    async def _set_target_group_size(self, size: int, future: MPFuture) -> None:
        matchmaking = self._matchmaking
        matchmaking.target_group_size = size
        matchmaking.potential_leaders.target_group_size = size
        matchmaking.group_key_manager.target_group_size = size
        future.set_result(None)


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
        previous = signal.getsignal(signal.SIGINT)
        self._averager = _StageAverager(
            [torch.zeros_like(t, device="cpu") for t in template],  # hivemind forks: no CUDA tensors
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
        )
        signal.signal(signal.SIGINT, previous)  # hivemind's averager sets SIGINT to ignored in its creator

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
        try:
            gathered = self._round(gradients, samples, epoch, len(expected), admitted, gather)
        except Exception as e:  # a failed round must not take the server down
            logger.warning("averaging for step %d failed: %s", epoch, e)
            return None
        infos = {_name(pid): info for pid, info in (gathered or {}).items()}
        if not self._whole(infos, epoch):
            return None
        with self._averager.get_tensors() as tensors:
            averaged = [t.clone() for t in tensors]
        coverage = {pid: (int(i.get("incarnation", 0)), int(i.get("seq", 0))) for pid, i in infos.items()}
        total = sum(int(i.get("samples", 0)) for i in infos.values())
        return RoundResult(averaged, total, len(infos), sorted(infos), coverage)

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
        except Exception as e:
            logger.debug("averager shutdown: %s", e)
