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
        # stage 1's step gradients measure 1.1 to 2.9 here, stage 0's 0.06 to 2.4: some steps of each are
        # clipped (per stage, as the servers do) and most are not
        "max_grad_norm": 1.7,
    },
}
STEPS = 22


def test_one_server_per_stage_matches_plain_pytorch(swarm):
    """Per-micro-batch losses equal a single-process loop with the same gradient accumulation (1e-4 relative),
    training.max_grad_norm clipping some of the stages' steps."""
    swarm.coordinator(SPEC)
    servers = [swarm.server(f"s{stage}", stage) for stage in range(2)]
    endpoints = [swarm.endpoint(s) for s in servers]
    trainer = swarm.trainer("t0", ["--seed", "5", "--max-inflight", "1"])
    assert trainer.wait(240) == 0, trainer.output()[-3000:]

    swarm_losses = [
        e["loss"] for e in sorted(swarm.log("t0"), key=lambda e: e.get("index", 0)) if e["type"] == "micro_batch"
    ]
    torch.set_num_threads(1)
    local = train_local(RunSpec.from_dict(SPEC), load_corpus(), STEPS, seed=5)
    assert 2 < local.clipped_steps < STEPS * 2 - 2, local.clipped_steps  # the clip fires, not always
    reference = local.micro_batch_losses
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


def test_a_step_takes_the_lr_its_samples_put_it_at_scaled_by_its_size():
    """Swarm steps vary in size and stages step at different samples: the schedule follows the samples."""
    from peer.model.optim import lr_at
    from peer.model.runtime import StageRuntime

    spec = RunSpec.from_dict(SPEC)
    t = spec.training
    runtime = StageRuntime(spec, 0)

    def step(size: int) -> float:
        runtime.apply_step([torch.zeros_like(p) for p in runtime.params], size, 0)
        return runtime.optimizer.param_groups[0]["lr"]

    stepped = 0
    for size in [4, 8, 4, 8]:  # target 8: half, whole, half, whole
        # the plain loop's lr at this sample, times the step's share of the target batch
        assert math.isclose(step(size), lr_at(stepped / 8, t) * size / 8, rel_tol=1e-12)
        stepped += size
    assert runtime.epoch == 4 and runtime.samples_stepped == stepped == 24
    # a step of exactly the target batch after k of them is the plain loop's step k
    assert step(8) == lr_at(3, t)
    # a larger one (a failed round's samples carried over) takes the peak of its place, no more
    assert step(12) == lr_at(4, t)
    # a member claiming a huge count moves the schedule at most to 2 x steps + 1 (here 13 of 22)
    step(10**12)
    assert step(8) == lr_at(2 * 7 + 1, t) < lr_at(7, t)
