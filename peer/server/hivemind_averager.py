"""The one module that reaches into hivemind's averager internals, pinned to the hivemind version it
was checked against (HIVEMIND_CHECKED; another version is refused at import, since these are
not hivemind's public API and may change in any release):

- `_outer_pipe`: running a method in the averager's own process (set_admitted, set_target_group_size);
- `_matchmaking` and its key manager and leader set: the target group size between rounds;
- `_run_allreduce_inplace_`, `_running_groups` and the runner's reducer: an all-reduce whose weights,
  partition and aggregate the group's gathered data fixes (peer.server.robust), strict: a round that lost
  any part of its result fails (the runner's `tensor_part_container.failed_size`, `banned_senders`);
- `rpc_join_group`: refusing peers that are not admitted replicas."""

from __future__ import annotations

import logging
from typing import AsyncIterator  # noqa: UP035 - hivemind reads typing's alias to see a streaming RPC

import hivemind
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.partition import TensorPartReducer
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import as_aiter, azip

from peer.server.robust import aggregate, claimed_samples, fixed_weights

logger = logging.getLogger(__name__)
HIVEMIND_CHECKED = "1.1.12"  # the hivemind release whose internals this module was checked against

if hivemind.__version__ != HIVEMIND_CHECKED:
    raise ImportError(
        f"peer.server.hivemind_averager was checked against hivemind {HIVEMIND_CHECKED}, not {hivemind.__version__}: "
        f"pin hivemind=={HIVEMIND_CHECKED} (pyproject.toml does), or check its averager internals again"
    )


def peer_name(peer) -> str:
    """A peer id as text (hivemind hands PeerID objects)."""
    return peer.to_base58() if hasattr(peer, "to_base58") else str(peer)


def round_loss(runner) -> str | None:
    """What a finished hivemind all-reduce runner lost, if anything: results a reducer never returned,
    or senders whose tensors our own reducer went on without (banned mid-stream)."""
    if runner is None:
        return None
    if runner.tensor_part_container.failed_size:
        return "all-reduce returned only part of the averaged tensors"
    if runner.banned_senders:
        return (
            f"all-reduce reduced our part without the tensors of {sorted(peer_name(p) for p in runner.banned_senders)}"
        )
    return None


