"""Model FLOPs utilisation of a stage server's torch work, against a plain matmul on the same device.

The stage: a middle stage of `--blocks` Llama-style blocks (no vocabulary), held by the very
runtime a stage server runs (peer.runtime.StageRuntime, TP=1, `server.compute_dtype`), on one
device. Each micro-batch is what the server does for a trainer: a training forward (graph kept),
then the backward into the accumulator, and every `--accumulate` micro-batches an optimizer step,
as a replica alone steps. gRPC is left out: its cost is benchmarks/transport.py's.

Model FLOPs per sample are 6 x parameters x tokens plus the causal attention, 6 x blocks x seq^2 x
hidden (peer.model.flops_per_sample's formula); MFU is those FLOPs per second over the device's
peak (`--peak-tflops`; H100/H200 SXM dense bf16: 989). In the same run, a square bf16 matmul gives
the device's reachable rate, so the stage's share of it is printed too.

The largest stage: peak memory measured at two depths gives bytes per block and the fixed rest;
the largest depth that fits the device's memory follows (`--verify` builds it and runs a step).

    python benchmarks/mfu.py --device cuda [--hidden 4096 --heads 32 --blocks 4 --seq 2048 --batch 4]
    python benchmarks/mfu.py --device cpu --hidden 256 --heads 4 --blocks 2 --seq 128 --batch 2 --dtype float32
"""

from __future__ import annotations

import argparse
import time

import torch

from peer.config import RunSpec
from peer.runtime import StageRuntime

PEAKS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense bf16 TFLOP/s of the SXM parts


def spec_for(args, blocks: int) -> RunSpec:
    return RunSpec.from_dict(
        {
            "name": "mfu",
            "model": {
                "hidden_size": args.hidden,
                "num_layers": blocks + 2,
                "num_heads": args.heads,
                "intermediate_size": args.inter or args.hidden * 8 // 3 // 256 * 256,
                "max_seq_len": args.seq,
            },
            "stages": {"num_stages": 3, "boundaries": [1, 1 + blocks]},
            "training": {"micro_batch_size": args.batch, "seq_len": args.seq},
        }
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_tflops(device: str, dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps, started = 10, time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - started) / 1e12


def run_stage(args, blocks: int, steps: int) -> tuple[float, float, int]:
    """(samples/s, model FLOPs per sample, peak bytes) of a stage of `blocks` blocks."""
    spec = spec_for(args, blocks)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    rt = StageRuntime(spec, 1, device=args.device, compute_dtype=args.dtype)
    rt.keeps_stash = not args.no_stash
    params = sum(p.numel() for p in rt.params)
    flops = 6.0 * params * args.seq + 6 * blocks * args.seq**2 * args.hidden
    x = torch.randn(args.batch, args.seq, args.hidden)
    g = torch.randn(args.batch, args.seq, args.hidden) * 1e-3

    def micro_batch(uid: str) -> None:
        rt.forward(uid, x, None, True)
        rt.backward(uid, x, g, None)
        if rt.samples_accumulated >= args.accumulate * args.batch:
            grads, samples = rt.take_gradients()
            rt.apply_step(grads, samples, rt.taken_seq)

    for i in range(args.accumulate):  # warm up, one optimizer step included
        micro_batch(f"w{i}")
    sync(args.device)
    started = time.perf_counter()
    for i in range(steps):
        micro_batch(f"m{i}")
    sync(args.device)
    rate = steps * args.batch / (time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else 0
    return rate, flops, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", help="server.compute_dtype: bfloat16, float16 or float32")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--inter", type=int, default=0, help="MLP width (default: 8/3 hidden, a multiple of 256)")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="device peak (default: by GPU name)")
    p.add_argument("--no-stash", action="store_true", help="drop weight stashing (one copy of the weights less)")
    p.add_argument("--largest", action="store_true", help="also estimate the deepest stage that fits (GPU)")
    p.add_argument("--verify", action="store_true", help="with --largest: build that stage and run it")
    args = p.parse_args()
    if args.device == "cuda":
        args.device = "cuda:0"
    cuda = args.device.startswith("cuda")
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAKS.items() if k in name), 0.0)
    dtype = getattr(torch, args.dtype)
    reachable = matmul_tflops(args.device, dtype, 8192 if cuda else 1024)

    rate, flops, mem = run_stage(args, args.blocks, args.steps)
    achieved = rate * flops / 1e12
    mfu = achieved / peak if peak else float("nan")
    line = (
        f"device={name.replace(' ', '_')} dtype={args.dtype} blocks={args.blocks} hidden={args.hidden} "
        f"seq={args.seq} batch={args.batch} samples_per_s={rate:.3f} tflops={achieved:.2f} "
        f"matmul_tflops={reachable:.2f} of_matmul={achieved / reachable:.3f} mfu={mfu:.3f} "
        f"peak_mem_gib={mem / 2**30:.2f}"
    )
    if args.largest and cuda:
        small = max(1, args.blocks // 2)
        _, _, mem_small = run_stage(args, small, 1)
        per_block = (mem - mem_small) / (args.blocks - small)
        fixed = mem - per_block * args.blocks
        total = torch.cuda.get_device_properties(0).total_memory * 0.95
        deepest = int((total - fixed) // per_block)
        params_per_block = sum(p.numel() for p in StageRuntime(spec_for(args, 1), 1).params)
        line += f" gib_per_block={per_block / 2**30:.2f} largest_blocks={deepest}"
        line += f" largest_params_b={deepest * params_per_block / 1e9:.2f}"
        if args.verify:
            try:
                run_stage(args, deepest, 1)
                line += " verified=1"
            except torch.cuda.OutOfMemoryError:
                line += " verified=0"
    print(line)


if __name__ == "__main__":
    main()
