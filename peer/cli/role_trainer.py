"""`peer join --role trainer`: train on this peer's data through the swarm's stages."""

from __future__ import annotations

import asyncio
import signal

from dht.identity import Identity
from peer.cli.join import connect, follow_admission
from peer.config import PeerConfig
from peer.data.corpus import load_corpus
from peer.net.metrics import open_metrics, serve_metrics
from peer.trainer.progress import TrainerProgress
from peer.trainer.trainer import Trainer


def run_trainer(maddr: str, cfg: PeerConfig, identity: Identity, coordinator: str | None = None) -> int:
    corpus = load_corpus(cfg.trainer.data)
    dht, spec = connect(maddr, cfg, identity, "trainer", coordinator)
    try:
        print(
            f"Joined run '{spec.name}' as a trainer on {corpus.source} "
            f"({len(corpus.train) / 1e6:.1f} MB train, {len(corpus.validation) / 1e6:.1f} MB held out).",
            flush=True,
        )
        trainer = Trainer(spec, cfg, dht, corpus)
        trainer.metrics = open_metrics(cfg, "trainer", lambda: _trainer_levels(trainer))
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
        _report(summary)
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


def _report(summary) -> None:
    val = f", validation loss {summary.val_losses[-1][1]:.3f}" if summary.val_losses else ""
    print(
        f"Done: {summary.micro_batches} micro-batches ({summary.samples} samples) in {summary.seconds:.0f} s, "
        f"reached step {summary.epoch}{val}; {summary.failed_micro_batches} given up, "
        f"{summary.failed_calls} calls rerouted, {summary.replayed} backwards replayed.",
        flush=True,
    )
