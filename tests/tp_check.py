"""Rank 0 of a tensor-parallel stage, against the same stage unsplit: prints the largest differences as JSON.

Run by tests/test_tp.py as `python tests/tp_check.py STAGE WORLD`: it starts ranks 1.. the way
`peer join --tp` does (peer.model.rank processes, gloo), drives the split stage through its public
operations, and compares outputs, input gradients, parameter gradients (gathered to full), the
optimizer step, a state handed to an unsplit replica, and (stage 0) the gradients of a clipped backward.
"""

from __future__ import annotations

import json
import sys

import torch

from peer.config import ParallelConfig, RunSpec
from peer.model.runtime import StageRuntime
from peer.model.tp import TPGroup
from peer.model.tp_runtime import Ranks, ShardedStageRuntime

SPEC = {
    "name": "tp",
    "seed": 7,
    # grouped-query heads, biases and per-head q/k norms (Qwen3's layout): every kind of shard
    "model": {
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "qkv_bias": True,
        "o_bias": True,
        "qk_norm": True,
        "intermediate_size": 96,
        "max_seq_len": 32,
    },
    "stages": {"num_stages": 2},
    "training": {"micro_batch_size": 3, "seq_len": 16, "target_batch_size": 6, "lr": 0.01, "warmup_steps": 0},
}


def biggest(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def main() -> None:
    stage, world = int(sys.argv[1]), int(sys.argv[2])
    local = len(sys.argv) > 3 and sys.argv[3] == "local"  # DiLoCo: inner steps, then pseudo-gradients
    torch.set_num_threads(1)
    averaging = {"mode": "local", "inner_steps": 2, "inner_batch_size": 6} if local else {}
    spec = RunSpec.from_dict({**SPEC, "averaging": averaging})
    sizes = {"activation_cache_size": 4, "fingerprint_history": 8, "dedup_history": 16, "compute_dtype": "float32"}
    ranks = Ranks(ParallelConfig(tp=world), {**sizes, "spec": spec.to_dict(), "stage": stage, "threads": 1})
    split = ShardedStageRuntime(spec, stage, TPGroup(0, world, torch.device("cpu")), ranks, **sizes)
    ranks.start_group(split.tp, 60.0)
    whole = StageRuntime(spec, stage, **sizes)
    gen = torch.Generator().manual_seed(1)
    b, t, h, v = 3, 16, 64, spec.model.vocab_size
    inputs = torch.randint(0, v, (b, t), generator=gen) if stage == 0 else torch.randn(b, t, h, generator=gen)
    targets = torch.randint(0, v, (b, t), generator=gen) if stage == 1 else None
    grad_out = torch.randn(b, t, h, generator=gen) if stage == 0 else None
    report = {"init": biggest(split.full_parameters(), whole.full_parameters())}
    # outputs: hidden states (stage 0), logits (stage 1, gathered over the vocab) and the loss
    report["forward"] = biggest([split.forward("f", inputs, None, False)], [whole.forward("f", inputs, None, False)])
    if stage == 1:
        report["loss"] = abs(
            float(split.forward("l", inputs, targets, False)) - float(whole.forward("l", inputs, targets, False))
        )
    for rt in (split, whole):
        rt.forward("u", inputs, None, True)  # a cached graph (stage 0), then its backward
    gi_split, loss_split, _ = split.backward("u", inputs, grad_out, targets)
    gi_whole, loss_whole, _ = whole.backward("u", inputs, grad_out, targets)
    split.backward("r", inputs, grad_out, targets)  # a recomputed backward (no cached forward)
    whole.backward("r", inputs, grad_out, targets)
    if stage == 1:
        report["input_grad"] = biggest([gi_split], [gi_whole])
        report["backward_loss"] = abs(loss_split - loss_whole)
    if local:
        split.inner_step()
        whole.inner_step()
        report["after_inner"] = biggest(split.full_parameters(), whole.full_parameters())
    grads_split, n_split = split.take_for_round()
    grads_whole, n_whole = whole.take_for_round()
    assert n_split == n_whole == 2 * b
    report["param_grad"] = biggest(grads_split, grads_whole)
    report["grad_scale"] = max(float(g.abs().max()) for g in grads_whole)
    for rt in (split, whole):
        rt.apply_round([g * 0.5 for g in grads_whole], 2 * b, rt.taken_seq, [])
    report["after_step"] = biggest(split.full_parameters(), whole.full_parameters())
    report["fingerprint"] = max(
        abs(x - y) / max(1.0, abs(y)) for x, y in zip(split.history[-1].values, whole.history[-1].values, strict=True)
    )
    # a state split over the ranks, loaded by an unsplit replica, and back
    metadata, tensors = split.snapshot()
    joiner = StageRuntime(spec, stage, **sizes)
    joiner.load_state(metadata, tensors)
    report["state_to_whole"] = biggest(joiner.full_parameters(), whole.full_parameters())
    report["state_keys_equal"] = sorted(tensors) == sorted(whole.snapshot()[1])
    parts = [split.snapshot(i, 3)[1] for i in range(3)]
    report["shards_cover"] = sorted(k for part in parts for k in part) == sorted(tensors)
    split.load_state(*whole.snapshot())
    report["state_from_whole"] = biggest(split.full_parameters(), whole.full_parameters())
    if stage == 0 and not local:
        report.update(clipped_step(split, whole, inputs, grad_out))
    ranks.close()
    print(json.dumps(report))


def clipped_step(split, whole, inputs, grad_out) -> dict:
    """8 backwards fill the running median of gradient norms, then one 1000x as large is clipped: the ranks
    must clip by the whole stage's norm, all alike, as the unsplit stage does."""
    for rt in (split, whole):
        rt.drop_accumulator()
        for i in range(8):
            rt.backward(f"c{i}", inputs, grad_out * (1 + i / 8), None)
        rt.backward("big", inputs, grad_out * 1000, None)
    grads_split, _ = split.take_for_round()
    grads_whole, _ = whole.take_for_round()
    scale = max(float(g.abs().max()) for g in grads_whole)
    return {"clipped": [split.clipped, whole.clipped], "clipped_grad": biggest(grads_split, grads_whole) / scale}


if __name__ == "__main__":
    main()
