"""What a trainer says: validation now and then, its loss and speed, progress, JSON lines, and its DHT record.

Reporting is a piece of peer.trainer.trainer.Trainer, on the trainer's event loop."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from dht import keys
from dht.errors import UserError
from dht.records import TrainerRecord
from peer.model.optim import lr_at
from peer.trainer.calls import MicroBatchFailed

logger = logging.getLogger(__name__)


class Reporting:
    """The bookkeeping a Trainer reports (Trainer inherits it)."""

    async def _maybe_evaluate(self) -> None:
        every = self.tcfg.eval_every
        if every and self.summary.epoch // every > self._last_eval_epoch // every:
            await self._evaluate_and_log()

    async def _evaluate_and_log(self, force: bool = False) -> None:
        if not force and self.summary.epoch == self._last_eval_epoch:
            return
        self._last_eval_epoch = self.summary.epoch
        wait = self.tcfg.validation_wait * (10 if force else 1)  # the last one waits longer for the set
        try:
            scores = await self.evaluate(wait)
        except (MicroBatchFailed, UserError) as e:
            logger.warning("validation skipped: %s", e)
            return
        epoch = self.summary.epoch
        self.summary.val_losses.append((epoch, scores.loss))
        self.summary.val_scores.append((epoch, scores))
        logger.info(
            "validation at step %d: loss %.4f, perplexity %.2f, %.4f bits per byte",
            epoch,
            scores.loss,
            scores.perplexity,
            scores.bits_per_byte,
        )
        values = {"loss": scores.loss, "perplexity": scores.perplexity, "bits_per_byte": scores.bits_per_byte}
        self.tracker.log(self.summary.samples, {f"val/{k}": v for k, v in values.items()})
        entry = {"type": "eval", "epoch": epoch, "loss": scores.loss, "perplexity": scores.perplexity}
        val = self.last_validation
        entry.update(bits_per_byte=scores.bits_per_byte, sequences=val.digest, tokens=val.tokens, bytes=val.nbytes)
        self._write({**entry, "time": time.time()})

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

    def _maybe_track(self, every: float = 2.0) -> None:
        """Training curves to TensorBoard / W&B every few seconds (peer.trainer.tracking)."""
        if not self.tracker.active or time.monotonic() - self._last_track < every:
            return
        self._last_track = time.monotonic()
        s = self.summary
        values = {
            "train/loss": self.train_loss(),
            "train/learning_rate": lr_at(s.epoch, self.spec.training),
            "train/samples_per_second": self.samples_per_second(),
            "train/step": s.epoch,
            "swarm/servers": sum(len(servers) for servers in self.router.servers),
        }
        self.tracker.log(s.samples, values)

    def _write(self, entry: dict) -> None:
        if self._log:
            self._log.write(json.dumps(entry) + "\n")

    def _replaying(self) -> list[int]:
        """Per stage: samples of backwards whose server went away before stepping them (to be replayed)."""
        out = [0] * self.num_stages
        for r in self.ledger.receipts:
            if self.router.gone(r.peer_id, r.incarnation, r.heard):
                out[r.stage] += r.samples
        return out

    async def _announce(self) -> None:
        s = self.summary
        record = TrainerRecord(
            samples=s.samples,
            inflight=self.inflight_samples,
            replaying=self._replaying(),
            micro_batches=s.micro_batches,
            samples_per_second=self.samples_per_second(),
            train_loss=self.train_loss(),
            val_loss=s.val_losses[-1][1] if s.val_losses else None,
            val_bits_per_byte=s.val_scores[-1][1].bits_per_byte if s.val_scores else None,
            epoch=s.epoch,
            failed_calls=s.failed_calls,
            bans=s.bans,
            banned=self.router.banned_endpoints(),
            bytes_sent=s.bytes_sent,
            bytes_received=s.bytes_received,
            metrics=self.metrics.endpoint if self.metrics else "",
            started=self.started,
            predecessors=self.journal.predecessors,
            updated=time.time(),
        )
        try:
            await self.dht.astore(keys.trainers_key(self.spec.name), record, self.cfg.network.record_ttl)
        except Exception as e:  # the DHT may be busy: announced again next period
            logger.warning("could not announce the trainer: %s", e)
        await self.spot.report()

    async def _refresh_loop(self) -> None:
        last_announce = 0.0
        while True:
            await asyncio.sleep(self.tcfg.refresh_period)
            try:
                await self.router.refresh()
            except Exception as e:  # the DHT may be busy: refreshed again next period
                logger.warning("router refresh failed: %s", e)
            if self._settle_task is None or self._settle_task.done():
                self._settle_task = asyncio.create_task(self.settle())
            if time.monotonic() - last_announce > self.cfg.network.announce_period:
                last_announce = time.monotonic()
                await self._announce()
