"""Model FLOPs utilisation of a stage server's torch work, against a plain matmul on the same device.

The stage: a middle stage of `--blocks` Llama-style blocks (no vocabulary), held by the very
runtime a stage server runs (peer.model.runtime.StageRuntime, TP=1, `server.compute_dtype`), on one
device. Each micro-batch is what the server does for a trainer: a training forward (graph kept),
then the backward into the accumulator, and every `--accumulate` micro-batches an optimizer step,
as a replica alone steps. gRPC is left out: its cost is benchmarks/transport.py's.

Model FLOPs per sample are 6 x parameters x tokens plus the causal attention, 6 x blocks x seq^2 x
hidden (peer.model.llama.flops_per_sample's formula); MFU is those FLOPs per second over the device's
peak (`--peak-tflops`; H100/H200 SXM dense bf16: 989). In the same run, a square bf16 matmul gives
the device's reachable rate, so the stage's share of it is printed too.

The largest stage: peak memory measured at two depths gives bytes per block and the fixed rest;
the largest depth that fits the device's memory follows (`--verify` builds it and runs a step).

Without a GPU it measures on the CPU, with CPU-sized defaults (float32; MFU needs `--peak-tflops`).

    python benchmarks/mfu.py --device cuda [--hidden 4096 --heads 32 --blocks 4 --seq 2048 --batch 4]
    python benchmarks/mfu.py --device cpu [--hidden 1024 --heads 16 --blocks 2 --seq 512 --batch 2] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import Figures, add_quick, run  # noqa: E402
from peer.config import RunSpec  # noqa: E402
from peer.model.runtime import StageRuntime  # noqa: E402

PEAKS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense bf16 TFLOP/s of the SXM parts
# sizes by device, full and --quick; a flag given on the command line overrides them
SIZES = {
    ("cuda", False): dict(hidden=4096, heads=32, blocks=4, seq=2048, batch=4, steps=8, accumulate=4, dtype="bfloat16"),
    ("cuda", True): dict(hidden=1024, heads=8, blocks=2, seq=512, batch=2, steps=4, accumulate=2, dtype="bfloat16"),
    # a CPU does a GPU-sized stage in hours, and bf16 matmuls on it are slow
    ("cpu", False): dict(hidden=1024, heads=16, blocks=2, seq=512, batch=2, steps=4, accumulate=2, dtype="float32"),
    ("cpu", True): dict(hidden=256, heads=4, blocks=2, seq=128, batch=2, steps=2, accumulate=2, dtype="float32"),
}


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


def largest(args, mem: int, figures: Figures) -> None:
    """The deepest stage that fits the GPU, from the peak memory of this depth and of another one."""
    other = args.blocks // 2 if args.blocks > 1 else 2  # one block: measure two
    _, _, mem_other = run_stage(args, other, 1)
    per_block = (mem - mem_other) / (args.blocks - other)
    fixed = mem - per_block * args.blocks
    total = torch.cuda.get_device_properties(0).total_memory * 0.95
    deepest = int((total - fixed) // per_block)
    params_per_block = sum(p.numel() for p in StageRuntime(spec_for(args, 1), 1).params)
    figures.update(
        gib_per_block=per_block / 2**30,
        largest_blocks=deepest,
        largest_params_b=deepest * params_per_block / 1e9,
    )
    print(
        f"largest stage that fits: {deepest} blocks ({per_block / 2**30:.2f} GiB each, {fixed / 2**30:.2f} GiB fixed)"
    )
    if args.verify:
        try:
            run_stage(args, deepest, 1)
            figures["verified"] = 1
        except torch.cuda.OutOfMemoryError:
            figures["verified"] = 0


def body(args: argparse.Namespace, figures: Figures) -> None:
    if args.device == "cuda":
        args.device = "cuda:0"
    cuda = args.device.startswith("cuda")
    for key, value in SIZES[("cuda" if cuda else "cpu", args.quick)].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    if not cuda:
        print(f"on the CPU ({torch.get_num_threads()} threads), not a GPU: CPU-sized stage unless flags say otherwise")
    peak = args.peak_tflops or next((v for k, v in PEAKS.items() if k in name), 0.0)
    dtype = getattr(torch, args.dtype)
    figures.update(
        device=name, dtype=args.dtype, blocks=args.blocks, hidden=args.hidden, seq=args.seq, batch=args.batch
    )
    side = 8192 if cuda else 1024
    reachable = matmul_tflops(args.device, dtype, side)
    figures["matmul_tflops"] = reachable

    rate, flops, mem = run_stage(args, args.blocks, args.steps)
    achieved = rate * flops / 1e12
    mfu = achieved / peak if peak else float("nan")
    print(
        f"stage of {args.blocks} blocks x hidden {args.hidden}, seq {args.seq}, batch {args.batch}, {args.dtype} on "
        f"{name}: {rate:.3f} samples/s, {achieved:.2f} TFLOP/s, {achieved / reachable:.1%} of a {side}^2 matmul's "
        f"{reachable:.2f}; MFU {mfu:.3f} of peak {peak or 'unknown'}; peak memory {mem / 2**30:.2f} GiB"
    )
    figures.update(
        samples_per_s=rate, tflops=achieved, of_matmul=achieved / reachable, mfu=mfu, peak_mem_gib=mem / 2**30
    )
    if args.largest and cuda:
        largest(args, mem, figures)
    elif args.largest:
        print("--largest: skipped, it sizes a stage to a GPU's memory")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    def sized(name: str, what: str, kind=int) -> None:
        key = name.lstrip("-")
        gpu, cpu = SIZES[("cuda", False)][key], SIZES[("cpu", False)][key]
        quick = f"{SIZES[('cuda', True)][key]}, {SIZES[('cpu', True)][key]}"
        p.add_argument(name, type=kind, help=f"{what} (default {gpu} on a GPU, {cpu} on the CPU; quick {quick})")

    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    sized("--dtype", "server.compute_dtype: bfloat16, float16 or float32", str)
    sized("--hidden", "model width")
    sized("--heads", "attention heads")
    p.add_argument("--inter", type=int, default=0, help="MLP width (default: 8/3 hidden, a multiple of 256)")
    sized("--blocks", "blocks of the stage")
    sized("--seq", "tokens per sample")
    sized("--batch", "samples per micro-batch")
    sized("--steps", "timed micro-batches")
    sized("--accumulate", "micro-batches per optimizer step")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="device peak (default: by GPU name)")
    p.add_argument("--no-stash", action="store_true", help="drop weight stashing (one copy of the weights less)")
    p.add_argument("--largest", action="store_true", help="also estimate the deepest stage that fits (GPU)")
    p.add_argument("--verify", action="store_true", help="with --largest: build that stage and run it")
    add_quick(p, "a stage of 2 small blocks (hidden 1024 on a GPU, 256 on the CPU), a few micro-batches")
    run(p, body)


if __name__ == "__main__":
    main()
