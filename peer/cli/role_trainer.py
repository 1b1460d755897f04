"""`peer join --role trainer`: train on this peer's data through the swarm's stages."""

from __future__ import annotations

import asyncio
import signal

from dht.identity import Identity
from peer.cli.join import connect, follow_admission
from peer.config import PeerConfig
from peer.data import sources
from peer.net.metrics import open_metrics, serve_metrics
from peer.trainer.progress import TrainerProgress
from peer.trainer.trainer import Trainer


def run_trainer(maddr: str, cfg: PeerConfig, identity: Identity, coordinator: str | None = None) -> int:
    if cfg.trainer.data:  # bad data is said before joining: a file it cannot use, named
        sources.check_files(sources.find_files(cfg.trainer.data), cfg.trainer.text_field)
    dht, spec = connect(maddr, cfg, identity, "trainer", coordinator)
    try:
        trainer = Trainer(spec, cfg, dht)
        print(f"Joined run '{spec.name}' as a trainer on {trainer.feed.describe}.", flush=True)
        trainer.metrics = open_metrics(cfg, "trainer", lambda: _trainer_levels(trainer), dht)
        serve_metrics(trainer.metrics, cfg)

        async def main():
            loop = asyncio.get_running_loop()
            task = asyncio.current_task()

            def on_signal():
                if trainer.stopping:
                    task.cancel()  # a second signal: stop now
                else:
                    bound = cfg.trainer.stop_timeout
                    print(
                        f"Stopping: finishing the micro-batches under way, at most {bound:g} s "
                        "(again to stop at once)...",
                        flush=True,
                    )
                    trainer.request_stop()
                    loop.call_later(bound, task.cancel)

            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, on_signal)
            follow_admission(dht, task.cancel)  # revoked: stop at once (its calls are refused now)
            return await trainer.run()

        trainer.progress = TrainerProgress(spec.training.total_steps, cfg.trainer.progress)
        try:
            summary = asyncio.run(main())
        except asyncio.CancelledError:
            trainer.progress.close()
            _report_unplaced(trainer)
            return 1
        finally:
            trainer.progress.close()  # the terminal gets its cursor back, whatever happened
        _report(summary, trainer)
        return 0 if summary.failed_micro_batches == 0 else 3
    finally:
        dht.shutdown()


def _trainer_levels(trainer: Trainer) -> dict:
    s = trainer.summary
    return {
        "samples": ("counter", "Samples through every stage, forward and backward", s.samples),
        "micro_batches": ("counter", "Micro-batches completed", s.micro_batches),
        "failed_calls": ("counter", "Calls that failed and were rerouted", s.failed_calls),
        "replayed": ("counter", "Backwards replayed on another replica", s.replayed),
        "samples_per_second": ("gauge", "Samples/s over the last 20 s", trainer.samples_per_second()),
        "train_loss": ("gauge", "Recent mean training loss", trainer.train_loss() or 0.0),
        "receipts": ("gauge", "Backwards kept until their server steps them", len(trainer.ledger)),
    }


def _report_unplaced(trainer: Trainer) -> None:
    """Stopped before the end: the backwards no live server holds or stepped are lost to the run; say so."""
    receipts = trainer.ledger.receipts
    if receipts:
        stages = sorted({r.stage for r in receipts})
        print(
            f"Stopped: {len(receipts)} backwards ({sum(r.samples for r in receipts)} samples) not yet stepped by "
            f"stage(s) {', '.join(map(str, stages))}; those a gone server held are lost to the run.",
            flush=True,
        )
    else:
        print("Stopped.", flush=True)


def _report(summary, trainer: Trainer) -> None:
    val = ""
    if summary.val_scores:
        scores = summary.val_scores[-1][1]
        val = (
            f", validation loss {scores.loss:.3f} (perplexity {scores.perplexity:.2f}, "
            f"{scores.bits_per_byte:.3f} bits per byte)"
        )
    stream = trainer.feed.stream
    if stream is not None and stream.skipped:
        print(f"Skipped {stream.skipped} bad documents of the data (not text, or without the text field).", flush=True)
    print(
        f"Done: {summary.micro_batches} micro-batches ({summary.samples} samples) in {summary.seconds:.0f} s, "
        f"reached step {summary.epoch}{val}; {summary.failed_micro_batches} given up, "
        f"{summary.failed_calls} calls rerouted, {summary.replayed} backwards replayed.",
        flush=True,
    )
