"""The averaging round of a replica (peer.server.replica): inviting the serving partners, forming the
group from those that answer, the all-reduce (peer.server.averaging) waited for on the round thread, and joining a
partner's round.

Rounds is a piece of Replica, on the replica's event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time

from dht.records import ServerRecord

logger = logging.getLogger(__name__)
MAX_INVITERS = 64  # invitations remembered (one per partner) until their round
DRAIN_POLL = 0.005  # s between looks, while a step drains, at the backwards still to come
SNAPSHOT_TRIES = 3  # reads of the runtime's cached forwards tried while the torch thread changes them
MAX_LATE_ROUNDS = 3  # a replica that keeps coming back late to its rounds steps alone after this many


def _joiners(answers: dict) -> list[str]:
    """The partners (peer ids) whose answer to an invitation says they join the round."""
    return sorted(pid for pid, a in answers.items() if not isinstance(a, BaseException) and a.joining)


class Rounds:
    """The averaging rounds of a Replica (Replica inherits it)."""

    async def _round(self, epoch: int) -> None:
        """Invite the stage's other replicas to the round for `epoch`; the group is those who join."""
        if await self._alone_after_poison(epoch):
            return
        timeout = min(self.spec.averaging.request_timeout, 2.0)
        if self._unknown_inviter:
            # invited by a replica whose record this one has not read yet (it was resting): read it first
            self._unknown_inviter = False
            await self.refresh_peers()
        partners = {
            pid: r
            for pid, r in {**self._serving_peers(), **self._inviting(epoch)}.items()
            if r.epoch <= epoch and not self._left_out(pid)
        }
        answers, took = await self._answers(partners, epoch, timeout)
        said, answers = answers, self._believed(answers, epoch)
        joiners, held = _joiners(answers), self._held_too_long()
        alive = {pid: a for pid, a in answers.items() if not isinstance(a, BaseException)}
        # hung or gone: not waited for again
        self._unresponsive.update((pid, partners[pid].updated) for pid in answers if pid not in alive)
        if any(a.epoch > epoch for a in alive.values()):
            # a live partner is ahead (one side of a round failed): never step apart from it. We take its
            # state now (and never average this step again with others: the round it stepped may have
            # counted our gradients)
            self._abandon()
            # their answers are fresher than their DHT records
            ahead = [partners[pid].model_copy(update={"epoch": a.epoch}) for pid, a in alive.items() if a.epoch > epoch]
            await self._resync(ahead)
            await self.publish(force=True)
            return
        behind = any(a.epoch < epoch for a in alive.values())
        if not joiners and not held and (behind or self._ahead_unfollowed(epoch, said)):
            # a partner behind catches up from us; one ahead that we do not follow alone may be honest: stepping
            # alone would set us apart from it for good. Either way we wait, up to network.record_ttl in a row
            # (then neither holds us: a hostile one answering so every time must not stop this replica)
            self._held_since = self._held_since or time.monotonic()
            self._abandon()
            await self.publish(force=True)
            return
        late = not joiners and partners and took > 2 * timeout + 1.0
        if late and self._late_rounds < MAX_LATE_ROUNDS:
            # the invitations took far past their deadline: this process was stopped or starved, and
            # the partners went on without it (maybe to this very step, alone). Stepping alone now
            # could put two replicas at one step with different weights: look again at fresh
            # records instead (the progress loop resyncs from a replica ahead, or we invite anew)
            self._late_rounds += 1
            self._abandon()
            for pid in partners:  # this round's silence was ours, not theirs
                self._unresponsive.pop(pid, None)
            await self.refresh_peers()
            await self.publish(force=True)
            return
        self._late_rounds, self._held_since = 0, None
        if not joiners:
            # nobody answered: step alone now rather than wait out a round with a hung or dead partner;
            # a partner that was only slow is then behind and catches up from us
            await self._finish_step(self._step_alone())
            return
        expected = sorted([self.dht.peer_id, *joiners])
        await self._finish_step(asyncio.ensure_future(self._averaged_step(expected, epoch)))

    def _abandon(self) -> None:
        """The round under way goes no further: no step now; the progress loop tries again a progress period on."""
        self.stepping, self.averaging_epoch = False, -1
        self._retry_after = time.monotonic() + self.cfg.network.progress_period

    def _held_too_long(self) -> bool:
        """Whether this replica's rounds were held (`_round`: a partner behind, or one ahead it does not follow)
        for network.record_ttl s in a row: no longer a reason to wait, then."""
        return self._held_since is not None and time.monotonic() - self._held_since > self.cfg.network.record_ttl

    def _believed(self, answers: dict, epoch: int) -> dict:
        """The answers to our invitation to the round for `epoch` that count. A partner that answers ahead of us
        but failed to send that step's state (banned as a donor now, or struck), or that alone is at its step
        (`_backed_only`), is not believed: neither a reason to abort the round nor a member of it. A partner that
        said it stepped this round must now be ahead, and believed so (peer.server.round_failures): one that said
        so and then claims a step alone ahead of the others failed the round on its word like one that did not
        step (else it could break every other round and never be left out)."""
        now = time.monotonic()
        said = {pid: a.epoch for pid, a in answers.items() if not isinstance(a, BaseException)}
        banned = {pid for pid in said if self._struck(pid) or self._donor_strikes.get(pid, (0, 0.0))[1] > now}
        ahead = {pid: step for pid, step in said.items() if step > epoch and pid not in banned}
        claims = [ServerRecord.model_construct(owner=pid, epoch=step, endpoint=pid) for pid, step in ahead.items()]
        unbelieved = {pid for pid in said if said[pid] > epoch} - {r.owner for r in self._backed_only(claims)}
        if self.averager is not None:
            believed = {pid: epoch if pid in unbelieved else step for pid, step in said.items()}
            self.averager.allreduce.failures.check(believed, epoch)
        return {pid: a for pid, a in answers.items() if pid not in unbelieved}

    async def _answers(self, partners: dict[str, ServerRecord], epoch: int, timeout: float) -> tuple[dict, float]:
        """The partners' answers to the invitation to the round for `epoch`, and the seconds the first invitations
        took. Replicas that invited us meanwhile are added to `partners` and asked too (they are in the round)."""
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
        late = {
            pid: r
            for pid, r in self._inviting(epoch).items()
            if pid not in partners and r.epoch <= epoch and not self._left_out(pid)
        }
        if late:
            partners.update(late)
            answers.update(await self._invite(late, epoch, timeout))
        for pid, answer in answers.items():
            if isinstance(answer, BaseException):
                self._inviters.pop(pid, None)  # an inviter that does not answer is not waited for again
        return answers, took

    async def _alone_after_poison(self, epoch: int) -> bool:
        """After averaging.max_refused_rounds poisoned means in a row (peer.server.averaging), step with our own
        gradients this once: a poisoning member delays the stage, it does not stop it."""
        refused = self.averager.refused_in_a_row
        if refused < self.spec.averaging.max_refused_rounds:
            return False
        logger.warning("%s: step %d alone after %d poisoned rounds", self.label, epoch, refused)
        self.averager.refused_in_a_row = 0
        await self._finish_step(self._step_alone())
        return True

    async def _invite(self, partners: dict[str, ServerRecord], epoch: int, timeout: float) -> dict:
        """Each partner's answer to the invitation to the round for `epoch` (or the exception its call raised)."""
        if partners and self.failpoints.fails("round.invite"):
            return {pid: ConnectionError("failpoint round.invite: the invitation never left") for pid in partners}
        answers = await asyncio.gather(
            *(
                self.client.round(
                    r.endpoint,
                    self.run_id,
                    self.stage,
                    epoch,
                    timeout,
                    expert=self.part.expert,
                    peer=pid,
                    inviter=self.dht.peer_id,
                )
                for pid, r in partners.items()
            ),
            return_exceptions=True,
        )
        # an answer that claims a step most replicas do not back is no partner's (peer.swarm.consensus)
        limit = self._step_limit()
        return {
            pid: a
            for pid, a in zip(partners, answers, strict=True)
            if pid not in self._distrusted and (isinstance(a, BaseException) or a.epoch <= limit)
        }

    async def _averaged_step(self, expected: list[str], epoch: int):
        """Take the gradients (torch thread), average them with `expected` (round thread), then step or put them back."""
        rt = self.runtime
        started = time.perf_counter()
        if self._drains():
            self.forwards_open.clear()  # until the step's job is queued (or the round ends early: _finish_step)
        await self._drain()
        grads, samples, seq, incarnation = await self.run_torch(self._take)
        self.samples_averaging = samples
        # trainers must know what this round covers before it can succeed: if we die right after it,
        # they ask the survivors whether we were in the group instead of replaying what it stepped
        self.round_seq = seq
        sat_out = await self._sits_out(grads, samples, seq, incarnation, epoch)
        if sat_out is not None:
            self.samples_averaging = 0
            return samples, sat_out, time.perf_counter() - started
        # only admitted peers average: the replicas whose records passed this peer's gate (dht.gate)
        # (less those this replica caught lying: peer.server.replica_state)
        admitted = {self.dht.peer_id, *self.peers} - self._distrusted if self.dht.gate is not None else None
        expected = [pid for pid in expected if not self._left_out(pid)]
        self.averager.loop = asyncio.get_running_loop()  # the all-reduce runs here; the round thread waits for it
        round_future = self.round_executor.submit(
            self.averager.average, grads, samples, epoch, expected, admitted, (incarnation, seq)
        )

        def finish():
            result = round_future.result()
            if rt.incarnation != incarnation and not rt.local:
                return samples, self._unstepped(result, epoch)  # dropped meanwhile: trainers replay these samples
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
            held = asyncio.get_running_loop().run_in_executor(self.executor, hold)
            self.forwards_open.set()  # forwards now queue behind the step's job: its weights, unless the round is slow
            outcome = await held
            if outcome is None:
                await asyncio.wrap_future(round_future)
                outcome = await self.run_torch(finish)
        finally:
            self.samples_averaging = 0
        group_samples, members = outcome
        return group_samples, members, time.perf_counter() - started

    def _unstepped(self, result, epoch: int) -> int:
        """A round's average this replica does not step after all: its partners' next round at `epoch` is served."""
        if result is not None:
            self.averager.unstep(epoch)
        return -1

    def _drains(self) -> bool:
        """Whether a step first waits for the backwards of forwards on the current weights (averaging.drain_limit)."""
        return self.spec.averaging.drain_limit > 0 and not self.runtime.local

    def _awaiting(self) -> frozenset:
        """The runtime's forwards on the current weights still waiting for their backward, read from this thread."""
        for _ in range(SNAPSHOT_TRIES):
            with contextlib.suppress(RuntimeError):  # the torch thread changed the cache while it was read
                return self.runtime.awaiting_backward()
        return frozenset()

    async def _drain(self) -> None:
        """With new training forwards held (`forwards_open` cleared), wait at most averaging.drain_limit until the
        backwards of the forwards already run on the current weights have come: their gradients are then in this
        step, computed on the weights their forwards ran on. A backward that does not come (its trainer died or
        went elsewhere) holds the step at most that long; it then counts one step late, on the stashed weights."""
        if not self._drains():
            return
        until = time.monotonic() + self.spec.averaging.drain_limit
        # read on the torch thread, behind the forwards admitted before the hold: they have run by then
        waiting = await self.run_torch(self.runtime.awaiting_backward)
        while waiting and time.monotonic() < until:
            await asyncio.sleep(DRAIN_POLL)
            waiting = waiting & self._awaiting()
        if waiting:
            logger.info("%s: %d backward(s) not back after the drain; they count a step late", self.label, len(waiting))

    async def _sits_out(self, grads, samples: int, seq: int, incarnation: int, epoch: int) -> int | None:
        """Announce the round; None to go on, else why this replica sits it out: 0 (its gradients are back in the
        accumulator) or -1 (they are dropped)."""
        rt = self.runtime
        if not await self._announce_round():
            # trainers cannot learn what this round covers: were it to succeed here and this replica die, they
            # would replay what its partners stepped. It stays out; its partners go on without it (peer.server.allreduce)
            logger.warning("%s: could not announce the round for step %d in the DHT; sitting it out", self.label, epoch)
            return 0 if await self.run_torch(self._restore_unless_dropped, grads, samples, seq, incarnation) else -1
        if rt.incarnation != incarnation and not rt.local:
            # stopped after the take for longer than our record lives (the announcement found it expired and
            # dropped the accumulator): trainers took us for gone and replay what we held, the taken gradients
            # included; averaged, a partner's step would count them twice
            return -1
        return None

    def _restore_unless_dropped(self, grads, samples: int, seq: int, incarnation: int) -> bool:
        """Torch thread: the taken gradients back into the accumulator, unless it was dropped since the take
        (trainers replay them then: put back into the new one, they would count twice). Whether they went back."""
        rt = self.runtime
        if rt.incarnation != incarnation and not rt.local:
            return False
        rt.restore_round(grads, samples, seq)
        return True

    async def _announce_round(self, tries: int = 3) -> bool:
        """Publish the record that says what the round covers (`round_seq`); False if the DHT never took it."""
        for attempt in range(tries):
            if not self.failpoints.fails("round.announce") and await self.publish(force=True):
                return True
            await asyncio.sleep(0.2 * (attempt + 1))
        return False

    def _inviting(self, epoch: int) -> dict[str, ServerRecord]:
        """The partners that invited us to the round for `epoch` (they are in it), by peer id, with their records:
        counted in although our copy of a record may be stale (an older step, or not yet serving), or its peer
        ignored an earlier invitation of ours while it was loading its state. Past epochs' entries go."""
        self._inviters = {pid: e for pid, e in self._inviters.items() if e >= epoch}
        return {
            pid: r
            for pid, e in self._inviters.items()
            if e == epoch and (r := self.peers.get(pid)) is not None and pid not in self._distrusted
        }

    def _left_out(self, pid: str) -> bool:
        """Whether partner `pid` failed our last rounds and is left out of them for now (peer.server.round_failures)."""
        return self.averager is not None and self.averager.allreduce.failures.left_out(pid)

    def join_round(self, epoch: int, inviter: str = "") -> bool:
        """A partner (`inviter`, its peer id if it said) invites this replica to the round for `epoch`: True if
        it takes part."""
        if self.leaving or self._left_out(inviter):
            return False
        if inviter and inviter not in self.peers:
            self._unknown_inviter = True  # the round this starts reads the replicas' records first
        if inviter and inviter in self.peers:
            self._unresponsive.pop(inviter, None)  # it is alive and at work, whatever it ignored before
            self._inviters.pop(inviter, None)  # its newest invitation goes last: the oldest go first
            self._inviters[inviter] = epoch
            while len(self._inviters) > MAX_INVITERS:  # a bound: the oldest invitation goes first
                self._inviters.pop(next(iter(self._inviters)))
        if self.stepping:
            if self.averaging_epoch == epoch:
                return True  # already in this very round
            if self.averaging_epoch >= 0 and self.averaging_epoch == epoch - 1:
                self._pending_round = epoch  # applying the previous step: join as soon as it lands
                return True
            return False
        if self.state != "serving" or epoch != self.runtime.epoch or self.averager is None:
            return False
        if self.averager.refused_in_a_row >= self.spec.averaging.max_refused_rounds:
            return False  # it steps alone next (peer.server.averaging): not in a round it would leave
        self.stepping = True
        self.averaging_epoch = epoch
        self._tasks.append(asyncio.create_task(self._round(epoch)))
        return True
