"""A stage server: serves one pipeline stage over gRPC and keeps its optimizer in step with the stage's replicas.

The step protocol with the other replicas is peer.server.replica's; this module adds the gRPC server,
the stage's backward (which may start a step) and balancing: moving to the stage that needs the
server most.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dht import keys
from dht.node import SwarmDHT
from dht.records import ServerRecord
from peer.config import PeerConfig, RunSpec
from peer.model.runtime import StageRuntime
from peer.net.guard import CALLER
from peer.net.refusal import Refused
from peer.net.relay import add_relay, offered_relay
from peer.net.serving import announce_host, grpc_server, listen
from peer.net.uplink import Uplink
from peer.process import memory
from peer.process.status_lines import say
from peer.server.averaging import GradientAverager
from peer.server.replica import Part, Replica
from peer.server.servicer import StageServicer, add_to_server
from peer.swarm.balance import plan_move, stage_totals
from protocols.failures import Reason

logger = logging.getLogger(__name__)


async def open_grpc_server(
    cfg: PeerConfig, servicer, security=None, relay=None
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, str]:
    """Start a gRPC server with `servicer` and health checking (NOT_SERVING until set); its announced endpoint.

    With `relay` (peer.net.relay.RelayService), the server also relays for peers that cannot be dialled.
    """
    net = cfg.network
    server = grpc_server(cfg, security)
    add_to_server(servicer, server)
    if relay is not None:
        add_relay(server, relay)
    checker = health.aio.HealthServicer()
    await checker.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # until the state is loaded
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    port = listen(server, f"{net.host}:{net.port}", security)
    await server.start()
    return server, checker, f"{announce_host(net.host, net.announce_host)}:{port}"


class StageServer(Replica):
    def __init__(
        self,
        spec: RunSpec,
        stage: int,
        cfg: PeerConfig,
        dht: SwarmDHT,
        runtime: StageRuntime,
        averager: GradientAverager | None,
        balance: bool = False,
    ):
        super().__init__(spec, Part(stage), cfg, dht, runtime, averager)
        self.grpc_server: grpc.aio.Server | None = None
        self.balance = balance  # move to a better stage when it raises the bottleneck
        self.allowed_stages: set[int] | None = None  # stages this peer may move to (None: any)
        self.move_to: int | None = None  # the stage this server leaves to serve, once decided
        self.done = asyncio.Event()  # set when the server wants its process to end (it moves)
        self._next_balance = float("inf")  # set when serving starts: the cooldown counts from there
        self.claim: tuple[int, float] | None = None  # (stage, unix time) this server announced it moves to
        self._balance_task: asyncio.Task | None = None
        # torch work once the stage's weights are in (loaded or from the seed), before it serves; it is
        # given the bytes the process held before they came
        self.before_serving: Callable[[int], None] | None = None
        self.told_to_leave = self.done.is_set  # a signal while it loads its state: it leaves without serving
        # caller -> samples of its backwards counted here, the latest callers (server.max_counted_callers)
        self.counted_by: collections.OrderedDict[str, int] = collections.OrderedDict()

    def _backward_job(self, uid, inputs, grad_outputs, targets, deadline, count):
        """Torch thread: the backward's answer, and whether it added something (not dry, not a retry of a uid
        already added, which is answered again with the first addition's number)."""
        self._drop_if_expired()
        rt = self.runtime
        epoch, fresh = rt.progress, count and not (uid and uid in rt.counted)
        if self.leaving and (fresh or not count):  # checked again here: the servicer looked before it was queued
            raise Refused(grpc.StatusCode.UNAVAILABLE, "this server is leaving the swarm", Reason.LEAVING)
        grad_inputs, loss, seq = rt.backward(uid, inputs, grad_outputs, targets, deadline, count)
        return (grad_inputs, loss, epoch, seq, rt.incarnation, rt.stepped_seq), fresh

    async def backward(self, uid, inputs, grad_outputs, targets, deadline=None, count=True):
        """`count` False: the input gradients only, nothing added (a dry backward). A caller's samples are counted
        (its row in the books, `_count_caller`) only for a backward that added them: a retry answered again, or
        a key that sends one uid over and over, counts once."""
        result, fresh = await self.run_torch(self._backward_job, uid, inputs, grad_outputs, targets, deadline, count)
        if fresh and CALLER.get():
            self._count_caller(CALLER.get(), int(inputs.shape[0]) if inputs is not None and inputs.dim() else 1)
        self._maybe_step()  # queued on the torch thread before this response leaves
        return result

    def _count_caller(self, caller: str, samples: int) -> None:
        """`samples` of `caller`'s backward were counted here (announced in `counted`: peer.swarm.books). Kept for
        16 times the callers announced (the latest), so that a caller that called again after others counts on
        from where it was."""
        self.counted_by[caller] = self.counted_by.pop(caller, 0) + samples
        while len(self.counted_by) > 16 * self.cfg.server.max_counted_callers:
            self.counted_by.popitem(last=False)

    async def on_progress(self) -> None:
        if self.balance and time.monotonic() >= self._next_balance and not self.leaving:
            self._next_balance = time.monotonic() + self.cfg.server.balance_period
            if self._balance_task is None or self._balance_task.done():
                # a task of its own: its settle pause must not hold up the progress loop's announcements
                self._balance_task = asyncio.create_task(self._check_balance())

    # ---- balancing ------------------------------------------------------------------------
    def record(self) -> ServerRecord:
        record = super().record()
        latest = list(self.counted_by.items())[-self.cfg.server.max_counted_callers :]
        record.counted = dict(latest) if self.cfg.server.max_counted_callers > 0 else {}
        if self.claim is not None:
            record.moving_to, record.moving_since = self.claim
        return record

    async def _plan_move(self) -> int | None:
        records = []
        for stage in range(self.spec.stages.num_stages):
            found = await self.dht.aget(keys.servers_key(self.run_id, stage), ServerRecord)
            found[self.dht.peer_id] = self.record() if stage == self.stage else found.get(self.dht.peer_id)
            records.append({pid: r for pid, r in found.items() if r is not None and r.stage == stage})
        mine = (self.claim[1], self.endpoint) if self.claim is not None else None
        cap = self.cfg.server.balance_claim_cap
        totals, counts = stage_totals(records, self.spec.stages.num_stages, before=mine, claim_cap=cap)
        margin = self.cfg.server.balance_margin
        target = plan_move(totals, counts, self.stage, self.runtime.throughput, margin, self.allowed_stages)
        return target if target is None or self._partnered(records[self.stage]) else None

    def _partnered(self, records: dict[str, ServerRecord]) -> bool:
        """Whether a replica that serves this stage now averaged with this one in its last steps: a server leaves
        its stage only then, not on other records' word that the stage is served (one record of a server that
        never serves would otherwise empty it)."""
        members = {m for f in self.runtime.history for m in f.members} - {self.dht.peer_id}
        return any(pid in members and r.state == "serving" for pid, r in records.items())

    async def _check_balance(self) -> None:
        """Move to another stage if that raises the swarm's bottleneck by the configured margin.

        The server first announces that it means to move, then looks again after the settle time
        (plus a random pause): if another server's earlier claim already fixes the bottleneck, it
        withdraws its claim and stays, so of servers that saw the same numbers only one moves.
        """
        try:
            target = await self._plan_move()
            if target is None:
                return
            self.claim = (target, time.time())
            await self.publish(force=True)
            balance = self.cfg.server
            await asyncio.sleep(balance.balance_settle + random.uniform(0, balance.balance_period / 2))
            if self.leaving or await self._plan_move() != target:
                self.claim = None
                await self.publish(force=True)
                return
        except Exception as e:  # the DHT may be busy: balance is checked again next period
            logger.warning("balance check failed: %s", e)
            if self.claim is not None and not self.leaving:
                self.claim = None
                with contextlib.suppress(Exception):
                    await self.publish(force=True)
            return
        logger.warning(
            "stage %d: moving to stage %d raises the swarm's bottleneck; leaving this stage", self.stage, target
        )
        self.move_to = target
        self.done.set()

    # ---- lifecycle ------------------------------------------------------------------------
    async def _moved(self, endpoint: str) -> None:
        """Its relay changed (peer.net.uplink): announce where it is dialled now."""
        self.endpoint = endpoint
        await self.publish(force=True)

    async def start(self) -> bool:
        """Listen, load the stage's state (or start from the seed when nobody holds it), serve; False when
        told to leave before it could serve."""
        relay = offered_relay(self.cfg, self.run_id, self.dht.security, "server")
        self.grpc_server, self.health, endpoint = await open_grpc_server(
            self.cfg, StageServicer(self), self.dht.security, relay
        )
        self.uplink = Uplink(self.cfg, self.run_id, self.dht, endpoint, self._moved)
        self.endpoint = await self.uplink.start()
        self.uplink.offer(relay)
        await self.publish(force=True)  # as 'joining': not routed to yet
        before = memory.resident()
        loaded = await self.load_or_wait()
        if loaded is None:
            return False
        if not loaded:
            say(f"No other server holds stage {self.stage} yet: starting from the run's seed.")
            await self.run_torch(self.runtime.init_from_seed)
        if self.before_serving is not None:
            await self.run_torch(self.before_serving, before)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._next_balance = time.monotonic() + self.cfg.server.balance_cooldown
        self.start_progress()
        await self.publish(force=True)
        return True

    async def stop(self) -> None:
        """Leave cleanly: announce 'leaving', refuse new work, finish what runs, announce 'left', stop."""
        self.leaving = True
        if self.uplink is not None:
            self.uplink.closing = True  # its relay going away now is no reason to look for another
        if self.move_to is None:  # leaving for good: a claim to move (under way) is void
            self.claim = None
            if self._balance_task is not None:
                self._balance_task.cancel()
        if self.grpc_server is not None:
            await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        rt = self.runtime  # said first: a leave can be cut short
        logger.info(
            "stage %d backwards: %d on their forward's graph, %d on the weights a step back (stashed: they apply "
            "a step late), %d recomputed on the current weights",
            self.stage,
            rt.cache_hits,
            rt.cache_stashed,
            rt.cache_misses,
        )
        await self.finish()
        if self.grpc_server is not None:
            await self.grpc_server.stop(0.5)
        if self.uplink is not None:
            await self.uplink.close()
        await self.client.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
