"""A trainer: routes micro-batches of its data through the stages, forward then backward.

Each call goes to one live server of the stage, chosen at random by throughput and latency, with
a deadline from what the call should cost there. A call that fails, times out or returns a bad
tensor bans that server for a while (longer each time in a row) and goes to another replica of
the same stage; backward is stateless (it carries the stage's inputs), so any replica can serve
it. Backwards never give up, and each is kept (peer.ledger) until its server has stepped it, to be
replayed elsewhere if that server goes away first: every sample is counted once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field

import grpc
import torch
from google.protobuf.message import DecodeError

from dht import keys
from dht.node import SwarmDHT
from dht.records import TrainerRecord
from peer.client import StageClient
from peer.config import PeerConfig, RunSpec
from peer.corpus import Corpus, Sampler, validation_batches
from peer.ledger import Check, Ledger, Receipt
from peer.router import NoServer, Router
from peer.spotcheck import SpotChecker
from protocols import codec, framing, stage_pb2, tensor_pb2

logger = logging.getLogger(__name__)
# our own fault, not the server's: a malformed request, or this trainer's credential refused (revoked)
_CALLER_FAULTS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
WORK = {"forward": 1 / 3, "backward": 1.0}  # share of a forward+backward (a backward recomputes on a cache miss)


class MicroBatchFailed(RuntimeError):
    """A micro-batch could not pass a stage on any replica within the retries."""


class BadAnswer(RuntimeError):
    """A server answered with a tensor that cannot be right (wrong shape, NaN or Inf)."""


@dataclass
class TrainerSummary:
    samples: int = 0
    micro_batches: int = 0
    failed_micro_batches: int = 0
    failed_calls: int = 0  # calls that failed and went to another replica
    replayed: int = 0  # backwards replayed because their server went away before stepping them
    bans: int = 0  # servers banned after a failed call
    bytes_sent: int = 0  # bytes of the calls' requests
    bytes_received: int = 0  # bytes of the answers
    epoch: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)


class Trainer:
    def __init__(self, spec: RunSpec, cfg: PeerConfig, dht: SwarmDHT, corpus: Corpus):
        self.spec, self.cfg, self.tcfg, self.dht = spec, cfg, cfg.trainer, dht
        t = spec.training
        self.num_stages = spec.stages.num_stages
        self.router = Router(dht, spec.name, self.num_stages, self.tcfg, cfg.network.record_ttl)
        self.ledger = Ledger()
        self.client = StageClient.for_server(cfg.server, dht.security)
        seed = self.tcfg.seed if self.tcfg.seed >= 0 else int.from_bytes(dht.identity.public_bytes[:4], "big")
        self.sampler = Sampler(corpus.train, t.seq_len, t.micro_batch_size, seed=seed)
        self.val = (
            validation_batches(corpus, t.seq_len, t.micro_batch_size, self.tcfg.eval_batches)
            if self.tcfg.eval_every
            else []
        )
        self.codec = codec.codec_from_name(spec.compression.activations)
        self.summary = TrainerSummary()
        self.metrics = None  # peer.metrics.Metrics of this process, when it serves them
        self.progress = None  # peer.progress.TrainerProgress: a bar on a terminal, else lines or nothing
        self.recent: collections.deque[tuple[float, int, float]] = collections.deque(
            maxlen=256
        )  # (time, samples, loss)
        self.started = time.time()
        self._log = open(self.tcfg.log_file, "a", buffering=1) if self.tcfg.log_file else None  # noqa: SIM115
        self._last_eval_epoch = 0
        self._last_progress = 0.0
        self._no_server_since: dict[int, float] = {}  # stage -> time.time() it was first found unserved
        self._said_unserved: dict[int, float] = {}
        self._settling = asyncio.Lock()  # one settle pass at a time: a receipt is replayed once
        self._settle_task: asyncio.Task | None = None
        self.stopping = False
        self.spot = SpotChecker(self)

    # ---- calls with rerouting -------------------------------------------------------------
    async def _wait_for_server(self, stage: int, pause: float) -> None:
        """Every server of `stage` is banned or gone: say so (which stage, since when), wait, look again."""
        if not self.router.servers[stage]:
            since = self._no_server_since.setdefault(stage, time.time())
            if self.tcfg.no_server_wait and time.time() - since > self.tcfg.no_server_wait:
                raise MicroBatchFailed(f"no server for stage {stage} answered for {self.tcfg.no_server_wait:.0f} s")
            if time.monotonic() - self._said_unserved.get(stage, 0.0) > 5.0:
                self._said_unserved[stage] = time.monotonic()
                logger.warning(
                    "stage %d has no live server since %s (%.0f s); waiting for one to come back",
                    stage,
                    time.strftime("%H:%M:%S", time.localtime(since)),
                    time.time() - since,
                )
        await asyncio.sleep(pause)
        with contextlib.suppress(Exception):
            await self.router.refresh()

    async def _call(
        self,
        stage: int,
        method: str,
        request,
        payloads: dict | None = None,
        prefer: str | None = None,
        exclude: set[str] | None = None,
    ):
        """One forward or backward on some replica of `stage`; returns (response, payloads, peer id).

        Forwards give up after max_retries failures; backwards never do (a later stage has counted
        the micro-batch already), they wait for a replica instead.
        """
        avoid = set(exclude or ())
        tried: set[str] = set()
        attempts, pause = 0, 0.25
        samples = request.inputs.shape[0] if request.inputs.shape else 1
        kind = f"{method}/{int(request.HasField('targets'))}/{int(getattr(request, 'train', True))}"
        sent = request.ByteSize() + sum(len(p) for p in (payloads or {}).values())  # once: the same every try
        moved = self._call_bytes(stage, method, request, sent)
        while True:
            try:
                pid, record = self.router.choose(stage, avoid | tried, prefer, kind)
            except NoServer:
                await self._wait_for_server(stage, pause)
                pause, tried = min(pause * 2, 5.0), set()
                continue
            if stage in self._no_server_since:
                since = self._no_server_since.pop(stage)
                logger.warning("stage %d is served again after %.0f s", stage, time.time() - since)
            timeout = self.router.deadline(pid, record, kind, samples, WORK[method], moved)
            started = time.monotonic()
            self._count_bytes("sent", sent)
            blame = True  # the server's own fault (banned); not when its MoE layer's experts did not answer
            try:
                call = self.client.forward if method == "forward" else self.client.backward
                response, returned = await call(record.endpoint, request, payloads, timeout=timeout)
                self._count_bytes("received", response.ByteSize() + sum(len(p) for p in returned.values()))
                self._check_answer(stage, method, request, response, returned)
                self.router.report_success(pid, kind, time.monotonic() - started)
                if method == "backward":
                    self.router.report_answer(pid, response.incarnation, response.stepped_seq)
                self._write_call(stage, method, pid, record.endpoint, started, None)
                return response, returned, pid
            except grpc.aio.AioRpcError as e:
                if e.code() in _CALLER_FAULTS:
                    raise MicroBatchFailed(
                        f"stage {stage} refused our {method}: {e.code().name}: {e.details()}"
                    ) from None
                reason = f"{e.code().name}: {e.details()}"
                details = (e.details() or "").lower()
                if e.code() == grpc.StatusCode.UNAVAILABLE and "leaving" in details:
                    self.router.report_leaving(pid)
                elif e.code() == grpc.StatusCode.UNAVAILABLE and "connection refused" in details:
                    self.router.report_dead(pid)
                elif e.code() == grpc.StatusCode.UNAVAILABLE and details.startswith("experts unavailable"):
                    blame = False  # every replica of the stage would fail alike: wait for the experts instead
            except (BadAnswer, codec.TensorDecodeError, framing.FramingError, DecodeError) as e:
                reason = str(e)
            if blame:
                ban = self.router.report_failure(pid)
                tried.add(pid)
                self.summary.bans += 1 if ban > 0 else 0
                if self.metrics is not None and ban > 0:
                    self.metrics.bans.inc()
            else:
                ban = 0.0
                await asyncio.sleep(self.tcfg.ban_time)
            attempts += 1
            self.summary.failed_calls += 1
            self._write_call(stage, method, pid, record.endpoint, started, reason)
            logger.warning(
                "stage %d %s on %s failed after %.1f s (%s); banned %.0f s, trying another replica",
                stage,
                method,
                record.endpoint,
                time.monotonic() - started,
                reason,
                ban,
            )
            if method == "forward" and attempts >= self.tcfg.max_retries:
                raise MicroBatchFailed(f"stage {stage} {method} failed on {attempts} tries")

    def _count_bytes(self, direction: str, n: int) -> None:
        if direction == "sent":
            self.summary.bytes_sent += n
        else:
            self.summary.bytes_received += n
        if self.metrics is not None:
            self.metrics.bytes.labels(direction, "activations").inc(n)

    def _write_call(self, stage: int, method: str, pid: str, endpoint: str, started: float, error: str | None):
        if self.metrics is not None:
            self.metrics.calls.labels(method, "ok" if error is None else "error").inc()
            self.metrics.call_seconds.labels(method).observe(time.monotonic() - started)
        if self.tcfg.log_calls or error is not None:
            entry = {"type": "call", "stage": stage, "method": method, "peer": pid, "endpoint": endpoint}
            entry.update(time=time.time(), seconds=time.monotonic() - started)
            if error is not None:
                entry["error"] = error
            self._write(entry)

    async def _backward(self, stage: int, request, payloads, prefer=None, exclude=None):
        """A backward, with its receipt kept until the server steps it."""
        response, returned, pid = await self._call(stage, "backward", request, payloads, prefer, exclude)
        samples = request.inputs.shape[0] if request.inputs.shape else 1
        self.ledger.add(
            Receipt(stage, pid, response.incarnation, response.seq, request, dict(payloads or {}), samples, time.time())
        )
        self.ledger.confirm(pid, response.incarnation, response.stepped_seq)
        return response, returned

    # ---- receipts -------------------------------------------------------------------------
    async def settle(self) -> None:
        """Settle receipts the servers stepped; replay those whose server went away without stepping them."""
        async with self._settling:
            try:
                await self._settle()
            except (MicroBatchFailed, grpc.aio.AioRpcError) as e:
                logger.error("settling receipts failed: %s", e)

    async def _settle(self) -> None:
        replay, checks = self.ledger.review(self.router)
        verdicts: dict[tuple[int, str, int, int], int | None] = {}  # one look per (stage, server, step)
        for check in checks:
            key = (check.receipt.stage, check.receipt.peer_id, check.receipt.incarnation, check.epoch)
            if key not in verdicts:
                verdicts[key] = await self._covered_by_round(check)
            covered = verdicts[key]
            if covered is not None and check.receipt.seq <= covered:
                self.ledger.remove(check.receipt)  # the survivors' step counted it
            elif covered is not None and check.decisive:
                replay.append(check.receipt)
        for receipt in replay:
            logger.warning(
                "stage %d: server %s went away before stepping %d samples of ours; replaying them on another replica",
                receipt.stage,
                receipt.peer_id[-8:],
                receipt.samples,
            )
            await self._backward(receipt.stage, receipt.request, receipt.payloads, exclude={receipt.peer_id})
            self.ledger.remove(receipt)
            self.summary.replayed += 1
            self._write({"type": "replay", "stage": receipt.stage, "peer": receipt.peer_id, "time": time.time()})

    async def _covered_by_round(self, check: Check) -> int | None:
        """How far the survivors' step `check.epoch` counted the gone server's additions (of the receipt's
        incarnation): the last addition it covered, -1 for none; None while that is not known yet."""
        gone, incarnation = check.receipt.peer_id, check.receipt.incarnation
        for pid, record in list(self.router.servers[check.receipt.stage].items()):
            if pid == gone:
                continue
            try:
                info = await self.client.info(record.endpoint, timeout=self.tcfg.deadline_floor * 2)
            except grpc.aio.AioRpcError:
                continue
            if info.epoch < check.epoch:
                return None  # the round has not finished anywhere yet
            for step in info.history:
                if step.epoch != check.epoch or not step.members:
                    continue
                for part in step.coverage:
                    if part.peer_id == gone and part.incarnation == incarnation:
                        return part.seq
                if gone in step.members and not step.coverage:
                    return sys.maxsize  # a peer too old to say: the group counted all the round took
                return -1
        return None if not self.router.servers[check.receipt.stage] else -1

    async def drain(self) -> None:
        """At the end: wait until every receipt is stepped, replayed, or held by a live server's accumulator."""
        async with self._settling:
            await self._drain()

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.tcfg.drain_timeout
        logger.info("draining %d receipts", len(self.ledger))
        while self.ledger.receipts and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                await self.router.refresh()
            holders = {r.peer_id for r in self.ledger.receipts}
            alive = set()
            for pid in holders:
                record = self.router.latest.get(pid)
                if record is None:
                    continue
                try:
                    info = await self.client.info(record.endpoint, timeout=self.tcfg.deadline_floor * 2)
                    self.router.report_answer(pid, info.incarnation, info.stepped_seq)
                    if info.state == "serving":
                        alive.add((pid, info.incarnation))
                except grpc.aio.AioRpcError as e:
                    if "connection refused" in (e.details() or "").lower():
                        self.router.report_dead(pid)
            await self._settle()
            if all((r.peer_id, r.incarnation) in alive for r in self.ledger.receipts):
                return  # the rest waits in live accumulators for their next step
            logger.info(
                "settling %d receipts of %d server(s) that went away before stepping them",
                sum(1 for r in self.ledger.receipts if (r.peer_id, r.incarnation) not in alive),
                len({r.peer_id for r in self.ledger.receipts if (r.peer_id, r.incarnation) not in alive}),
            )
            await asyncio.sleep(0.5)
        if self.ledger.receipts:
            logger.warning("%d receipts unsettled after %.0f s", len(self.ledger), self.tcfg.drain_timeout)

    def _call_bytes(self, stage: int, method: str, request, sent: int) -> int:
        """Bytes a call moves: its request (`sent` bytes), and the hidden states or input gradients it gets back."""
        returns = (method == "forward" and stage < self.num_stages - 1) or (method == "backward" and stage > 0)
        if not returns or not request.inputs.shape:
            return sent
        rows = math.prod(request.inputs.shape[:2])
        per_element = {tensor_pb2.NONE: 4, tensor_pb2.FP16: 2, tensor_pb2.BF16: 2, tensor_pb2.INT8: 1}[self.codec]
        return sent + rows * self.spec.model.hidden_size * per_element

    def _check_answer(self, stage: int, method: str, request, response, payloads: dict) -> None:
        last = stage == self.num_stages - 1
        if (last and request.HasField("targets")) and not (response.has_loss and math.isfinite(response.loss)):
            raise BadAnswer(f"stage {stage} returned no finite loss")
        expected_shape = list(request.inputs.shape)[:2] + [self.spec.model.hidden_size]
        if method == "forward" and not request.HasField("targets"):
            tensor = codec.decode(response.outputs, self.cfg.server.max_tensor_elements, payloads.get("outputs"))
        elif method == "backward" and stage > 0:
            tensor = codec.decode(
                response.grad_inputs, self.cfg.server.max_tensor_elements, payloads.get("grad_inputs")
            )
        else:
            return
        if list(tensor.shape) != expected_shape or not torch.isfinite(tensor).all():
            raise BadAnswer(
                f"stage {stage} returned a {method} tensor of shape {list(tensor.shape)} that is wrong or not finite"
            )

    # ---- one micro-batch ------------------------------------------------------------------
    async def _micro_batch(self, index: int, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
        run, uid, n = self.spec.name, f"{self.dht.peer_id[-10:]}-{index}", self.num_stages
        # what each stage received: a Tensor header and, for large tensors, its bytes outside the message
        stage_inputs: list[tuple[tensor_pb2.Tensor, object]] = [(codec.encode(inputs.to(torch.int32)), None)]
        servers: list[str] = []
        epoch = 0
        for stage in range(n - 1):
            request = stage_pb2.ForwardRequest(run_id=run, stage=stage, uid=uid, output_codec=self.codec, train=True)
            request, payloads = _with(request, "inputs", *stage_inputs[-1])
            response, returned, pid = await self._call(stage, "forward", request, payloads)
            self.spot.maybe_check(index, stage, request, payloads, response, returned, pid)
            stage_inputs.append((response.outputs, returned.get("outputs")))
            servers.append(pid)
            epoch = max(epoch, response.epoch)
        request = stage_pb2.BackwardRequest(
            run_id=run, stage=n - 1, uid=uid, targets=codec.encode(targets.to(torch.int32)), output_codec=self.codec
        )
        response, returned = await self._backward(n - 1, *_with(request, "inputs", *stage_inputs[-1]))
        loss, epoch = response.loss, max(epoch, response.epoch)
        grad = (response.grad_inputs, returned.get("grad_inputs"))
        for stage in reversed(range(n - 1)):
            request = stage_pb2.BackwardRequest(run_id=run, stage=stage, uid=uid, output_codec=self.codec)
            request, payloads = _with(request, "inputs", *stage_inputs[stage])
            request, payloads = _with(request, "grad_outputs", *grad, payloads)
            response, returned = await self._backward(stage, request, payloads, prefer=servers[stage])
            grad, epoch = (response.grad_inputs, returned.get("grad_inputs")), max(epoch, response.epoch)
        return loss, epoch

    async def evaluate(self) -> float:
        """Mean loss over the fixed held-out micro-batches, forward only."""
        losses = []
        for inputs, targets in self.val:
            received = (codec.encode(inputs.to(torch.int32)), None)
            for stage in range(self.num_stages):
                request = stage_pb2.ForwardRequest(run_id=self.spec.name, stage=stage, output_codec=self.codec)
                if stage == self.num_stages - 1:
                    request.targets.CopyFrom(codec.encode(targets.to(torch.int32)))
                response, returned, _ = await self._call(stage, "forward", *_with(request, "inputs", *received))
                received = (response.outputs, returned.get("outputs"))
            losses.append(response.loss)
        return sum(losses) / len(losses)

    # ---- the loop -------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Start no more micro-batches; finish those under way and settle their receipts, then return."""
        self.stopping = True

    def _done(self, index: int) -> bool:
        if self.stopping:
            return True
        if self.tcfg.max_micro_batches and index >= self.tcfg.max_micro_batches:
            return True
        return max(self.summary.epoch, self.router.max_epoch) >= self.spec.training.total_steps

    async def run(self) -> TrainerSummary:
        await self.router.refresh()
        refresher = asyncio.create_task(self._refresh_loop())
        inflight: set[asyncio.Task] = set()
        index = 0
        try:
            while True:
                while (
                    len(inflight) < max(1, self.tcfg.max_inflight)
                    and self.ledger.nbytes < self.tcfg.max_receipt_mb * 2**20
                    and not self._done(index)
                ):
                    inputs, targets = self.sampler.next()
                    task = asyncio.create_task(self._micro_batch(index, inputs, targets))
                    task.index, task.samples = index, inputs.shape[0]
                    inflight.add(task)
                    index += 1
                if not inflight:
                    if self._done(index):
                        break
                    await asyncio.sleep(0.2)  # too many unstepped backwards: wait for the servers to step
                    continue
                done, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: t.index):
                    self._finished(task)
                await self._maybe_evaluate()
                self._maybe_progress()
            if self.tcfg.eval_every and not self.stopping:
                await self._evaluate_and_log(force=True)
            refresher.cancel()
            if self._settle_task is not None:
                await self._settle_task
            await self.drain()
        finally:
            refresher.cancel()
            if self._settle_task is not None:
                self._settle_task.cancel()
            for task in inflight:
                task.cancel()
            self.summary.seconds = time.time() - self.started
            for task in list(self.spot.running):
                task.cancel()
            await self._announce()
            await self.client.close()
            if self._log:
                self._log.close()
        return self.summary

    def _finished(self, task: asyncio.Task) -> None:
        if task.exception() is not None:
            self.summary.failed_micro_batches += 1
            logger.error("micro-batch %d given up: %s", task.index, task.exception())
            self._write({"type": "failed", "index": task.index, "error": str(task.exception())})
            return
        loss, epoch = task.result()
        s = self.summary
        s.samples += task.samples
        s.micro_batches += 1
        s.epoch = max(s.epoch, epoch)
        s.losses.append(loss)
        self.recent.append((time.monotonic(), task.samples, loss))
        self._write(
            {
                "type": "micro_batch",
                "index": task.index,
                "loss": loss,
                "samples": task.samples,
                "epoch": epoch,
                "time": time.time(),
            }
        )

    async def _maybe_evaluate(self) -> None:
        every = self.tcfg.eval_every
        if every and self.summary.epoch // every > self._last_eval_epoch // every:
            await self._evaluate_and_log()

    async def _evaluate_and_log(self, force: bool = False) -> None:
        if not force and self.summary.epoch == self._last_eval_epoch:
            return
        self._last_eval_epoch = self.summary.epoch
        try:
            loss = await self.evaluate()
        except MicroBatchFailed as e:
            logger.warning("validation skipped: %s", e)
            return
        self.summary.val_losses.append((self.summary.epoch, loss))
        self._write({"type": "eval", "epoch": self.summary.epoch, "loss": loss, "time": time.time()})

    def samples_per_second(self, window: float = 20.0) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n, _ in self.recent if now - t <= window]
        if len(recent) < 2:
            return 0.0
        return sum(n for _, n in recent[1:]) / max(recent[-1][0] - recent[0][0], 1e-6)

    def train_loss(self) -> float | None:
        losses = [loss for _, _, loss in list(self.recent)[-16:]]
        return sum(losses) / len(losses) if losses else None

    def _maybe_progress(self) -> None:
        if self.progress is None or time.monotonic() - self._last_progress < 0.5:
            return
        self._last_progress = time.monotonic()
        s = self.summary
        val = s.val_losses[-1][1] if s.val_losses else None
        self.progress.update(s.epoch, self.samples_per_second(), self.train_loss(), val, s.failed_calls)

    def _write(self, entry: dict) -> None:
        if self._log:
            self._log.write(json.dumps(entry) + "\n")

    async def _announce(self) -> None:
        s = self.summary
        record = TrainerRecord(
            samples=s.samples,
            micro_batches=s.micro_batches,
            samples_per_second=self.samples_per_second(),
            train_loss=self.train_loss(),
            val_loss=s.val_losses[-1][1] if s.val_losses else None,
            epoch=s.epoch,
            failed_calls=s.failed_calls,
            bans=s.bans,
            banned=self.router.banned_endpoints(),
            bytes_sent=s.bytes_sent,
            bytes_received=s.bytes_received,
            metrics=self.metrics.endpoint if self.metrics else "",
            started=self.started,
            updated=time.time(),
        )
        try:
            await self.dht.astore(keys.trainers_key(self.spec.name), record, self.cfg.network.record_ttl)
        except Exception as e:
            logger.debug("could not announce the trainer: %s", e)
        await self.spot.report()

    async def _refresh_loop(self) -> None:
        last_announce = 0.0
        while True:
            await asyncio.sleep(self.tcfg.refresh_period)
            try:
                await self.router.refresh()
            except Exception as e:
                logger.debug("router refresh failed: %s", e)
            if self._settle_task is None or self._settle_task.done():
                self._settle_task = asyncio.create_task(self.settle())
            if time.monotonic() - last_announce > self.cfg.network.announce_period:
                last_announce = time.monotonic()
                await self._announce()


def _with(request, field: str, header: tensor_pb2.Tensor, payload, payloads: dict | None = None):
    """Set a Tensor field of `request` from a received (header, payload) pair; returns (request, payloads)."""
    payloads = dict(payloads or {})
    getattr(request, field).CopyFrom(header)
    if payload is not None:
        payloads[field] = payload
    return request, payloads
