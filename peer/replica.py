"""One replica of a part of the model (a stage, or one expert) and its step protocol with the other replicas.

Step protocol. Each replica announces in the DHT its epoch (optimizer steps taken) and the samples
it has accumulated since. When the replicas at one epoch together reach the run's target batch
size, the replica that notices first flags `averaging_epoch` in its record and starts a round; it
also invites each serving partner directly (the `Round` call); the partners that answer
"joining" form the group, so its size never rests on a stale record. A replica that knows no
serving partner steps at once, inside the backward that crossed the target, so one replica per
part reproduces plain gradient accumulation exactly.

The round itself (matchmaking, all-reduce) runs on a thread of its own. The torch thread waits
for it up to `averaging.pause_limit` and applies the step in the same job, so the requests queued
meanwhile run on the new weights; a round that takes longer lets them go on (their gradients then
count one step later), so a slow or failing round never stalls the part.

Local mode (DiLoCo). Each replica takes an inner optimizer step whenever its own accumulator
holds `inner_batch` samples, queued on the torch thread right after the backward that filled it.
After `averaging.inner_steps` inner steps it starts a round the same way, and the group averages
pseudo-gradients instead of gradients, then takes the outer step (peer/part.py). `epoch` counts
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
import concurrent.futures
import contextlib
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dht import keys
from dht.node import SwarmDHT
from dht.records import ServerRecord
from peer.averaging import GradientAverager
from peer.client import StageClient
from peer.config import PeerConfig, RunSpec
from peer.part import PartRuntime

logger = logging.getLogger(__name__)
MATCHMAKING_STAGGER = 0.05  # s between replicas entering hivemind's matchmaking, by peer-id rank
NOTHING_TO_STEP = -2  # a step's outcome when the accumulator was empty: no step was taken
MAX_LATE_ROUNDS = 3  # a replica that keeps coming back late to its rounds steps alone after this many


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

    def averaging_prefix(self, run_id: str) -> str:
        if self.expert:
            return keys.expert_averaging_prefix(run_id, self.expert)
        return keys.averaging_prefix(run_id, self.stage)

    def matches(self, record: ServerRecord) -> bool:
        return record.stage == self.stage and record.expert == self.expert


def _joiners(answers: dict) -> list[str]:
    """The partners (peer ids) whose answer to an invitation says they join the round."""
    return sorted(pid for pid, a in answers.items() if not isinstance(a, BaseException) and a.joining)


class Replica:
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
        self.inflight = 0
        self.inflight_bytes = 0  # decoded request tensors held by the requests running (server.max_inflight_bytes)
        self.leaving = False
        self.state = "joining"
        self.stepping = False
        self._inner_queued = False  # local mode: an inner step is queued on the torch thread
        self.averaging_epoch = -1
        self.peers: dict[str, ServerRecord] = {}  # other replicas of this part, from the DHT
        self.started = time.time()
        self.endpoint = ""
        self._publish_lock = asyncio.Lock()
        self._last_published: tuple | None = None
        self._last_publish_time = 0.0
        self._tasks: list[asyncio.Task] = []
        self.steps_averaged = self.steps_alone = self.rounds_failed = 0
        self.last_round = (0, 0.0)  # (members, seconds) of the last finished step
        self._late_rounds = 0  # rounds in a row given up because this process came back too late
        self._retry_after = 0.0  # no new round before this (monotonic s): a partner is catching up
        self._pending_round: int | None = None  # a round a partner invited us to while we finished a step
        self.round_seq = 0  # additions the running round covers
        self.samples_averaging = 0  # samples taken out of the accumulator for the running round
        self._unresponsive: dict[str, float] = {}  # peer -> its record's `updated` when it ignored an invitation
        self.record_expires = time.time() + cfg.network.record_ttl  # after this, trainers may take us for gone
        # [monotonic end] of the torch thread's current wait for rounds, when replicas share one thread
        self.pause_window = pause_window
        self.metrics = None  # peer.metrics.Metrics of this process, when it serves them
        self.uplink = None  # peer.uplink.Uplink: reachability, and the relay it is served through if any
        try:
            self.dht_maddrs = dht.visible_maddrs()  # announced, for a restarted coordinator to rejoin through
        except Exception:
            self.dht_maddrs = []

    def load(self) -> float:
        """Requests in flight or queued, as announced (an expert host reports its own)."""
        return float(self.inflight)

    # ---- torch thread ---------------------------------------------------------------------
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

    # ---- stepping -------------------------------------------------------------------------
    def _serving_peers(self) -> dict[str, ServerRecord]:
        """Partners that serve, by peer id, leaving out those that ignored an invitation and have not announced since."""
        return {
            pid: r
            for pid, r in self.peers.items()
            if r.state == "serving" and r.updated > self._unresponsive.get(pid, -1.0)
        }

    def _maybe_step(self) -> None:
        if self.runtime.local:
            self._maybe_inner_step()
        if self.stepping or self.state != "serving" or self.leaving or time.monotonic() < self._retry_after:
            return
        epoch = self.runtime.epoch
        serving = list(self._serving_peers().values())
        if any(r.epoch > epoch for r in serving):
            return  # behind the stage: the progress loop resyncs first
        at_epoch = [r for r in serving if r.epoch == epoch]
        flagged = any(r.averaging_epoch == epoch for r in at_epoch)
        if self.runtime.local:
            if self.runtime.inner_steps >= self.spec.averaging.inner_steps or (flagged and self.runtime.has_work()):
                self._start_step()
            return
        local = self.runtime.samples_accumulated
        total = local + sum(r.samples for r in at_epoch)
        # the others' counts are a progress period old, so a replica also starts when it alone has its
        # share of the target: with balanced routing the group then averages close to the target batch
        target = self.spec.training.target_batch_size
        if total >= target or local * (1 + len(at_epoch)) >= target or flagged:
            self._start_step()

    def _maybe_inner_step(self) -> None:
        """Local mode: queue an inner step on the torch thread now, if the accumulator holds a batch."""
        if self._inner_queued or self.state != "serving" or self.leaving:
            return
        if self.runtime.samples_accumulated < self.spec.inner_batch():
            return
        self._inner_queued = True
        future = asyncio.get_running_loop().run_in_executor(self.executor, self._inner_job)
        self._tasks.append(asyncio.create_task(self._after_inner(future)))

    def _inner_job(self) -> None:
        self.runtime.inner_step()

    async def _after_inner(self, future) -> None:
        try:
            await future
        except Exception:
            logger.exception("%s: inner optimizer step failed", self.label)
        finally:
            self._inner_queued = False
        await self.publish(force=True)
        self._maybe_step()

    def _start_step(self) -> None:
        self.stepping = True
        epoch = self.runtime.epoch
        if not self._serving_peers() or self.averager is None:
            # alone: queued on the torch thread now, before any later request, so the step lands
            # exactly where plain gradient accumulation would put it
            self._tasks.append(asyncio.create_task(self._finish_step(self._step_alone())))
        else:
            self.averaging_epoch = epoch
            self._tasks.append(asyncio.create_task(self._round(epoch)))
        self._tasks = [t for t in self._tasks if not t.done()]

    async def _round(self, epoch: int) -> None:
        """Invite the stage's other replicas to the round for `epoch`; the group is those who join."""
        timeout = min(self.spec.averaging.request_timeout, 2.0)
        partners = {pid: r for pid, r in self._serving_peers().items() if r.epoch <= epoch}
        asked = time.monotonic()
        answers = await self._invite(partners, epoch, timeout)
        took = time.monotonic() - asked
        silent = {pid: partners[pid] for pid, a in answers.items() if isinstance(a, BaseException)}
        if silent and not _joiners(answers):
            # nobody joined: before stepping alone, ask those who did not answer once more. A deadline
            # that passed while this process was stopped or starved looks like a hung partner, and a
            # partner that went on alone meanwhile must be seen (we resync from it) rather than
            # matched by a second lone step at the same epoch (two replicas apart for good)
            answers.update(await self._invite(silent, epoch, timeout))
        joiners = _joiners(answers)
        alive = {pid: a for pid, a in answers.items() if not isinstance(a, BaseException)}
        for pid, a in answers.items():
            if isinstance(a, BaseException):
                self._unresponsive[pid] = partners[pid].updated  # hung or gone: not waited for again
        if any(a.epoch > epoch for a in alive.values()) or (
            not joiners and any(a.epoch != epoch for a in alive.values())
        ):
            # a live partner is at another step (one side of a round failed): never step apart from it.
            # Ahead, we take its state now (and never average this step again with others: the round
            # it stepped may have counted our gradients); behind, it catches up from us.
            self.stepping, self.averaging_epoch = False, -1
            self._retry_after = time.monotonic() + self.cfg.network.progress_period
            # their answers are fresher than their DHT records
            ahead = [partners[pid].model_copy(update={"epoch": a.epoch}) for pid, a in alive.items() if a.epoch > epoch]
            if ahead:
                await self._resync(ahead)
            await self.publish(force=True)
            return
        late = not joiners and partners and took > 2 * timeout + 1.0
        if late and self._late_rounds < MAX_LATE_ROUNDS:
            # the invitations took far past their deadline: this process was stopped or starved, and
            # the partners went on without it (maybe to this very step, alone). Stepping alone now
            # could put two replicas at one step with different weights: look again at fresh
            # records instead (the progress loop resyncs from a replica ahead, or we invite anew)
            self._late_rounds += 1
            self.stepping, self.averaging_epoch = False, -1
            for pid in partners:  # this round's silence was ours, not theirs
                self._unresponsive.pop(pid, None)
            self._retry_after = time.monotonic() + self.cfg.network.progress_period
            await self.refresh_peers()
            await self.publish(force=True)
            return
        self._late_rounds = 0
        if not joiners:
            # nobody answered: step alone now rather than wait out a round with a hung or dead partner;
            # a partner that was only slow is then behind and catches up from us
            await self._finish_step(self._step_alone())
            return
        # enter matchmaking in peer-id order, a few tens of ms apart: replicas that start at the same
        # instant can each take the other for its leader, and hivemind then fails the round
        ranked = sorted([self.dht.peer_id, *(r_pid for r_pid, r in self.peers.items() if r.epoch <= epoch)])
        stagger = MATCHMAKING_STAGGER * ranked.index(self.dht.peer_id)
        expected = sorted([self.dht.peer_id, *joiners])
        await self._finish_step(asyncio.ensure_future(self._averaged_step(expected, epoch, stagger)))

    async def _invite(self, partners: dict[str, ServerRecord], epoch: int, timeout: float) -> dict:
        """Each partner's answer to the invitation to the round for `epoch` (or the exception its call raised)."""
        answers = await asyncio.gather(
            *(
                self.client.round(r.endpoint, self.run_id, self.stage, epoch, timeout, expert=self.part.expert)
                for r in partners.values()
            ),
            return_exceptions=True,
        )
        return dict(zip(partners, answers, strict=True))

    async def _averaged_step(self, expected: list[str], epoch: int, stagger: float):
        """Take the gradients (torch thread), average them with `expected` (round thread), then step or put them back."""
        rt = self.runtime
        started = time.perf_counter()
        grads, samples, seq, incarnation = await self.run_torch(self._take)
        self.samples_averaging = samples
        # trainers must know what this round covers before it can succeed: if we die right after it,
        # they ask the survivors whether we were in the group instead of replaying what it stepped
        self.round_seq = seq
        await self.publish(force=True)
        await asyncio.sleep(stagger)
        # only admitted peers average: the replicas whose records passed this peer's gate (dht.gate)
        admitted = {self.dht.peer_id, *self.peers} if self.dht.gate is not None else None
        round_future = self.round_executor.submit(
            self.averager.average, grads, samples, epoch, expected, admitted, (incarnation, seq)
        )

        def finish():
            result = round_future.result()
            if rt.incarnation != incarnation and not rt.local:
                return samples, -1  # the accumulator was dropped meanwhile: trainers replay these samples
            if result is None:
                # nobody steps on a failed round: replicas stay equal and the samples wait for the next one
                rt.restore_round(grads, samples, seq)
                return samples, 0
            rt.apply_round(result.gradients, result.group_samples, seq, result.members, result.coverage)
            return result.group_samples, result.group_size

        def hold():
            # keep the torch thread while the round is quick and step in the same job: requests queued
            # meanwhile then run on the new weights. A slow round lets them go on after pause_limit
            # (their gradients then count one step later), so a hung round never stalls the stage.
            # Replicas sharing a torch thread (an expert host's) share one pause window.
            limit, now = self.spec.averaging.pause_limit, time.monotonic()
            if self.pause_window is not None:
                if now >= self.pause_window[0]:
                    self.pause_window[0] = now + limit
                limit = max(0.0, self.pause_window[0] - now)
            concurrent.futures.wait([round_future], timeout=limit)
            return finish() if round_future.done() else None

        try:
            outcome = await self.run_torch(hold)
            if outcome is None:
                await asyncio.wrap_future(round_future)
                outcome = await self.run_torch(finish)
        finally:
            self.samples_averaging = 0
        group_samples, members = outcome
        return group_samples, members, time.perf_counter() - started

    def _take(self):
        rt = self.runtime
        grads, samples = rt.take_for_round()
        return grads, samples, rt.taken_seq, rt.incarnation

    def join_round(self, epoch: int) -> bool:
        """A partner invites this replica to the round for `epoch`: True if it takes part."""
        if self.leaving:
            return False
        if self.stepping:
            if self.averaging_epoch == epoch:
                return True  # already in this very round
            if self.averaging_epoch >= 0 and self.averaging_epoch == epoch - 1:
                self._pending_round = epoch  # applying the previous step: join as soon as it lands
                return True
            return False
        if self.state != "serving" or epoch != self.runtime.epoch or self.averager is None:
            return False
        self.stepping = True
        self.averaging_epoch = epoch
        self._tasks.append(asyncio.create_task(self._round(epoch)))
        return True

    def _step_alone(self) -> asyncio.Future:
        """Queue, on the torch thread now (before any later request), a step of this replica alone."""
        return asyncio.get_running_loop().run_in_executor(self.executor, self._step_job)

    def _step_job(self):
        """Torch thread: a step of this replica alone, from its own accumulator."""
        started, rt = time.perf_counter(), self.runtime
        if not rt.has_work():
            # nothing to step (the accumulator was dropped meanwhile): an empty step would still move
            # the weights (momentum, weight decay) and set this replica apart from its partners
            return 0, NOTHING_TO_STEP, time.perf_counter() - started
        grads, samples = rt.take_for_round()
        me = self.dht.peer_id
        rt.apply_round(grads, samples, rt.taken_seq, [me], {me: (rt.incarnation, rt.taken_seq)})
        return samples, 1, time.perf_counter() - started

    def _say_round(self, members: int, seconds: float) -> None:
        """A plain sentence when the averaging group changes size (the first step, a replica came or went)."""
        if members == self.last_round[0]:
            return
        step = f"{self.label[0].upper()}{self.label[1:]} step {self.runtime.epoch}"
        if members > 1:
            others = members - 1
            print(f"{step}: averaging with {others} peer{'s' * (others > 1)} ({seconds:.2f} s a round).", flush=True)
        else:
            print(f"{step}: stepping alone (no other replica in the round).", flush=True)

    async def _finish_step(self, future) -> None:
        try:
            group_samples, members, seconds = await future
            if self.metrics is not None and members != NOTHING_TO_STEP:
                outcome = (
                    "failed" if members == 0 else "dropped" if members < 0 else "averaged" if members > 1 else "alone"
                )
                self.metrics.rounds.labels(outcome).inc()
                self.metrics.round_seconds.observe(seconds)
            if members == NOTHING_TO_STEP:
                pass
            elif members < 0:
                logger.warning(
                    "%s: the round's %d samples were dropped with the accumulator", self.label, group_samples
                )
            elif members == 0:
                self.rounds_failed += 1
                logger.warning(
                    "%s: averaging round for step %d failed after %.1f s; its %d samples wait for the next round",
                    self.label,
                    self.runtime.epoch,
                    seconds,
                    group_samples,
                )
            elif members > 1:
                self.steps_averaged += 1
            else:
                self.steps_alone += 1
            if members > 0:
                self._say_round(members, seconds)
                self.last_round = (members, seconds)
                logger.info(
                    "%s step %d: %d samples, averaged with %d peer(s) in %.2f s",
                    self.label,
                    self.runtime.epoch,
                    group_samples,
                    members - 1,
                    seconds,
                )
        except Exception:
            logger.exception("%s: optimizer step failed", self.label)
        finally:
            self.stepping = False
            self.averaging_epoch = -1
        pending, self._pending_round = self._pending_round, None
        if pending is not None and pending == self.runtime.epoch:
            self.join_round(pending)
        await self.publish(force=True)
        self._maybe_step()

    # ---- DHT presence ---------------------------------------------------------------------
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
        )

    async def publish(self, force: bool = False) -> bool:
        if time.time() > self.record_expires:
            await self.run_torch(self._drop_if_expired)  # before a new record makes trainers count anew
        record = self.record()
        signature = (
            record.epoch,
            record.samples,
            record.averaging_epoch,
            record.state,
            round(record.load),
            record.incarnation,
            record.stepped_seq,
        )
        stale = time.monotonic() - self._last_publish_time > self.cfg.network.announce_period
        if not force and not stale and signature == self._last_published:
            return True
        async with self._publish_lock:
            if time.time() > self.record_expires:
                # checked again under the lock: a publish that waited here through a freeze (behind
                # one stuck in the DHT) must not announce a fresh record before the drop
                await self.run_torch(self._drop_if_expired)
            record = self.record()
            try:
                stored = await self.dht.astore(self.part.key(self.run_id), record, self.cfg.network.record_ttl)
            except Exception as e:
                logger.warning("could not announce in the DHT: %s", e)
                return False
            if stored:
                self._last_published, self._last_publish_time = signature, time.monotonic()
                self.record_expires = max(self.record_expires, record.updated + self.cfg.network.record_ttl)
            return bool(stored)

    async def refresh_peers(self) -> None:
        try:
            records = await self.dht.aget(self.part.key(self.run_id), ServerRecord)
        except Exception as e:
            logger.debug("%s: could not read the replicas' records: %s", self.label, e)
            return
        fresh = {pid: r for pid, r in records.items() if pid != self.dht.peer_id and self.part.matches(r)}
        # a DHT read can miss a record now and then: keep a known peer until its record would have expired
        horizon = time.time() - self.cfg.network.record_ttl
        kept = {
            pid: r for pid, r in self.peers.items() if pid not in fresh and r.updated > horizon and r.state != "left"
        }
        self.peers = {pid: r for pid, r in {**kept, **fresh}.items() if r.state != "left"}

    async def _progress_loop(self) -> None:
        period = self.cfg.network.progress_period
        while not self.leaving:
            await asyncio.sleep(period)
            if time.time() > self.record_expires:  # no torch job otherwise: the thread may be busy for long
                await self.run_torch(self._drop_if_expired)
            await self.refresh_peers()
            if not self.stepping and self.state == "serving":
                ahead = [r for r in self.peers.values() if r.state == "serving" and r.epoch > self.runtime.epoch]
                if ahead:
                    await self._resync(ahead)
                self._maybe_step()
            await self.publish()
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
        # final word: what is not in a finished step by now never will be; trainers replay it elsewhere
        self.state = "left"
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.publish(force=True), timeout)
        for task in self._tasks:
            task.cancel()
        self.round_executor.shutdown(wait=False, cancel_futures=True)

    # ---- state ----------------------------------------------------------------------------
    async def _fetch_state(self, donors: list[ServerRecord]) -> tuple[dict, dict]:
        """The state of the part at one step, in parts from up to `state_donors` donors at once."""
        timeout = self.cfg.server.state_load_timeout
        lead = max(donors, key=lambda r: r.epoch)
        if lead.state == "archive":  # a resumed run's checkpoint (peer.archive): one copy, at its record's step
            epoch = lead.epoch
        else:
            info = await self.client.info(
                lead.endpoint, timeout=self.cfg.network.dht_request_timeout, expert=self.part.expert
            )
            epoch = info.epoch
        same = [lead, *[r for r in donors if r is not lead and r.epoch == epoch]][: self.cfg.server.state_donors]
        n = len(same)

        def part(donor: ServerRecord, shard: int):
            return self.client.get_state(
                donor.endpoint, self.run_id, self.stage, timeout, shard, n, epoch, expert=self.part.expert
            )

        results = await asyncio.gather(*(part(d, i) for i, d in enumerate(same)), return_exceptions=True)
        for i, result in enumerate(results):
            for other in same:  # a part whose donor failed comes from another donor
                if not isinstance(result, BaseException):
                    break
                with contextlib.suppress(Exception):
                    result = await part(other, i)
            if isinstance(result, BaseException):
                raise result
            results[i] = result
        metadata, tensors = dict(results[0][0]), {}
        for _, part in results:
            tensors.update(part)
        if len(tensors) != int(metadata.get("tensor_count", len(tensors))):
            raise ValueError(f"the donors sent {len(tensors)} of {metadata.get('tensor_count')} tensors")
        return metadata, tensors

    async def _load_from(self, donors: list[ServerRecord], attempts: int = 4) -> bool:
        for attempt in range(attempts):
            started = time.perf_counter()
            try:
                metadata, tensors = await self._fetch_state(donors)
                await self.run_torch(self.runtime.load_state, metadata, tensors, self.dht.peer_id)
                n = min(len(donors), self.cfg.server.state_donors)
                print(
                    f"Loaded the state of {self.label} (step {self.runtime.epoch}) from {n} peer{'s' * (n > 1)} "
                    f"in {time.perf_counter() - started:.1f} s.",
                    flush=True,
                )
                return True
            except Exception as e:
                logger.warning("%s: could not load the state (try %d): %s", self.label, attempt + 1, e)
                await asyncio.sleep(0.2 * (attempt + 1))
                await self.refresh_peers()
                fresh = self._donors()
                donors = [r for r in fresh if r.epoch >= min(d.epoch for d in donors)] or fresh
                if not donors:
                    return False
        return False

    def _donors(self) -> list[ServerRecord]:
        """Serving replicas; when there is none, the resumed run's checkpoint (an `archive` record)."""
        serving = [r for r in self.peers.values() if r.state == "serving"]
        return serving or [r for r in self.peers.values() if r.state == "archive"]

    async def load_state_from_peers(self) -> bool:
        """Load parameters and optimizer state from serving replicas (or the run's archive); False if none answered."""
        await self.refresh_peers()
        donors = self._donors()
        return bool(donors) and await self._load_from(donors)

    async def _resync(self, ahead: list[ServerRecord]) -> None:
        """This replica fell behind (missed a round): take the state of those ahead of it, keeping its accumulator."""
        leader = max(ahead, key=lambda r: r.epoch)
        logger.warning(
            "%s: at step %d while %s is at %d; loading its state",
            self.label,
            self.runtime.epoch,
            leader.endpoint,
            leader.epoch,
        )
        self.stepping = True
        try:
            await self._load_from([r for r in ahead if r.epoch == leader.epoch], attempts=1)
        finally:
            self.stepping = False
