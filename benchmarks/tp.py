"""A stage split over tensor-parallel ranks against the same stage whole, same machine, same total threads.

Whole: the stage's runtime in this process with `--tp` torch threads. Split: the same stage over
`--tp` ranks as `peer join --tp` runs it (rank 0 here, ranks 1.. as `peer.model.rank` processes; gloo on
CPU, NCCL with `--device cuda`), one thread each. Both serve the stage server's own sequence per
micro-batch (a training forward, then its backward into the accumulator), then the take of the
full gradients a round averages. Reported: samples/s of each, parameter bytes per rank, the
all-reduce bytes per sample, and the time to gather the full gradients. Last line `key=value ...`.

    python benchmarks/tp.py [--tp 2] [--hidden 512] [--layers 4] [--seq 128] [--batch 4] [--device cpu] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import Figures, add_quick, run  # noqa: E402
from peer.config import ParallelConfig, RunSpec  # noqa: E402
from peer.model.runtime import StageRuntime  # noqa: E402
from peer.model.tp import TPGroup  # noqa: E402
from peer.model.tp_runtime import Ranks, ShardedStageRuntime  # noqa: E402

# the sizes of a run, and of a --quick one; a flag given on the command line overrides both
FULL = {"hidden": 512, "heads": 8, "layers": 4, "seq": 128, "batch": 4, "steps": 10}
QUICK = {"hidden": 256, "heads": 4, "layers": 2, "seq": 64, "batch": 2, "steps": 3}


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


def body(args: argparse.Namespace, figures: Figures) -> None:
    for key, full in FULL.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else full)
    spec = spec_for(args)
    cuda = args.device == "cuda"

    torch.set_num_threads(args.tp)
    whole = StageRuntime(spec, 1, device="cuda:0" if cuda else "cpu")
    whole_rate, whole_take = serve(whole, args, args.steps)
    whole_mb = sum(p.numel() * 4 for p in whole.params) / 2**20
    del whole
    figures.update(tp=args.tp, whole_sps=whole_rate, whole_params_mb=whole_mb, whole_take_ms=whole_take)

    torch.set_num_threads(1)
    devices = [f"cuda:{i}" for i in range(args.tp)] if cuda else ["cpu"] * args.tp
    pcfg = ParallelConfig(tp=args.tp, devices=devices)
    settings = {"activation_cache_size": 32, "fingerprint_history": 8, "dedup_history": 64, "compute_dtype": "float32"}
    ranks = Ranks(pcfg, {**settings, "spec": spec.to_dict(), "stage": 1, "threads": 1})
    try:  # start_group starts the rank processes, and a failure there leaves some running
        split = ShardedStageRuntime(spec, 1, TPGroup(0, args.tp, torch.device(devices[0])), ranks, devices, **settings)
        ranks.start_group(split.tp, 120.0)
        split_rate, split_take = serve(split, args, args.steps)
        rank_mb = sum(p.numel() * 4 for p in split.params) / 2**20
    finally:
        ranks.close()
    # per block: one all-reduce of [seq, hidden] float32 after attention and after the MLP, forward and backward
    allreduce_mb = args.layers * 4 * args.seq * args.hidden * 4 / 2**20
    figures.update(
        split_sps=split_rate,
        ratio=split_rate / whole_rate,
        rank_params_mb=rank_mb,
        allreduce_mb_per_sample=allreduce_mb,
        split_gather_ms=split_take,
    )
    print(
        f"stage of {args.layers} blocks, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, on {args.device}: "
        f"whole {whole_rate:.2f} samples/s ({args.tp} threads), split over {args.tp} ranks {split_rate:.2f} samples/s "
        f"(1 thread each); parameters {whole_mb:.1f} MiB whole, {rank_mb:.1f} MiB per rank"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    def sized(name: str, what: str) -> None:
        key = name.lstrip("-")
        p.add_argument(name, type=int, help=f"{what} (default {FULL[key]}; quick {QUICK[key]})")

    p.add_argument("--tp", type=int, default=2)
    sized("--hidden", "model width")
    sized("--heads", "attention heads")
    sized("--layers", "blocks of the stage")
    sized("--seq", "tokens per sample")
    sized("--batch", "samples per micro-batch")
    sized("--steps", "timed micro-batches on each side")
    p.add_argument("--device", default="cpu", help="cpu (gloo), or cuda (NCCL: ranks on cuda:0..tp-1)")
    add_quick(p, "a stage of 2 blocks x hidden 256, seq 64, batch 2, 3 timed micro-batches")
    run(p, body)


if __name__ == "__main__":
    main()
