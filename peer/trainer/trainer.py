"""A trainer: routes micro-batches of its data through the stages, forward then backward.

Each call goes to one live server of the stage, chosen at random by throughput and latency, with
a deadline from what the call should cost there. A call that fails, times out or returns a bad
tensor bans that server for a while (longer each time in a row) and goes to another replica of
the same stage; backward is stateless (it carries the stage's inputs), so any replica can serve
it. Backwards never give up, and each is kept (peer.trainer.ledger) until its server has stepped it, to be
replayed elsewhere if that server goes away first: every sample is counted once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dht.node import SwarmDHT
from peer.config import PeerConfig, RunSpec
from peer.data.validation import Scores, ValidationSet, digest
from peer.net.client import StageClient
from peer.swarm.router import Router
from peer.trainer.calls import Calls
from peer.trainer.feed import Feed
from peer.trainer.journal import Entry, Journal
from peer.trainer.ledger import Ledger
from peer.trainer.reporting import Reporting
from peer.trainer.settling import Settling
from peer.trainer.spotcheck import SpotChecker
from peer.trainer.tracking import Tracker
from protocols import codec, stage_pb2, tensor_pb2

logger = logging.getLogger(__name__)


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
    val_scores: list[tuple[int, Scores]] = field(default_factory=list)  # (step, loss, perplexity, bits per byte)


class Trainer(Calls, Settling, Reporting):
    """A trainer's loop: micro-batches through the stages, a few at a time, until the run's last step."""

    def __init__(self, spec: RunSpec, cfg: PeerConfig, dht: SwarmDHT, feed: Feed | None = None):
        self.spec, self.cfg, self.tcfg, self.dht = spec, cfg, cfg.trainer, dht
        self.num_stages = spec.stages.num_stages
        inner = spec.averaging.inner_steps if spec.averaging.mode == "local" else 0
        self.router = Router(dht, spec.name, self.num_stages, self.tcfg, cfg.network, inner_steps=inner)
        self.ledger = Ledger(
            on_empty=self._receipts_gone, on_stepped=lambda r: self.journal.stepped(r.request.uid, r.stage)
        )
        # micro-batches not settled, on disk: a start after a kill finishes the last one's (peer.trainer.journal)
        self.journal = Journal(journal_path(cfg, dht, spec))
        self._recovered: collections.deque[Entry] = collections.deque()
        self.client = StageClient.for_server(cfg.server, dht.security)
        # micro-batches and the validation set (peer.trainer.feed): its order is seeded by the peer id by default
        self.feed = feed or Feed(spec, cfg, trainer_seed(cfg, dht), data_position_path(cfg, dht, spec))
        name = f"{spec.name}-{dht.peer_id[-8:]}"
        self.tracker = Tracker(self.tcfg.tensorboard, self.tcfg.wandb, name, spec.to_dict())  # curves, if asked
        self.codec = codec.codec_from_name(spec.compression.activations)
        self.sync_quota = spec.sync_quota()  # synchronous mode: this trainer's micro-batches in each step; 0: off
        self.summary = TrainerSummary()
        self.metrics = None  # peer.net.metrics.Metrics of this process, when it serves them
        self.progress = None  # peer.trainer.progress.TrainerProgress: a bar on a terminal, else lines or nothing
        self.recent: collections.deque[tuple[float, int, float]] = collections.deque(
            maxlen=256
        )  # (time, samples, loss)
        self.started = time.time()
        # in every micro-batch's uid: a restarted trainer (same key, same data order) is not taken for a retry
        self.nonce = secrets.token_hex(4)
        self.inflight_samples = 0  # samples of the micro-batches under way (the books: some stages may hold them)
        self._log = open(self.tcfg.log_file, "a", buffering=1) if self.tcfg.log_file else None  # noqa: SIM115
        self._last_eval_epoch = 0
        self._last_progress = self._last_track = 0.0
        self._no_server_since: dict[int, float] = {}  # stage -> time.time() it was first found unserved
        self._said_unserved: dict[int, float] = {}
        self._settling = asyncio.Lock()  # one settle pass at a time: a receipt is replayed once
        self._settle_task: asyncio.Task | None = None
        self.stopping = False
        self.spot = SpotChecker(self)
        self.last_validation: ValidationSet | None = None  # the set the last validation ran on

    # ---- one micro-batch ------------------------------------------------------------------
    async def _micro_batch(self, entry: Entry, index: int) -> tuple[float, int]:
        """One micro-batch forward through the stages, then backward. A backward goes first to the server
        that did its stage's forward, or, for a micro-batch an earlier start left, to the server that start
        sent it to (which answers it again without adding it, if it had). A stage that stepped it already,
        or whose receipt for it the earlier start wrote down (held in our ledger now), gets it dry."""
        self.journal.begin(entry)
        entry.held = {s: r for s, r in entry.receipts.items() if s not in entry.stepped}
        entry.dry = set(entry.stepped) | set(entry.held)
        run, uid, n = self.spec.name, entry.uid, self.num_stages
        inputs, targets = entry.inputs, entry.targets
        # what each stage received: a Tensor header and, for large tensors, its bytes outside the message
        stage_inputs: list[tuple[tensor_pb2.Tensor, object]] = [(codec.encode(inputs.to(torch.int32)), None)]
        servers: list[str] = []
        epoch = 0
        # synchronous mode: the step this micro-batch belongs to (each server runs it once it has taken the ones before)
        step = index // self.sync_quota if self.sync_quota and index >= 0 else 0
        for stage in range(n - 1):
            request = stage_pb2.ForwardRequest(
                run_id=run, stage=stage, uid=uid, output_codec=self.codec, train=True, step=step
            )
            request, payloads = _with(request, "inputs", *stage_inputs[-1])
            response, returned, pid = await self._call(stage, "forward", request, payloads)
            self.spot.maybe_check(index, stage, request, payloads, response, returned, pid)
            stage_inputs.append((response.outputs, returned.get("outputs")))
            servers.append(pid)
            epoch = max(epoch, response.epoch)
        request = stage_pb2.BackwardRequest(
            run_id=run,
            stage=n - 1,
            uid=uid,
            targets=codec.encode(targets.to(torch.int32)),
            output_codec=self.codec,
            dry=n - 1 in entry.dry,
            step=step,
        )
        request, payloads = _with(request, "inputs", *stage_inputs[-1])
        response, returned, pid = await self._stage_backward(entry, n - 1, request, payloads, entry.sent.get(n - 1))
        self.spot.maybe_check(index, n - 1, request, payloads, response, returned, pid)  # its loss and gradients
        loss, epoch = response.loss, max(epoch, response.epoch)
        grad = (response.grad_inputs, returned.get("grad_inputs"))
        for stage in reversed(range(n - 1)):
            request = stage_pb2.BackwardRequest(
                run_id=run, stage=stage, uid=uid, output_codec=self.codec, dry=stage in entry.dry, step=step
            )
            request, payloads = _with(request, "inputs", *stage_inputs[stage])
            request, payloads = _with(request, "grad_outputs", *grad, payloads)
            prefer = entry.sent.get(stage, servers[stage])
            response, returned, _ = await self._stage_backward(entry, stage, request, payloads, prefer)
            grad, epoch = (response.grad_inputs, returned.get("grad_inputs")), max(epoch, response.epoch)
        return loss, epoch

    async def _stage_backward(self, entry: Entry, stage: int, request, payloads, prefer: str | None):
        """A stage's backward of `entry`. An earlier start's receipt for it (sent dry now) goes into the ledger;
        one the earlier start sent and got no answer for goes to that server only, while it lives: it may
        have added it (and answers it again without adding it)."""
        unanswered = entry.recovered and stage in entry.sent and stage not in entry.receipts and not request.dry
        insist = entry.sent[stage] if unanswered else None
        answer = await self._backward(stage, request, payloads, prefer=prefer, insist=insist)
        if stage in entry.held:
            self._hold_receipt(stage, request, payloads, entry.held.pop(stage))
        return answer

    async def evaluate(self, wait: float = 0.0) -> Scores:
        """Loss, perplexity and bits per byte over the fixed validation set, forward only (a few at a time);
        UserError if the set is not built within `wait` s (it is built in the background from the start)."""
        full = await asyncio.to_thread(self.feed.validation, wait)
        val = full.first(self.tcfg.eval_batches)
        gate = asyncio.Semaphore(max(1, self.tcfg.max_inflight))

        async def loss_of(inputs: torch.Tensor, targets: torch.Tensor) -> float:
            async with gate:
                received = (codec.encode(inputs.to(torch.int32)), None)
                for stage in range(self.num_stages):
                    request = stage_pb2.ForwardRequest(run_id=self.spec.name, stage=stage, output_codec=self.codec)
                    if stage == self.num_stages - 1:
                        request.targets.CopyFrom(codec.encode(targets.to(torch.int32)))
                    response, returned, _ = await self._call(stage, "forward", *_with(request, "inputs", *received))
                    received = (response.outputs, returned.get("outputs"))
                return response.loss

        losses = await asyncio.gather(*(loss_of(x, y) for x, y in val.batches))
        self.last_validation = val
        return Scores.of(list(losses), val)

    def request_stop(self) -> None:
        """Start no more micro-batches; finish those under way and settle their receipts, then return."""
        self.stopping = True

    def _done(self, index: int) -> bool:
        if self.stopping:
            return True
        if self.tcfg.max_micro_batches and index >= self.tcfg.max_micro_batches:
            return True
        if self.sync_quota and index // self.sync_quota >= self.spec.training.total_steps:
            return True  # synchronous mode: its share of the last step is sent
        # what most replicas of a part say (peer.swarm.consensus), not one answer: one peer cannot end the run
        if not self.router.reached(self.spec.training.total_steps):
            return False
        seen = "; ".join(
            f"slot {slot}: " + ", ".join(f"{pid[-6:]}@{r.epoch}" for pid, r in servers.items())
            for slot, servers in enumerate(self.router.servers)
        )
        logger.info("the run reached training.total_steps by its replicas' records (%s)", seen)
        return True

    async def _next(self, index: int) -> tuple[Entry, int]:
        """The next micro-batch: one an earlier start left unsettled, else new data; its index (-1: recovered)."""
        if self._recovered:
            return self._recovered.popleft(), -1
        # a stream's thread normally has it ready; at the start (or on a slow disk) this waits off the loop
        inputs, targets = await asyncio.to_thread(self.feed.next) if self.feed.stream else self.feed.next()
        return Entry(f"{self.dht.peer_id[-10:]}-{self.nonce}-{index}", inputs, targets), index

    async def run(self) -> TrainerSummary:
        self._recovered.extend(self.journal.open(self.started))
        await self.router.refresh()
        refresher = asyncio.create_task(self._refresh_loop())
        inflight: set[asyncio.Task] = set()
        index, clean = 0, False
        try:
            while True:
                while (
                    len(inflight) < max(1, self.tcfg.max_inflight)
                    and self.ledger.nbytes < self.tcfg.max_receipt_mb * 2**20
                    and not (self._done(index) and (self.stopping or not self._recovered))
                ):
                    entry, number = await self._next(index)
                    task = asyncio.create_task(self._micro_batch(entry, number))
                    task.index, task.entry, task.samples = number, entry, entry.inputs.shape[0]
                    inflight.add(task)
                    self.inflight_samples += task.samples
                    index += number >= 0
                if not inflight:
                    if self._done(index) and (self.stopping or not self._recovered):
                        break
                    await asyncio.sleep(0.2)  # too many unstepped backwards: wait for the servers to step
                    continue
                done, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: t.index):
                    self._finished(task)
                await self._maybe_evaluate()
                self._maybe_progress()
                self._maybe_track()
            if self.tcfg.eval_every and not self.stopping:
                await self._evaluate_and_log(force=True)
            refresher.cancel()
            if self._settle_task is not None:
                await self._settle_task
            await self.drain()
            clean = True
        finally:
            self.journal.close(clean)
            # its position saved (a start after this one goes on from there); off the loop: a thread to join
            await asyncio.to_thread(self.feed.close)
            await asyncio.to_thread(self.tracker.close)
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

    def _receipts_gone(self, uid: str) -> None:
        """The last receipt of micro-batch `uid` left the ledger: if it completed, it is settled."""
        entry = self.journal.entries.get(uid)
        if entry is not None and entry.done:
            self.journal.settled(uid)

    def _finished(self, task: asyncio.Task) -> None:
        self.inflight_samples -= task.samples
        entry = task.entry
        if task.exception() is not None:
            self.summary.failed_micro_batches += 1
            self.journal.settled(entry.uid)  # given up: what stages took stays there (docs: known limits)
            logger.error("micro-batch %d given up: %s", task.index, task.exception())
            self._write({"type": "failed", "index": task.index, "error": str(task.exception())})
            return
        loss, epoch = task.result()
        if entry.done_before:  # an earlier start completed it (and counted it): now every stage has it
            dry = sorted(entry.dry)  # the stages that had stepped it: they got it dry
            self._write(
                {"type": "recovered", "uid": entry.uid, "samples": task.samples, "dry": dry, "time": time.time()}
            )
        else:
            self._count(task, loss, epoch)
        # after the log line: a kill in between runs it again under its uid, and the log says it twice
        # with that uid (the stages count it once), rather than not at all
        self.journal.done(entry.uid, task.samples)
        if not self.ledger.held[entry.uid]:
            self.journal.settled(entry.uid)

    def _count(self, task: asyncio.Task, loss: float, epoch: int) -> None:
        s = self.summary
        s.samples += task.samples
        s.micro_batches += 1
        # an answer's step counts only server.max_resync_jump past what most replicas said at the last look (a
        # hostile server may answer any step; honest ones run ahead of that look by the steps taken since)
        s.epoch = max(s.epoch, min(epoch, self.router.max_epoch + self.cfg.server.max_resync_jump))
        s.losses.append(loss)
        self.recent.append((time.monotonic(), task.samples, loss))
        self._write(
            {
                "type": "micro_batch",
                "index": task.index,
                "uid": task.entry.uid,
                "loss": loss,
                "samples": task.samples,
                "epoch": epoch,
                "data": digest(task.entry.inputs),  # which sequences: trainers' streams differ, a restart goes on
                "time": time.time(),
            }
        )


def trainer_seed(cfg: PeerConfig, dht: SwarmDHT) -> int:
    """trainer.seed, or one from the peer id: trainers do not feed the swarm the same sequences."""
    return cfg.trainer.seed if cfg.trainer.seed >= 0 else int.from_bytes(dht.identity.public_bytes[:4], "big")


def data_position_path(cfg: PeerConfig, dht: SwarmDHT, spec: RunSpec) -> Path:
    """trainer.data_position_file, or KEY.RUN.data.json beside the trainer's identity key."""
    if cfg.trainer.data_position_file:
        return Path(cfg.trainer.data_position_file)
    key = Path(dht.identity.path or "trainer.pem").resolve()
    return key.with_name(f"{key.stem}.{spec.name}.data.json")


def journal_path(cfg: PeerConfig, dht: SwarmDHT, spec: RunSpec) -> Path:
    """trainer.journal_file, or KEY.RUN.journal.jsonl beside the trainer's identity key."""
    if cfg.trainer.journal_file:
        return Path(cfg.trainer.journal_file)
    key = Path(dht.identity.path or "trainer.pem").resolve()
    return key.with_name(f"{key.stem}.{spec.name}.journal.jsonl")


def _with(request, field: str, header: tensor_pb2.Tensor, payload, payloads: dict | None = None):
    """Set a Tensor field of `request` from a received (header, payload) pair; returns (request, payloads)."""
    payloads = dict(payloads or {})
    getattr(request, field).CopyFrom(header)
    if payload is not None:
        payloads[field] = payload
    return request, payloads
