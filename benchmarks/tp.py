"""A stage split over tensor-parallel ranks against the same stage whole, same machine, same total threads.

Whole: the stage's runtime in this process with `--tp` torch threads. Split: the same stage over
`--tp` ranks as `peer join --tp` runs it (rank 0 here, ranks 1.. as `peer.rank` processes; gloo on
CPU, NCCL with `--device cuda`), one thread each. Both serve the stage server's own sequence per
micro-batch (a training forward, then its backward into the accumulator), then the take of the
full gradients a round averages. Reported: samples/s of each, parameter bytes per rank, the
all-reduce bytes per sample, and the time to gather the full gradients. Last line `key=value ...`.

    python benchmarks/tp.py [--tp 2] [--hidden 512] [--layers 4] [--seq 128] [--batch 4] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch

from peer.config import ParallelConfig, RunSpec
from peer.runtime import StageRuntime
from peer.tp import TPGroup
from peer.tp_runtime import Ranks, ShardedStageRuntime


def spec_for(args) -> RunSpec:
    return RunSpec.from_dict(
        {
            "name": "tp-bench",
            "model": {
                "hidden_size": args.hidden,
                "num_layers": args.layers + 2,
                "num_heads": args.heads,
                "intermediate_size": args.hidden * 11 // 4 // args.tp * args.tp,
                "max_seq_len": args.seq,
            },
            # three stages: stage 1 is a middle stage of `layers` blocks (no vocabulary)
            "stages": {"num_stages": 3, "boundaries": [1, 1 + args.layers]},
            "training": {"micro_batch_size": args.batch, "seq_len": args.seq},
        }
    )


def serve(rt: StageRuntime, args, steps: int) -> tuple[float, float]:
    """(samples/s of forward+backward as a stage server runs them, ms to take the full gradients)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=gen)
    g = torch.randn(args.batch, args.seq, args.hidden, generator=gen) * 1e-3
    for i in range(2):  # warm up
        rt.forward(f"w{i}", x, None, True)
        rt.backward(f"w{i}", x, g, None)
    started = time.perf_counter()
    for i in range(steps):
        rt.forward(f"m{i}", x, None, True)
        rt.backward(f"m{i}", x, g, None)
    rate = steps * args.batch / (time.perf_counter() - started)
    started = time.perf_counter()
    rt.take_for_round()
    return rate, (time.perf_counter() - started) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cpu", help="cpu (gloo), or cuda (NCCL: ranks on cuda:0..tp-1)")
    args = p.parse_args()
    spec = spec_for(args)
    cuda = args.device == "cuda"

    torch.set_num_threads(args.tp)
    whole = StageRuntime(spec, 1, device="cuda:0" if cuda else "cpu")
    whole_rate, whole_take = serve(whole, args, args.steps)
    whole_mb = sum(p.numel() * 4 for p in whole.params) / 2**20
    del whole

    torch.set_num_threads(1)
    devices = [f"cuda:{i}" for i in range(args.tp)] if cuda else ["cpu"] * args.tp
    pcfg = ParallelConfig(tp=args.tp, devices=devices)
    settings = {"activation_cache_size": 32, "fingerprint_history": 8, "dedup_history": 64, "compute_dtype": "float32"}
    ranks = Ranks(pcfg, {**settings, "spec": spec.to_dict(), "stage": 1, "threads": 1})
    split = ShardedStageRuntime(spec, 1, TPGroup(0, args.tp, torch.device(devices[0])), ranks, devices, **settings)
    ranks.start_group(split.tp, 120.0)
    try:
        split_rate, split_take = serve(split, args, args.steps)
        rank_mb = sum(p.numel() * 4 for p in split.params) / 2**20
    finally:
        ranks.close()
    # per block: one all-reduce of [seq, hidden] float32 after attention and after the MLP, forward and backward
    allreduce_mb = args.layers * 4 * args.seq * args.hidden * 4 / 2**20
    print(
        f"stage of {args.layers} blocks, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, on {args.device}: "
        f"whole {whole_rate:.2f} samples/s ({args.tp} threads), split over {args.tp} ranks {split_rate:.2f} samples/s "
        f"(1 thread each); parameters {whole_mb:.1f} MiB whole, {rank_mb:.1f} MiB per rank"
    )
    print(
        f"tp={args.tp} whole_sps={whole_rate:.3f} split_sps={split_rate:.3f} ratio={split_rate / whole_rate:.3f} "
        f"whole_params_mb={whole_mb:.2f} rank_params_mb={rank_mb:.2f} allreduce_mb_per_sample={allreduce_mb:.2f} "
        f"whole_take_ms={whole_take:.1f} split_gather_ms={split_take:.1f}"
    )


if __name__ == "__main__":
    main()
