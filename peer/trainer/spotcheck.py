"""Spot checks: a trainer re-sends some forwards to a second replica and compares the answers.

A fraction (`trainer.spot_check`) of the forwards a trainer makes are sent again, as inference
(no activations kept), to another replica of the same stage at the same step. The answers agree
when their largest difference is within `trainer.spot_check_tolerance` of their largest magnitude,
plus what the activation codec may lose on both sides. When they disagree, a third replica
decides: the one that disagrees with the two others is banned by this trainer for good and
reported to the coordinator (dht.records.SpotCheckReport), which revokes it once
`admission.revoke_after_reports` trainers have reported it. Without a third replica, or when all
three differ, nobody is blamed.

Replicas compare only at the same step, so a server that has just stepped is not mistaken for a
wrong one; in local (DiLoCo) mode replicas differ between outer steps, and nothing is checked.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time

import grpc
import torch

from dht import keys
from dht.records import SpotCheckReport
from peer.swarm.answers import CODEC_ERROR, agree, answer_of
from peer.swarm.consensus import agreed
from protocols import codec, stage_pb2

logger = logging.getLogger(__name__)
MAX_RUNNING = 2  # spot checks under way at once; more are skipped (they must never slow training down)
SAME_STEP_TRIES = 3  # a compare asks both replicas again this many times while they answer at different steps
SAME_STEP_WAIT = 0.5  # s between those tries
MAX_DODGES = 3  # compares a replica dodged (always at another step) before this trainer stops routing to it


class SpotChecker:
    def __init__(self, trainer):
        self.trainer = trainer
        cfg = trainer.tcfg
        self.rate = 0.0 if trainer.spec.local_updates else cfg.spot_check
        self.tolerance = cfg.spot_check_tolerance + 2 * CODEC_ERROR[trainer.codec]
        self.rng = random.Random()
        self.running: set[asyncio.Task] = set()
        self.checks = self.skipped = self.disagreements = 0
        self.wrong: dict[str, int] = {}  # peer id -> checks it was the minority of (it is banned)
        self.dodges: dict[str, int] = {}  # peer id -> compares it dodged by answering at another step
        self.caught_at: dict[str, int] = {}  # peer id -> the micro-batch whose check caught it
        self.caught_time: dict[str, float] = {}  # peer id -> when (unix time): reports expire, a pardon clears them

    def maybe_check(self, index: int, stage: int, request, payloads: dict, response, returned: dict, pid: str):
        """Called after each forward: with probability `rate`, check it (in the background)."""
        if not self.rate or self.rng.random() >= self.rate or len(self.running) >= MAX_RUNNING:
            return
        task = asyncio.create_task(self._check(index, stage, request, dict(payloads), response, returned, pid))
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def _ask(self, stage: int, pid: str, request, payloads: dict):
        """(answer, epoch) of replica `pid` for a disguised copy of `request`; None if it did not answer.

        The copy looks like work: a forward is a training forward under a fresh uid (a micro-batch of another
        session of this trainer), a last stage's backward is a dry one (as replays send), which adds nothing."""
        t = self.trainer
        record = t.router.servers[stage].get(pid)
        if record is None:
            return None
        again = type(request)()
        again.CopyFrom(request)
        again.uid = f"{t.dht.peer_id[-10:]}-{secrets.token_hex(4)}-{request.uid.rsplit('-', 1)[-1]}"
        try:
            if isinstance(again, stage_pb2.BackwardRequest):
                again.dry = True
                response, returned = await t.client.backward(
                    record.endpoint, again, payloads, timeout=t.tcfg.request_timeout, peer=pid
                )
            else:
                again.train = True
                response, returned = await t.client.forward(
                    record.endpoint, again, payloads, timeout=t.tcfg.request_timeout, peer=pid
                )
            answer = self._answer(response, returned)
        except (grpc.aio.AioRpcError, codec.TensorDecodeError) as e:
            logger.debug("spot check: %s did not answer: %s", record.endpoint, e)
            return None
        return answer, response.epoch

    def _answer(self, response, returned: dict) -> torch.Tensor | list[torch.Tensor]:
        """What is compared: a forward's outputs; a last stage's loss and the gradients it sends back."""
        return answer_of(response, returned, self.trainer.cfg.server.max_tensor_elements)

    def _others(self, stage: int, exclude: set[str]) -> list[str]:
        """Replicas of `stage` to ask: serving, not banned, not in `exclude`."""
        now, router = time.monotonic(), self.trainer.router
        found = []
        for pid in router.servers[stage]:
            health = router.health.get(pid)
            if pid not in exclude and (health is None or not health.banned(now)):
                found.append(pid)
        return found

    async def _at_one_step(self, stage: int, pid: str, second_pid: str, request, payloads, first, epoch: int):
        """(the suspect's answer, the second's, their step), asking both again while they answer at different
        steps (one just stepped), up to SAME_STEP_TRIES times; None if they never meet. A suspect at another step
        than its partner every time, its partner at the step most replicas are at, dodges the compare, whether it labels
        its answers a step ahead or behind (an honest one is met within a progress period): counted."""
        apart = True  # at every try
        for _ in range(SAME_STEP_TRIES):
            second = await self._ask(stage, second_pid, request, payloads)
            if second is None:
                return None
            if second[1] == epoch:
                return first, second[0], epoch
            # apart from a partner that is itself at the step most of the stage's replicas are at: not one catching
            # up, nor a hostile partner answering at some other step to have an honest suspect counted as dodging
            apart = apart and second[1] == agreed(r.epoch for r in self.trainer.router.servers[stage].values())
            await asyncio.sleep(SAME_STEP_WAIT)
            again = await self._ask(stage, pid, request, payloads)
            if again is None:
                return None
            (first, epoch), apart = again, apart and again[1] != second[1]
        if apart:
            self._dodged(stage, pid)
        self.skipped += 1
        return None

    async def _with_third(self, stage: int, pids: tuple[str, str, str], request, payloads, met: tuple):
        """The suspect's, the second's and a third replica's answers at one step, for a decision; None if they never
        meet. `met`: the first two answers and their step. The third is asked at once; one at another step (the
        stage stepped meanwhile) has all three asked again together, up to SAME_STEP_TRIES times: asked at one
        moment, honest replicas answer at one step; a suspect that answers at another step than the other two, at one,
        every time, dodged the compare (counted)."""
        first, second, epoch = met
        third = await self._ask(stage, pids[2], request, payloads)
        if third is not None and third[1] == epoch:
            return first, second, third[0]
        apart = third is not None  # the suspect at another step than the other two, who are at one, every time
        for _ in range(SAME_STEP_TRIES if third is not None else 0):
            await asyncio.sleep(SAME_STEP_WAIT)
            answers = await asyncio.gather(*(self._ask(stage, p, request, payloads) for p in pids))
            if any(a is None for a in answers):
                return None
            if len({a[1] for a in answers}) == 1:
                return tuple(a[0] for a in answers)
            apart = apart and answers[1][1] == answers[2][1] != answers[0][1]
        if apart:
            self._dodged(stage, pids[0])
        return None

    def _dodged(self, stage: int, pid: str) -> None:
        self.dodges[pid] = self.dodges.get(pid, 0) + 1
        logger.warning(
            "spot check of stage %d: %s answered at another step than its partner %d times in a row (%d so far)",
            stage,
            pid,
            SAME_STEP_TRIES,
            self.dodges[pid],
        )
        if self.dodges[pid] >= MAX_DODGES:
            self.trainer.router.distrust(pid)  # not reported: a dodge is not a wrong answer; this trainer avoids it

    async def _check(self, index: int, stage: int, request, payloads, response, returned, pid: str) -> None:
        try:
            first = self._answer(response, returned)
            others = self._others(stage, {pid})
            if not others:
                self.skipped += 1
                return
            second_pid = self.rng.choice(others)
            met = await self._at_one_step(stage, pid, second_pid, request, payloads, first, response.epoch)
            if met is None:
                return
            first, second, epoch = met
            self.checks += 1
            if agree(first, second, self.tolerance):
                self.dodges.pop(pid, None)  # dodges count in a row
                return
            self.disagreements += 1
            thirds = self._others(stage, {pid, second_pid})
            trio = (pid, second_pid, self.rng.choice(thirds)) if thirds else None
            decided = await self._with_third(stage, trio, request, payloads, (first, second, epoch)) if trio else None
            if decided is None:
                logger.warning(
                    "spot check of stage %d: %s and %s disagree and no third replica could decide",
                    stage,
                    pid,
                    second_pid,
                )
                return
            first, second, third = decided
            if agree(first, second, self.tolerance):  # asked again at one step, they agree after all
                return
            with_first, with_second = agree(first, third, self.tolerance), agree(second, third, self.tolerance)
            if with_first and not with_second:
                self.convict(index, stage, second_pid)
            elif with_second and not with_first:
                self.convict(index, stage, pid)
            else:
                logger.warning("spot check of stage %d: three replicas disagree; nobody is blamed", stage)
        except Exception:  # a spot check must never end the trainer: said
            logger.exception("spot check failed")

    def convict(self, index: int, stage: int, pid: str) -> None:
        t = self.trainer
        record = t.router.latest.get(pid)
        endpoint = record.endpoint if record is not None else "?"
        self.wrong[pid] = self.wrong.get(pid, 0) + 1
        self.caught_at.setdefault(pid, index)
        self.caught_time.setdefault(pid, time.time())
        t.router.distrust(pid)
        t.summary.bans += 1
        logger.warning(
            "spot check of stage %d: %s (%s) answered wrong (two other replicas agree); banned and reported",
            stage,
            endpoint,
            pid,
        )
        t._write({"type": "spot_check", "index": index, "stage": stage, "wrong": pid, "endpoint": endpoint})
        asyncio.create_task(self.report())

    async def report(self) -> None:
        """Tell the coordinator which servers this trainer caught (re-sent with each announcement)."""
        if not self.wrong:
            return
        t = self.trainer
        record = SpotCheckReport(wrong=dict(self.wrong), caught=dict(self.caught_time), updated=time.time())
        try:
            await t.dht.astore(keys.reports_key(t.spec.name), record, t.cfg.network.record_ttl * 3)
        except Exception as e:  # the DHT may be busy: reported again next period
            logger.warning("could not report the spot checks: %s", e)
