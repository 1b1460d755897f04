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
import time

import grpc
import torch

from dht import keys
from dht.records import SpotCheckReport
from protocols import codec, stage_pb2, tensor_pb2

logger = logging.getLogger(__name__)
# the largest error of each activation codec, as a fraction of a tensor's largest magnitude (one side)
CODEC_ERROR = {tensor_pb2.NONE: 0.0, tensor_pb2.FP16: 2**-11, tensor_pb2.BF16: 2**-8, tensor_pb2.INT8: 1 / 254}
MAX_RUNNING = 2  # spot checks under way at once; more are skipped (they must never slow training down)


def agree(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    if a.shape != b.shape:
        return False
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-6)
    return (a - b).abs().max().item() <= tolerance * scale


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
        self.caught_at: dict[str, int] = {}  # peer id -> the micro-batch whose check caught it

    def maybe_check(self, index: int, stage: int, request, payloads: dict, response, returned: dict, pid: str):
        """Called after each forward: with probability `rate`, check it (in the background)."""
        if not self.rate or self.rng.random() >= self.rate or len(self.running) >= MAX_RUNNING:
            return
        task = asyncio.create_task(self._check(index, stage, request, dict(payloads), response, returned, pid))
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def _ask(self, stage: int, pid: str, request, payloads: dict):
        """(outputs, epoch) of replica `pid` for `request` as inference; None if it did not answer."""
        t = self.trainer
        record = t.router.servers[stage].get(pid)
        if record is None:
            return None
        try:
            response, returned = await t.client.forward(
                record.endpoint, request, payloads, timeout=t.tcfg.request_timeout
            )
            outputs = codec.decode(response.outputs, t.cfg.server.max_tensor_elements, returned.get("outputs"))
        except (grpc.aio.AioRpcError, codec.TensorDecodeError) as e:
            logger.debug("spot check: %s did not answer: %s", record.endpoint, e)
            return None
        return outputs, response.epoch

    def _others(self, stage: int, exclude: set[str]) -> list[str]:
        """Replicas of `stage` to ask: serving, not banned, not in `exclude`."""
        now, router = time.monotonic(), self.trainer.router
        found = []
        for pid in router.servers[stage]:
            health = router.health.get(pid)
            if pid not in exclude and (health is None or health.banned_until <= now):
                found.append(pid)
        return found

    async def _check(self, index: int, stage: int, request, payloads, response, returned, pid: str) -> None:
        t = self.trainer
        try:
            first = codec.decode(response.outputs, t.cfg.server.max_tensor_elements, returned.get("outputs"))
            others = self._others(stage, {pid})
            if not others:
                self.skipped += 1
                return
            again = stage_pb2.ForwardRequest()
            again.CopyFrom(request)
            again.train, again.uid = False, ""
            second_pid = self.rng.choice(others)
            second = await self._ask(stage, second_pid, again, payloads)
            if second is None or second[1] != response.epoch:
                self.skipped += 1  # no answer, or at another step: not comparable
                return
            self.checks += 1
            if agree(first, second[0], self.tolerance):
                return
            self.disagreements += 1
            thirds = self._others(stage, {pid, second_pid})
            third = await self._ask(stage, self.rng.choice(thirds), again, payloads) if thirds else None
            if third is None or third[1] != response.epoch:
                logger.warning(
                    "spot check of stage %d: %s and %s disagree and no third replica could decide",
                    stage,
                    pid,
                    second_pid,
                )
                return
            with_first, with_second = agree(first, third[0], self.tolerance), agree(second[0], third[0], self.tolerance)
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
        record = SpotCheckReport(wrong=dict(self.wrong), updated=time.time())
        try:
            await t.dht.astore(keys.reports_key(t.spec.name), record, t.cfg.network.record_ttl * 3)
        except Exception as e:  # the DHT may be busy: reported again next period
            logger.warning("could not report the spot checks: %s", e)