class StageAverager(DecentralizedAverager):
    """hivemind's averager plus a way to change the target group size between rounds, and admission.

    hivemind authorizes nobody: any libp2p peer that finds the group key may ask to join. Here the
    leader refuses a join request from a peer id outside the admitted set, and a member refuses to
    run a group that lists one. libp2p authenticates peer ids (the Noise handshake proves the key the
    id is derived from), and our peer id is that same Ed25519 key, so the check is of the real peer.
    """

    _admitted: frozenset[str] | None = None  # peer ids that may average with us; None: anyone (admission off)

    def __init__(self, *args, aggregate: str = "mean", max_weight_ratio: float = 0.0, **kwargs):
        self._aggregate = aggregate  # how the parts we reduce become one (peer.server.robust.AGGREGATES)
        self._max_weight_ratio = max_weight_ratio  # a member's weight cap, in lower medians of the claims; 0: none
        super().__init__(*args, **kwargs)  # forks: what the averager's process reads is set before

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
        """hivemind's all-reduce with what the group's gathered data fixes, made strict.

        Each member's weight is the samples it gathered (capped, peer.server.robust.fixed_weights), not
        the weight its messages carry; every member that reduces takes an equal share of the tensors,
        whatever bandwidth it claimed (a member claiming a huge one would reduce them all); the
        aggregate is `aggregate` (mean, median, clipped). hivemind keeps the local values of parts a
        failed peer never returned, and averages the parts it reduces without a sender that failed
        mid-stream, and reports success either way; replicas would then step from different gradients
        (one side fails, the other steps). A round that lost anything instead fails on every side that
        saw the loss.
        """
        strangers = [p.to_base58() for p in group_info.peer_ids if self._refused(p)]
        if strangers:
            raise AllreduceException(f"the group lists peers that are not admitted replicas: {strangers}")
        group_id = group_info.group_id if group_id is None else group_id
        gathered = [_gathered(self.serializer, g) for g in group_info.gathered]
        kwargs["peer_fractions"] = equal_shares(self.total_size, [mode for mode, _ in gathered])
        runner = GroupRunner(
            weights=fixed_weights([samples for _, samples in gathered], self._max_weight_ratio),
            aggregate=self._aggregate,
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        async for tensor, update in azip(as_aiter(*tensors), runner):
            tensor.add_(update, alpha=self._averaging_alpha)
            self.last_updated = get_dht_time()
            self._state_updated.set()
        loss = round_loss(runner)
        if loss:
            raise AllreduceException(loss)

    async def _set_target_group_size(self, size: int, future: MPFuture) -> None:
        matchmaking = self._matchmaking
        matchmaking.target_group_size = size
        matchmaking.potential_leaders.target_group_size = size
        matchmaking.group_key_manager.target_group_size = size
        future.set_result(None)


def _gathered(serializer, data: bytes) -> tuple[AveragingMode, int]:
    """A member's mode and the samples it announced, from its gathered data (malformed: a client with none)."""
    try:
        _, mode, user = serializer.loads(data)
        return AveragingMode(mode), claimed_samples(serializer.loads(user))
    except Exception:  # what a member gathered is its own to get wrong; it then reduces nothing and weighs 0
        return AveragingMode.CLIENT, 0


def equal_shares(total_size: int, modes: list[AveragingMode]) -> tuple[int, ...]:
    """Elements each member reduces: equal shares among those that reduce (all but clients)."""
    reducers = [i for i, mode in enumerate(modes) if mode != AveragingMode.CLIENT]
    shares = [0] * len(modes)
    for rank, i in enumerate(reducers):
        shares[i] = total_size // len(reducers) + (rank < total_size % len(reducers))
    return tuple(shares)


class GroupRunner(AllReduceRunner):
    """hivemind's all-reduce runner with our reducer: fixed weights per sender and the chosen aggregate."""

    def __init__(self, *, weights: list[float], aggregate: str, ordered_peer_ids, **kwargs):
        super().__init__(ordered_peer_ids=ordered_peer_ids, **kwargs)
        by_peer = dict(zip(ordered_peer_ids, weights, strict=True))
        # hivemind's own reducer is replaced unused: finished, so that it does not warn it received nothing
        self.tensor_part_reducer.finished.set()
        self.tensor_part_reducer = GroupReducer(
            tuple(part.shape for part in self.parts_for_local_averaging),
            [by_peer[p] for p in self.sender_peer_ids],
            aggregate,
        )


class GroupReducer(TensorPartReducer):
    """hivemind's part reducer with the weights fixed per sender (those its messages carry are ignored), and
    for a robust aggregate, each part made one from all senders' copies once they are all in."""

    def __init__(self, part_shapes, weights: list[float], kind: str):
        self.weights, self.kind = weights, kind
        self.received: dict[int, dict[int, object]] = {}  # part index -> sender -> its part (robust aggregates)
        super().__init__(part_shapes, len(weights))

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part, weight: float = 1.0):
        if 0 <= part_index < self.num_parts and tensor_part.shape != self.part_shapes[part_index]:
            # a part must be the shape this reducer expects (a codec checks a part against its own declared
            # shape only): else it would broadcast into the sum, or fail the stack of a robust aggregate.
            # Raising here bans the sender, and the round fails as lossy
            raise AllreduceException(
                f"sender {sender_index} sent part {part_index} of shape {tuple(tensor_part.shape)}, "
                f"not {tuple(self.part_shapes[part_index])}"
            )
        if self.kind != "mean" and 0 <= sender_index < self.num_senders:
            self.received.setdefault(part_index, {})[sender_index] = tensor_part
        weight = self.weights[sender_index] if 0 <= sender_index < self.num_senders else 0.0
        return await super().accumulate_part(sender_index, part_index, tensor_part, weight)

    def finalize(self):
        self.received.clear()
        super().finalize()

    def check_current_part_finished(self):
        index = self.current_part_index
        if self.kind != "mean" and self.current_part_accumulated_from == self.num_current_senders:
            received = self.received.pop(index, {})
            senders = sorted(s for s in received if index < self.sender_failed_after[s])
            if senders:  # none (all failed): hivemind's 0/0, and the round fails as lossy
                parts, weights = [received[s] for s in senders], [self.weights[s] for s in senders]
                robust = aggregate(parts, weights, self.kind)
                self.accumulator, self.denominator = robust, 1.0
        super().check_current_part_finished()
