"""The step side of a replica (peer.server.replica): when to step, the step job on the torch thread
(alone, or after a round), local mode's inner steps, and what a finished step says.

Stepping is a piece of Replica: its methods use the replica's runtime, averager, record and round
state, and run on its event loop (the jobs on its torch thread)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from peer.process.status_lines import say

logger = logging.getLogger(__name__)
NOTHING_TO_STEP = -2  # a step's outcome when the accumulator was empty: no step was taken


class Stepping:
    """When and how a Replica steps (Replica inherits it)."""

    def _maybe_step(self) -> None:
        if self.runtime.local:
            self._maybe_inner_step()
        if self.stepping or self.state != "serving" or self.leaving or time.monotonic() < self._retry_after:
            return
        self._forget_strikes()
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
        local = self.runtime.samples_accumulated + self._samples_draining()
        total = local + sum(r.samples for r in at_epoch)
        # the others' counts are a progress period old, so a replica also starts when it alone has its
        # share of the target: with balanced routing the group then averages close to the target batch
        target = self.spec.training.target_batch_size
        # (not in synchronous mode: there the step is exactly the target, and every replica waits to count it all)
        share = local * (1 + len(at_epoch)) >= target and not self.spec.training.sync_trainers
        if total >= target or share or flagged:
            self._start_step()

    def _samples_draining(self) -> int:
        """Samples a drain would add to a step started now: those of forwards awaiting their backward here."""
        if not self._drains():
            return 0
        with contextlib.suppress(RuntimeError):  # the torch thread changed its cache while it was read: none
            return self.runtime.samples_awaiting_backward()
        return 0

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
        except Exception:  # a failed inner step must not end the server: said
            logger.exception("%s: inner optimizer step failed", self.label)
        finally:
            self._inner_queued = False
        await self.publish()  # an inner step changes no epoch: its count waits for the announce period
        self._maybe_step()

    def _start_step(self) -> None:
        self.stepping = True
        epoch = self.runtime.epoch
        if not (self._serving_peers() or self._inviting(epoch)) or self.averager is None:
            # alone: queued on the torch thread now, before any later request, so the step lands
            # exactly where plain gradient accumulation would put it
            self._tasks.append(asyncio.create_task(self._finish_step(self._step_alone())))
        else:
            self.averaging_epoch = epoch
            self._tasks.append(asyncio.create_task(self._round(epoch)))
        self._tasks = [t for t in self._tasks if not t.done()]

    def _take(self):
        rt = self.runtime
        grads, samples = rt.take_for_round()
        return grads, samples, rt.taken_seq, rt.incarnation

    def _step_alone(self) -> asyncio.Future:
        """Queue, on the torch thread, a step of this replica alone: now (before any later request), or, when forwards
        on its weights await their backward, after a drain (peer.server.replica_round), new forwards held meanwhile."""
        if not self._drains() or not self._awaiting():
            # nothing to wait for: queued now, before this backward's answer leaves, as plain accumulation steps
            return asyncio.get_running_loop().run_in_executor(self.executor, self._step_job)
        self.forwards_open.clear()
        return asyncio.ensure_future(self._alone_after_drain())

    async def _alone_after_drain(self):
        try:
            await self._drain()
            step = asyncio.get_running_loop().run_in_executor(self.executor, self._step_job)
        finally:
            self.forwards_open.set()  # forwards now queue behind the step: they run on its weights
        return await step

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
            say(f"{step}: averaging with {others} peer{'s' * (others > 1)} ({seconds:.2f} s a round).")
        else:
            say(f"{step}: stepping alone (no other replica in the round).")

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
        except Exception:  # a failed step must not end the server: said, and its samples wait
            logger.exception("%s: optimizer step failed", self.label)
        finally:
            self.stepping = False
            self.averaging_epoch = -1
            self.forwards_open.set()
            self._stepped.set()  # synchronous mode: micro-batches held for this step go
        pending, self._pending_round = self._pending_round, None
        if pending is not None and pending == self.runtime.epoch:
            self.join_round(pending)
        await self.publish(force=True)
        self._maybe_step()
