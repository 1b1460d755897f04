"""A whole run from the command line: coordinator, servers (one choosing its stage), trainer, status, leaving."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

SPEC = {
    "name": "e2e",
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128, "max_seq_len": 64},
    "stages": {"num_stages": 2},
    "training": {
        "micro_batch_size": 8,
        "seq_len": 64,
        "target_batch_size": 16,
        "total_steps": 40,
        "lr": 0.01,
        "warmup_steps": 4,
    },
    "data": {"validation_bytes": 8192},  # a quick look: 16 micro-batches a validation
}


def test_run_trains_and_everything_stops(swarm):
    maddr = swarm.coordinator(SPEC)
    first = swarm.server("s0", 0)
    swarm.endpoint(first)
    second = swarm.server("auto")  # no --stage: must pick the stage nobody serves
    second.wait_for(r"Serving stage 1 of 2", 60)
    swarm.endpoint(second)
    trainer = swarm.trainer("t0", ["--eval-every", "20", "--progress"])
    assert trainer.wait(240) == 0, trainer.output()[-3000:]

    log = swarm.log("t0")
    losses = [e["loss"] for e in log if e["type"] == "micro_batch"]
    evals = [e["loss"] for e in log if e["type"] == "eval"]
    assert len(losses) >= 80
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 1.0  # from ~5.5 nats to well below
    assert len(evals) >= 2 and evals[-1] < evals[0]
    assert "step " in trainer.output() and "samples/s" in trainer.output()

    status = subprocess.run(
        [sys.executable, "-m", "peer.cli.main", "status", maddr],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, TMPDIR=str(swarm.workdir)),
    )
    assert status.returncode == 0, status.stderr
    assert "Run 'e2e'" in status.stdout and status.stdout.count("serving") == 2

    # a server leaves cleanly on SIGTERM, well within 10 s
    started = time.monotonic()
    second.signal(signal.SIGTERM)
    assert second.wait(15) == 0
    assert time.monotonic() - started < 10
    assert "Leaving the swarm" in second.output()
