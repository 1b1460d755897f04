"""The one module that reaches into hivemind's averager internals, pinned to the hivemind version it
was checked against (HIVEMIND_CHECKED; another version is refused at import, since these are
not hivemind's public API and may change in any release):

- `_outer_pipe`: running a method in the averager's own process (set_admitted, set_target_group_size);
- `_matchmaking` and its key manager and leader set: the target group size between rounds;
- `_run_allreduce_inplace_` and `_running_groups`: a strict all-reduce that fails a round that lost
  any part of its result (the runner's `tensor_part_container.failed_size`, `banned_senders`);
- `rpc_join_group`: refusing peers that are not admitted replicas."""

from __future__ import annotations

import logging
from typing import AsyncIterator  # noqa: UP035 - hivemind reads typing's alias to see a streaming RPC

import hivemind
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture

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
