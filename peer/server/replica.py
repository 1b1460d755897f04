"""One replica of a part of the model (a stage, or one expert) and its step protocol with the other replicas.

Step protocol. Each replica announces its epoch (optimizer steps taken) and the samples it has
accumulated since: pushed to its partner replicas as they change (peer.server.replica_push), and in
the DHT for everyone else. When the replicas at one epoch together reach the run's target batch
size, the replica that notices first flags `averaging_epoch` in its record and starts a round; it
also invites each serving partner directly (the `Round` call); the partners that answer
"joining" form the group, so its size never rests on a stale record. A replica that knows no
serving partner steps at once, inside the backward that crossed the target, so one replica per
part reproduces plain gradient accumulation exactly.

The round (peer.server.averaging: our all-reduce, on this replica's event loop) is waited for on a thread of
its own. The torch thread waits
for it up to `averaging.pause_limit` and applies the step in the same job, so the requests queued
meanwhile run on the new weights; a round that takes longer lets them go on (their gradients then
count one step later), so a slow or failing round never stalls the part.

Local mode (DiLoCo). Each replica takes an inner optimizer step whenever its own accumulator
holds `inner_batch` samples, queued on the torch thread right after the backward that filled it.
After `averaging.inner_steps` inner steps it starts a round the same way, and the group averages
pseudo-gradients instead of gradients, then takes the outer step (peer/model/part.py). `epoch` counts
outer steps. A replica that misses a round is behind afterwards and loads the anchor from the
replicas ahead (the resync below), so nobody waits for it.

Receipts. Every backward added to the accumulator is numbered (`seq`, within an `incarnation`)
and the replica announces how many are in finished steps (`stepped_seq`) and, before a round,
what the round covers (`round_seq`). Trainers keep each backward until it is stepped, and replay
it on another replica if this one goes away first; a replica whose DHT record expired (it was
frozen) drops its accumulator and takes a new incarnation, since trainers replay what it held.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from dht import keys
from dht.node import SwarmDHT
from dht.records import ServerRecord
from peer.config import PeerConfig, RunSpec
from peer.model.part import PartRuntime
from peer.net.cadence import Cadence
from peer.net.client import StageClient
from peer.net.refusal import Refused
from peer.process.failpoints import Failpoints
from peer.server.averaging import GradientAverager
from peer.server.lie_reports import LieReports
from peer.server.replica_belief import StepBelief
from peer.server.replica_handover import Handover
from peer.server.replica_push import Pushing
from peer.server.replica_round import Rounds
from peer.server.replica_state import StateTransfer
from peer.server.replica_step import Stepping
from protocols import averaging_pb2
from protocols.failures import Reason

logger = logging.getLogger(__name__)
# s between a held synchronous-mode micro-batch's looks at the step (a finished step or a loaded state wakes it at once)
SYNC_POLL = 0.05


@dataclass(frozen=True)
class Part:
    """What a replica holds: a stage, or one expert ("layer.index") of a layer held by `stage`."""

    stage: int
    expert: str = ""

    @property
    def label(self) -> str:
        return f"expert {self.expert}" if self.expert else f"stage {self.stage}"

    def key(self, run_id: str) -> str:
        return keys.expert_key(run_id, self.expert) if self.expert else keys.servers_key(run_id, self.stage)

    def matches(self, record: ServerRecord) -> bool:
        return record.stage == self.stage and record.expert == self.expert


def _opened() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


class Replica(Stepping, Rounds, StateTransfer, StepBelief, Handover, Pushing):
    """The step protocol of one part; its owner (a stage server or an expert host) serves the calls."""

    def __init__(
        self,
        spec: RunSpec,
        part: Part,
        cfg: PeerConfig,
        dht: SwarmDHT,
        runtime: PartRuntime,
        averager: GradientAverager | None,
        executor: ThreadPoolExecutor | None = None,
        client: StageClient | None = None,
        pause_window: list[float] | None = None,
    ):
        self.spec, self.run_id, self.part, self.cfg = spec, spec.name, part, cfg
        self.stage, self.label = part.stage, part.label
        self.dht, self.runtime, self.averager = dht, runtime, averager
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
        self.round_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="round")
        self.client = client or StageClient.for_server(cfg.server, dht.security)
        self.failpoints = Failpoints.from_env()  # off unless a test names some (peer.process.failpoints)
        self.inflight = 0
        self.inflight_bytes = 0  # decoded request tensors held by the requests running (server.max_inflight_bytes)
        self.leaving, self.state, self.stepping = False, "joining", False
        self.forwards_open = _opened()  # cleared while a step drains (peer.server.replica_round): forwards wait
        self._stepped = asyncio.Event()  # set when this replica finishes a step (synchronous mode's forwards wait)
        self._inner_queued = False  # local mode: an inner step is queued on the torch thread
        self.averaging_epoch = -1
        self.peers: dict[str, ServerRecord] = {}  # other replicas of this part, from the DHT and their pushes
        self.started = time.time()
        self.endpoint = ""
        self._publish_lock = asyncio.Lock()
        self._last_published: tuple | None = None
        self._last_publish_time = self._peers_read = 0.0  # monotonic: last announced, last read the others'
        self._tasks: list[asyncio.Task] = []
        self.steps_averaged = self.steps_alone = self.rounds_failed = 0
        self.last_round = (0, 0.0)  # (members, seconds) of the last finished step
        self._late_rounds = 0  # rounds in a row given up because this process came back too late
        self._retry_after = 0.0  # no new round before this (monotonic s): a partner is catching up
        self._pending_round: int | None = None  # a round a partner invited us to while we finished a step
        # peer id -> the epoch it invited us to: it is in that round, so ours counts it in whatever our
        # (maybe stale) copy of its record says; entries of past epochs go at each round
        self._inviters: dict[str, int] = {}
        self.round_seq = 0  # additions the running round covers
        self.samples_averaging = 0  # samples taken out of the accumulator for the running round
        self._unresponsive: dict[str, float] = {}  # peer -> its record's `updated` when it ignored an invitation
        self.record_expires = time.time() + cfg.network.record_ttl  # after this, trainers may take us for gone
        self.told_to_leave: Callable[[], bool] = lambda: False  # its owner's: stop trying to load a state
        self.last_load_error = ""  # why the last state download failed
        self._init_claims()
        self._init_rest()
        self._partial_state: tuple[int, int, dict] | None = None  # (step, shards, shards in) of a download
        # [monotonic end] of the torch thread's current wait for rounds, when replicas share one thread
        self.pause_window = pause_window
        self.metrics = None  # peer.net.metrics.Metrics of this process, when it serves them
        self._bind_averager(averager)
        self.uplink = None  # peer.net.uplink.Uplink: reachability, and the relay it is served through if any
        try:
            self.dht_maddrs = dht.visible_maddrs()  # announced, for a restarted coordinator to rejoin through
        except Exception as e:  # the DHT node may not say yet: announced without addresses
            logger.warning("%s: the DHT node does not say its addresses (%s); announcing none", self.label, e)
            self.dht_maddrs = []

    def _bind_averager(self, averager: GradientAverager | None) -> None:
        """What the all-reduce needs of this replica: who we are, where partners are, who may average with us."""
        if averager is None:
            return
        header = averaging_pb2.AverageHeader(run_id=self.run_id, stage=self.stage, expert=self.part.expert)

        def endpoint_of(peer: str) -> str | None:
            record = self.peers.get(peer)
            return record.endpoint if record is not None else None

        def admitted(peer: str) -> bool:
            # only admitted peers average: the replicas whose records passed this peer's gate (dht.gate), less
            # those this replica caught lying (peer.server.replica_state)
            return self.dht.gate is None or (peer in self.peers and peer not in self._distrusted)

        averager.allreduce.bind(
            None, self.client, self.dht.identity, endpoint_of, header, lambda: self.runtime.epoch, admitted
        )

    def _init_rest(self) -> None:
        """How often the progress loop reads the others' records, and refreshes its own: seldom while nothing moves
        (`_next_read_period`, peer.net.cadence)."""
        self.cadence = Cadence(self.cfg.network)  # when our record is refreshed, and for how long it lives
        self._last_moves: tuple | None = None  # _moves of the last record stored
        self._read_every = self.cfg.network.progress_period  # s between reads of the others' records
        self._last_look: tuple | None = None  # what the progress loop saw at its last read (`_activity`)
        self._stirred = asyncio.Event()  # set by a request or an invitation: a resting progress loop looks at once
        self._woken = False  # stirred while resting: the next look reads at once
        self._stir_since_read = False  # stirred since the read under way began: the read period stays fast
        self._unknown_inviter = False  # invited by a replica not among `peers`: the round reads the records first
        self._init_push()  # the partners hear of our progress pushed, not from the DHT (peer.server.replica_push)

    def _init_claims(self) -> None:
        """What this replica knows of its partners' claims (peer.swarm.consensus, docs/security.md)."""
        self._doubted: set[str] = set()  # peers whose claimed step was not believed, said once (bounded)
        self._lone: set[str] = set()  # peers alone ahead of most replicas, not followed: said once (bounded)
        self._rejoined = -1  # the step it last loaded a state at: what it stepped alone before is gone (`_rejoin`)
        self._rejoin_tried = -1  # the step it last tried to take a group's state at, after stepping alone
        self._held_since: float | None = None  # since when its rounds wait on a partner at another step (monotonic)
        self._seen: dict[str, float] = {}  # peer -> when its record was last read (bounded by record_ttl)
        self._first_seen: dict[str, int] = {}  # peer -> this replica's step when it first read its record
        self._distrusted: set[str] = set()  # peers whose state claimed a step its weights could not be at
        self.lies = LieReports(self)  # partners its rounds proved to lie, told the coordinator
        # peer -> (failures in a row to send a state that loads, monotonic end of its ban as a donor)
        self._donor_strikes: dict[str, tuple[int, float]] = {}
        self._transfer_lead, self._transfer_senders = None, set()  # the last transfer's lead, and who sent it shards
        self._fed: dict[str, int] = {}  # peer -> the step of the last state it took from this replica (the newest 64)
        # this process was stopped (or starved) since its last load: its own step does not count in what most
        # replicas say until it loads the stage's state again, as a joiner would
        self.paused = False

    def load(self) -> float:
        """Requests in flight or queued, as announced (an expert host reports its own)."""
        return float(self.inflight)

    async def forward_gate(self, deadline: float | None = None) -> None:
        """A training forward waits here while this replica drains for a step, until the step's job is queued on the
        torch thread (at most averaging.drain_limit + pause_limit): it then runs behind it, on the new weights. It
        waits at most half the time left to its `deadline` (time.monotonic()): the rest is for its own work, and a
        forward that runs on the old weights (its gradients count a step late) beats one its caller gives up on."""
        if self.forwards_open.is_set():
            return
        limit = self.spec.averaging.drain_limit + self.spec.averaging.pause_limit
        if deadline is not None:
            limit = min(limit, max(0.0, (deadline - time.monotonic()) / 2))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.forwards_open.wait(), limit)

    async def step_gate(self, step: int, deadline: float | None = None) -> None:
        """Synchronous mode: a micro-batch of optimizer step `step` waits here until this replica has taken the
        steps before it (at most training.sync_wait, and no later than its `deadline`); Refused if it has not."""
        limit = self.spec.training.sync_wait
        if deadline is not None:
            limit = min(limit, deadline - time.monotonic())
        end = time.monotonic() + limit
        while self.runtime.epoch < step:
            if time.monotonic() >= end or self.leaving:
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"synchronous mode: this micro-batch is for step {step}, and stage {self.stage} is still at "
                    f"step {self.runtime.epoch} after {limit:.1f} s (training.sync_wait)",
                    Reason.STALE_EPOCH,
                )
            self._stepped.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stepped.wait(), min(SYNC_POLL, max(0.0, end - time.monotonic())))

    async def run_torch(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    def _drop_if_expired(self) -> None:
        """Torch thread: if our DHT record expired (we were frozen), trainers replay what we hold: drop it."""
        now = time.time()
        if now <= self.record_expires:
            return
        late = now - self.record_expires
        self.record_expires = now + self.cfg.network.record_ttl  # trainers count anew from here
        dropped = self.runtime.drop_accumulator()
        logger.warning(
            "%s: our DHT record expired %.1f s ago (this process was stopped or starved); trainers replay "
            "unstepped work elsewhere, so %d accumulated samples are dropped here",
            self.label,
            late,
            dropped,
        )

    def _serving_peers(self) -> dict[str, ServerRecord]:
        """Partners that serve, by peer id, leaving out those that ignored an invitation and have not announced since,
        and those that claim a step most replicas do not back (peer.swarm.consensus): a hostile claim must not stop
        the others from stepping."""
        serving = {
            pid: r
            for pid, r in self.peers.items()
            if r.state == "serving"
            and r.updated > self._unresponsive.get(pid, -1.0)
            and not (r.epoch > self.runtime.epoch and self._struck(pid))  # ahead by a claim never backed
        }
        credible = {id(r) for r in self._backed_only(self._credible(list(serving.values())))}
        return {pid: r for pid, r in serving.items() if id(r) in credible}

    def record(self) -> ServerRecord:
        rt = self.runtime
        return ServerRecord(
            stage=self.stage,
            expert=self.part.expert,
            endpoint=self.endpoint,
            throughput=rt.throughput,
            load=self.load(),
            epoch=rt.epoch,
            step=rt.progress,
            samples=rt.samples_accumulated,
            samples_stepped=rt.samples_stepped,
            samples_averaging=self.samples_averaging,
            averaging_epoch=self.averaging_epoch,
            state="left" if self.state == "left" else "leaving" if self.leaving else self.state,
            incarnation=rt.incarnation,
            stepped_seq=rt.stepped_seq,
            round_seq=self.round_seq if self.averaging_epoch >= 0 else 0,
            started=self.started,
            updated=time.time(),
            tp=rt.tp_degree,
            devices=rt.devices,
            dht=self.dht_maddrs,
            metrics=self.metrics.endpoint if self.metrics else "",
            requests=self.metrics.served if self.metrics else 0,
            errors=self.metrics.failed if self.metrics else 0,
            last_round=self.last_round[0],
            last_round_seconds=self.last_round[1],
            rounds_failed=self.rounds_failed,
            relay=self.uplink.relay if self.uplink is not None else "",
            fingerprint=rt.latest_fingerprint(),
        )

    async def publish(self, force: bool = False) -> bool:
        if time.time() > self.record_expires:
            await self.run_torch(self._drop_if_expired)  # before a new record makes trainers count anew
        record = self.record()
        self.push_progress(record.model_copy(), force)  # partners hear of any change at once (replica_push)
        signature = self._urgent(record)
        stale = time.monotonic() - self._last_publish_time > self.cadence.period
        if not force and not stale and signature == self._last_published:
            return True
        async with self._publish_lock:
            if time.time() > self.record_expires:
                # checked again under the lock: a publish that waited here through a freeze (behind
                # one stuck in the DHT) must not announce a fresh record before the drop
                await self.run_torch(self._drop_if_expired)
            record = self.record()
            changed = force or self._moves(record) != self._last_moves
            record.ttl = self.cadence.ttl(changed)
            try:
                stored = await self.dht.astore(self.part.key(self.run_id), record, record.ttl)
            except Exception as e:  # the DHT may be busy: announced again next period
                logger.warning("could not announce in the DHT: %s", e)
                return False
            if stored:
                self._last_published, self._last_publish_time = self._urgent(record), time.monotonic()
                self._last_moves = self._moves(record)
                self.cadence.stored(record.ttl, changed)
                self.record_expires = max(self.record_expires, record.updated + record.ttl)
            return bool(stored)

    def _moves(self, record: ServerRecord) -> tuple:
        """What of a record, changed since the last refresh, keeps the announce period short (peer.net.cadence):
        everything but its time, lifetime and slowly drifting measurements."""
        return (
            *self._signature(record),
            record.step,
            record.samples,
            record.stepped_seq,
            record.endpoint,
            record.relay,
        )

    @staticmethod
    def _urgent(record: ServerRecord) -> tuple:
        """What of a record, changed, is stored in the DHT at once (its step, round, state, incarnation); the rest
        waits for the announce period there: partners hear of it sooner, pushed (`_signature`)."""
        return (record.epoch, record.averaging_epoch, record.state, record.incarnation)

    def _signature(self, record: ServerRecord) -> tuple:
        """What of a record, changed, is pushed to the partners at once (peer.server.replica_push).

        In local mode the replicas' sample counts time no step (each steps on its own inner steps, and
        invites the others itself): only a change of step, round or state is urgent there.
        """
        urgent = self._urgent(record)
        if self.runtime.local:
            return urgent
        return (*urgent, record.samples, round(record.load), record.stepped_seq)

    async def refresh_peers(self) -> None:
        self._peers_read = time.monotonic()
        try:
            records = await self.dht.aget(self.part.key(self.run_id), ServerRecord)
        except Exception as e:  # the DHT may be busy: read again next period
            logger.warning("%s: could not read the replicas' records: %s", self.label, e)
            return
        fresh = {pid: r for pid, r in records.items() if pid != self.dht.peer_id and self.part.matches(r)}
        now = time.time()
        self._seen.update((pid, now) for pid in fresh)
        for pid in fresh:
            self._first_seen.setdefault(pid, self.runtime.epoch)
        # a DHT read can miss a record now and then: keep a known peer until its record would have expired, by
        # when this replica last read it (a record's own `updated` may lie), unless it was revoked meanwhile
        horizon, revoked = now - self.cfg.network.record_ttl, self.dht.gate.revoked if self.dht.gate else ()
        kept = {
            pid: r
            for pid, r in self.peers.items()
            if pid not in fresh and self._seen.get(pid, 0.0) > horizon and r.state != "left" and pid not in revoked
        }
        self._seen = {pid: t for pid, t in self._seen.items() if t > horizon}
        self._first_seen = {pid: e for pid, e in self._first_seen.items() if pid in self._seen}
        # a record pushed since (peer.server.replica_push) is newer than the DHT's copy: it stays
        newer = {
            pid: self.peers[pid]
            for pid, r in fresh.items()
            if pid in self.peers and self.peers[pid].updated > r.updated
        }
        self.peers = {pid: r for pid, r in {**kept, **fresh, **newer}.items() if r.state != "left"}

    def stir(self) -> None:
        """Activity (a request, a round invitation): a resting replica reads its replicas' records at its fast
        period again, the first time at once (on the event loop)."""
        if self._read_every > self.cfg.network.progress_period:
            self._woken = True  # it was resting: read now, not at the end of the period it was sleeping
            self._stirred.set()
        self._read_every = self.cfg.network.progress_period
        self.cadence.wake()
        self._stir_since_read = True  # what the read under way (if any) saw is older than this

    def _activity(self) -> tuple:
        """What the progress loop compares between looks: this replica's urgent record fields, and each
        replica's step, samples, round and state as last read."""
        peers = sorted(
            (pid, r.epoch, r.samples, r.averaging_epoch, r.state, r.stepped_seq) for pid, r in self.peers.items()
        )
        return self._signature(self.record()), tuple(peers)

    def _next_read_period(self) -> float:
        """The read period after a look: progress_period while anything moves (or the replica was stirred while
        it read), doubling (up to network.rest_read_period) while nothing does."""
        net = self.cfg.network
        look, previous = self._activity(), self._last_look
        self._last_look = look
        busy = self.inflight or self.stepping or self.state != "serving" or self.paused or self._stir_since_read
        if busy or self._pending_round is not None or self._inviters or look != previous:
            return net.progress_period
        return min(2 * self._read_every, net.rest_read_period)

    async def _rest(self, period: float) -> None:
        """Sleep `period`; a resting replica wakes early when stirred (a request or an invitation)."""
        self._stirred.clear()
        if period <= self.cfg.network.progress_period:
            await asyncio.sleep(period)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stirred.wait(), period)

    async def _progress_loop(self) -> None:
        net = self.cfg.network
        while not self.leaving:
            # awake at the read period, and at least once a refresh period (peer.net.cadence)
            period = min(self._read_every, self.cadence.period)
            slept = time.monotonic()
            await self._rest(period)
            if time.monotonic() - slept > period + 4.5:
                self.paused = True  # stopped or starved: what the stage did meanwhile, it did not see
            if time.time() > self.record_expires:  # no torch job otherwise: the thread may be busy for long
                await self.run_torch(self._drop_if_expired)
            # the partners push their progress (peer.server.replica_push): the DHT is read once an announce period
            # to find new ones, and every progress period again while a push to one of them fails
            pushed = self.runtime.local or self._pushes_work()  # local mode: nothing waits on the others' counts
            read_every = max(self._read_every, net.announce_period) if pushed else self._read_every
            if time.monotonic() - self._peers_read >= read_every - 0.05 or self._woken:
                self._woken = self._stir_since_read = False
                await self.refresh_peers()
                self._read_every = self._next_read_period()
            if not self.stepping and self.state == "serving":
                ahead = [r for r in self.peers.values() if r.state == "serving" and r.epoch > self.runtime.epoch]
                if ahead:
                    await self._announced_while(self._resync(ahead))
                    self.paused = False  # one look after a stall (a record kept ahead must not keep it so)
                elif self.paused:
                    self.paused = False  # stopped, but nobody went on meanwhile: it serves as it was
                if not self.stepping and (group := self._apart_alone()):
                    await self._announced_while(self._rejoin(group))
                self._maybe_step()
            await self.publish()
            await self.lies.report()  # partners its rounds proved to lie, for the coordinator (peer.server.lie_reports)
            await self.on_progress()

    async def on_progress(self) -> None:
        """Hook: runs after each look at the replicas' progress (a stage server checks its balance here)."""

    def start_progress(self) -> None:
        self.state = "serving"
        self._tasks.append(asyncio.create_task(self._progress_loop()))

    async def finish(self, announced: bool = False) -> None:
        """Leaving: wait (up to shutdown_grace) for work and a round under way, then announce 'left'.

        `announced`: the owner has already announced 'leaving' and waited for its calls.
        """
        self.leaving = True
        timeout = self.cfg.network.dht_request_timeout
        if not announced:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.publish(force=True), timeout)  # trainers stop routing here
        deadline = time.monotonic() + self.cfg.server.shutdown_grace
        while (self.inflight or self.stepping) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        try:
            await self.hand_over()
        except Exception as e:  # the DHT may be busy: it leaves all the same, said
            logger.warning("%s: could not hand its state over: %s", self.label, e)
        # final word: what is not in a finished step by now never will be; trainers replay it elsewhere
        self.state = "left"
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.publish(force=True), timeout)
        for task in self._tasks:
            task.cancel()
        self.round_executor.shutdown(wait=False, cancel_futures=True)
