"""The swarm computes what plain PyTorch computes: real processes, real DHT, real gRPC."""

from __future__ import annotations

import math

import torch
from helpers.calls import info

from peer.config import RunSpec
from peer.data.corpus import load_corpus
from peer.trainer.local import train_local

SPEC = {
    "name": "equal",
    "seed": 3,
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128, "max_seq_len": 64},
    "stages": {"num_stages": 2},
    "training": {
        "micro_batch_size": 4,
        "seq_len": 64,
        "target_batch_size": 8,
        "total_steps": 22,
        "lr": 0.003,
        "warmup_steps": 3,
    },
}
STEPS = 22


def test_one_server_per_stage_matches_plain_pytorch(swarm):
    """Per-micro-batch losses equal a single-process loop with the same gradient accumulation (1e-4 relative)."""
    swarm.coordinator(SPEC)
    servers = [swarm.server(f"s{stage}", stage) for stage in range(2)]
    endpoints = [swarm.endpoint(s) for s in servers]
    trainer = swarm.trainer("t0", ["--seed", "5", "--max-inflight", "1"])
    assert trainer.wait(240) == 0, trainer.output()[-3000:]

    swarm_losses = [
        e["loss"] for e in sorted(swarm.log("t0"), key=lambda e: e.get("index", 0)) if e["type"] == "micro_batch"
    ]
    torch.set_num_threads(1)
    reference = train_local(RunSpec.from_dict(SPEC), load_corpus(), STEPS, seed=5).micro_batch_losses
    per_step = SPEC["training"]["target_batch_size"] // SPEC["training"]["micro_batch_size"]
    assert len(swarm_losses) >= 20 * per_step
    for i, (ours, theirs) in enumerate(zip(swarm_losses, reference, strict=False)):
        assert math.isclose(ours, theirs, rel_tol=1e-4), (
            f"micro-batch {i} (step {i // per_step}): swarm {ours} vs local {theirs}"
        )
    assert swarm_losses[-1] < swarm_losses[0]
    for endpoint in endpoints:
        state = info(endpoint)
        assert state.epoch >= 20
        assert (
            state.samples_stepped + state.samples_accumulated
            == len(swarm_losses) * SPEC["training"]["micro_batch_size"]
        )
