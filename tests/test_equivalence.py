"""The swarm computes what plain PyTorch computes: real processes, real DHT, real gRPC."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest
import torch
from helpers.calls import info

from peer.config import RunSpec
from peer.coordinator import checkpoint
from peer.coordinator.export import load_directory
from peer.data.corpus import load_corpus
from peer.model.llama import StageModel
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
# synchronous mode: two trainers each give every step of 8 samples one micro-batch of 4
SYNC_STEPS = 10
SYNC_SPEC = {**SPEC, "training": {**SPEC["training"], "sync_trainers": 2, "total_steps": SYNC_STEPS}}


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


# what compressed activations may move, measured and bounded (docs/architecture.md, "Fidelity"): (worst relative
# error of a micro-batch's loss, error of the final weights relative to what training moved them). fp16 rounds each
# hidden state and gradient to 2^-11 of itself and the loss averages that over 256 tokens (measured 5e-7, 6e-4);
# int8 rounds to 1/254 of its block's largest value (measured 1.1e-4, 0.012). Adam divides each element's gradient
# by its own running scale, so the small, noisy ones move the weights as much as the large ones: the weights'
# error is far larger than the loss's, and grows with the steps.
TOLERANCES = {"none": (1e-4, 1e-5), "fp16": (1e-5, 0.005), "int8": (1e-3, 0.05)}


@pytest.mark.parametrize(
    "activations", ["none", pytest.param("fp16", marks=pytest.mark.slow), pytest.param("int8", marks=pytest.mark.slow)]
)
def test_two_servers_a_stage_and_two_trainers_in_synchronous_mode_are_the_plain_loop_with_the_combined_batch(
    swarm, activations
):
    """Synchronous mode, 2 stages x 2 servers (averaging gradients), 2 trainers: every micro-batch's loss equals the
    plain loop's whose steps take both trainers' micro-batches (1e-4 relative), and the weights `peer export`
    writes from the coordinator's last checkpoint equal the plain loop's after the same steps (1e-5); with fp16 or
    int8 activations, within TOLERANCES."""
    root = swarm.workdir / "checkpoints"
    every = [f"coordinator.checkpoint_every_steps={SYNC_STEPS}", "coordinator.checkpoint_every_minutes=0"]
    spec = {**SYNC_SPEC, "compression": {"activations": activations}}
    sets = [arg for value in ["coordinator.report_period=0.5", *every] for arg in ("--set", value)]
    swarm.coordinator(spec, extra=["--checkpoints", str(root), *sets])
    for server in [swarm.server(f"s{stage}{r}", stage) for stage in range(2) for r in range(2)]:
        swarm.endpoint(server)
    trainers = [swarm.trainer(f"t{i}", ["--seed", str(5 + i), "--max-inflight", "2"]) for i in range(2)]
    for trainer in trainers:
        assert trainer.wait(240) == 0, trainer.output()[-3000:]
    torch.set_num_threads(1)
    final: dict[str, torch.Tensor] = {}
    keep = lambda step, loss, model: final.update(model.state_dict()) if step == SYNC_STEPS - 1 else None  # noqa: E731
    local = train_local(RunSpec.from_dict(SYNC_SPEC), load_corpus(), SYNC_STEPS, seeds=[5, 6], on_step=keep)
    assert 0 < local.clipped_steps < SYNC_STEPS * 2, local.clipped_steps  # the clip fires, not always
    loss_tolerance, weight_tolerance = TOLERANCES[activations]
    for i in range(2):  # trainer i's k-th micro-batch is the plain loop's step k's i-th
        ours = [e["loss"] for e in sorted(swarm.log(f"t{i}"), key=lambda e: e["index"]) if e["type"] == "micro_batch"]
        assert len(ours) == SYNC_STEPS  # its share of every step, and no more
        for k, (got, want) in enumerate(zip(ours, local.micro_batch_losses[i::2], strict=True)):
            assert math.isclose(got, want, rel_tol=loss_tolerance), f"trainer {i}, step {k}: swarm {got}, local {want}"
    exported = _export_last_checkpoint(root, swarm.workdir / "exported", swarm.peers[0])
    assert sorted(exported) == sorted(final)
    if activations == "none":
        for name, tensor in final.items():
            torch.testing.assert_close(exported[name], tensor, rtol=weight_tolerance, atol=weight_tolerance, msg=name)
    else:  # the error against what training moved the weights (from the seed's initial ones)
        initial = StageModel(RunSpec.from_dict(SYNC_SPEC)).state_dict()
        error = math.sqrt(sum(((exported[n] - t) ** 2).sum().item() for n, t in final.items()))
        moved = math.sqrt(sum(((t - initial[n]) ** 2).sum().item() for n, t in final.items()))
        assert error < weight_tolerance * moved, (error, moved)


def _export_last_checkpoint(root, out, coordinator) -> dict[str, torch.Tensor]:
    """The run's last checkpoint (every stage at its last step), exported and loaded back: its state dict."""
    deadline = time.monotonic() + 60
    while not any(checkpoint.read_manifest(p)["step"] >= SYNC_STEPS for p in checkpoint.complete(root)):
        assert time.monotonic() < deadline, coordinator.output()[-3000:]
        time.sleep(0.5)
    manifest = checkpoint.read_manifest(checkpoint.latest(root))
    assert {part["epoch"] for part in manifest["parts"].values()} == {SYNC_STEPS}, manifest["parts"]
    done = subprocess.run([sys.executable, "-m", "peer.cli.main", "export", str(root), str(out)], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return load_directory(out).state_dict()
