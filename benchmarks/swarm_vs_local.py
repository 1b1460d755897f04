"""Swarm samples/s over loopback against the plain single-process loop, same machine, same total threads.

The swarm: a coordinator, one server per stage (one torch thread each) and one trainer, as separate
processes on loopback, training the demo model with `peer join`, twice: with the demo's spec (its
`averaging.drain_limit` of 1 s: a step waits for the backwards of the forwards it ran, so every gradient counts
in its own step, as in the plain loop, and the pipeline empties at every step), and with the run spec's default
drain of 0 (the gradients of micro-batches in flight at a step count in the next one). The local loop: the same
model, optimizer and batch in one process with as many torch threads as the swarm's servers together, before and
after the swarms (it drifts between runs; their mean counts). All in this one invocation; the last line has
`ratio` (demo spec) and `ratio_async` (no drain) over `local_sps`, and where each swarm's CPU went over its timed
window (`swarm_cores`; `control_share`: the processes that do no training work, hivemind's DHT processes, p2p
daemons, reapers and the coordinator, over all; goal <= 0.05).

    python benchmarks/swarm_vs_local.py [--steps 30] [--inflight 3] [--target-batch N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cputime import count_lines, kind_seconds  # noqa: E402
from benchmarks.report import Figures, add_quick, run  # noqa: E402
from peer.cli.demo import DEMO_SPEC, SERVING, Processes, loopback_join, spec_to_toml  # noqa: E402
from peer.config import RunSpec  # noqa: E402
from peer.data.corpus import load_corpus  # noqa: E402
from peer.trainer.local import train_local  # noqa: E402


def local_rate(spec: RunSpec, steps: int, threads: int) -> float:
    torch.set_num_threads(threads)
    corpus = load_corpus()
    train_local(spec, corpus, 2)  # warm up
    result = train_local(spec, corpus, steps)
    return result.samples / result.seconds


def swarm_rate(spec: RunSpec, steps: int, inflight: int, workdir: Path) -> tuple[float, dict]:
    (workdir / "run.toml").write_text(spec_to_toml(spec))
    procs = Processes(workdir)
    try:
        info = workdir / "coordinator.json"
        procs.start(
            "coordinator",
            ["coordinator", "run.toml", "--identity", "c.pem", "--host", "127.0.0.1", "--info-file", str(info)],
        )
        procs.wait_until(lambda: info.exists(), 60, "benchmark: the coordinator's start")
        maddr = json.loads(info.read_text())["join"].split()[-1]
        n = spec.stages.num_stages
        for stage in range(n):
            procs.start(f"s{stage}", loopback_join(maddr, f"s{stage}", "--stage", str(stage)))
        procs.wait_until(lambda: all(SERVING.search(procs.log(f"s{s}")) for s in range(n)), 120, "benchmark: serving")
        print(f"swarm: {n} servers serving; timing the trainer", flush=True)
        per_step = spec.training.target_batch_size // spec.training.micro_batch_size
        trainer_args = ["--role", "trainer", "--seed", "0", "--max-inflight", str(inflight), "--log-file", "t.jsonl"]
        limit = ["--max-micro-batches", str((steps + 2) * per_step)]
        trainer = procs.start("t", loopback_join(maddr, "t", *trainer_args, *limit))
        skip = 2 * per_step  # the first steps include connection set-up
        roots = {name: proc.pid for name, (proc, _) in procs.procs.items()}
        cpu = cpu_over_window(trainer, workdir / "t.jsonl", (skip, (steps + 2) * per_step), roots)
        if trainer.returncode != 0:
            raise RuntimeError(f"the trainer failed:\n{procs.log('t')[-2000:]}")
        entries = [json.loads(line) for line in (workdir / "t.jsonl").read_text().splitlines()]
        batches = [e for e in entries if e["type"] == "micro_batch"]
        timed = batches[skip:]
        seconds = timed[-1]["time"] - batches[skip - 1]["time"]
        return sum(e["samples"] for e in timed) / seconds, {
            "micro_batches": len(batches),
            "last_loss": batches[-1]["loss"],
            **cpu,
        }
    finally:
        procs.stop()


def cpu_over_window(trainer, log: Path, window: tuple[int, int], roots: dict[str, int]) -> dict:
    """Where the swarm's CPU goes while the trainer logs its micro-batches `window` (first, last: its timed ones), from
    /proc: cores by peer and kind of process (cputime.process_times), and the control plane's share: every process
    that does no training work (hivemind's DHT processes, the p2p daemons, the reapers, the whole coordinator), over
    the swarm's CPU. The peers' own control work (progress loops, pushes, DHT calls) runs inside their main
    processes and is counted with the training there."""

    def logged(count: int) -> None:
        deadline = time.monotonic() + 600
        while count_lines(log, b'"micro_batch"') < count and trainer.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"benchmark: the trainer did not log {count} micro-batches")
            time.sleep(0.05)

    logged(window[0])
    before, started = kind_seconds(roots), time.monotonic()
    logged(window[1])  # the last: read before the trainer's processes exit
    after, wall = kind_seconds(roots), time.monotonic() - started
    trainer.wait(600)
    cores = {
        (name, kind): (seconds - before.get(name, {}).get(kind, 0.0)) / wall
        for name, kinds in after.items()
        for kind, seconds in kinds.items()
    }
    total = sum(cores.values())
    control = sum(c for (name, kind), c in cores.items() if name == "coordinator" or kind != "peer")
    print(
        "cores over the timed window, by peer and process: "
        + ", ".join(f"{n} {k} {c:.3f}" for (n, k), c in sorted(cores.items()))
    )
    return {
        "swarm_cores": round(total, 3),
        "control_cores": round(control, 4),
        "control_share": round(control / total, 4) if total else float("nan"),
        "trainer_cores": round(cores.get(("t", "peer"), 0.0), 3),
    }


def body(args: argparse.Namespace, figures: Figures) -> None:
    steps = args.steps or (4 if args.quick else 30)
    spec = RunSpec.from_toml(DEMO_SPEC)
    spec.training.total_steps = 10_000  # the trainer stops on --max-micro-batches, not on the schedule
    if args.target_batch:
        spec.training.target_batch_size = args.target_batch
    threads = spec.stages.num_stages  # one per server
    figures.update(threads=threads, steps=steps, step_samples=spec.training.target_batch_size)
    print(
        f"model: {spec.model.num_layers} blocks x {spec.model.hidden_size}, {spec.stages.num_stages} stages, "
        f"micro-batch {spec.training.micro_batch_size}x{spec.training.seq_len}, step {spec.training.target_batch_size} samples"
    )
    before = local_rate(spec, steps, threads)  # before and after the swarms: the local loop drifts between runs
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    # the demo's spec (averaging.drain_limit 1 s: a step waits for the backwards of the forwards it ran, so every
    # gradient counts in its own step, as in the plain loop), then the run spec's default (no wait: those in flight
    # at a step count in the next one)
    drained = spec.averaging.drain_limit
    for name, drain in (("", drained), ("_async", 0.0)):
        spec.averaging.drain_limit = drain
        with tempfile.TemporaryDirectory(prefix="swarmtrain-bench-", dir=args.workdir or None) as tmp:
            swarm, details = swarm_rate(spec, steps, args.inflight, Path(tmp))
        print(
            f"swarm, drain_limit {drain:g} s, {threads} servers x 1 thread + trainer (inflight {args.inflight}): "
            f"{swarm:.1f} samples/s {details}"
        )
        figures[f"swarm{name}_sps"] = swarm
        for key in ("swarm_cores", "control_share"):
            figures[f"{key}{name}"] = details[key]
    spec.averaging.drain_limit = drained
    after = local_rate(spec, steps, threads)
    local = (before + after) / 2
    print(f"local loop, {threads} torch threads: {before:.1f} then {after:.1f} samples/s")
    figures.update(local_sps=local, local_spread=abs(after - before) / local)
    figures["ratio"] = figures["swarm_sps"] / local
    figures["ratio_async"] = figures["swarm_async_sps"] / local


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps timed on each side (default 30; quick 4)")
    parser.add_argument("--inflight", type=int, default=3, help="micro-batches the trainer keeps in the pipeline")
    parser.add_argument(
        "--target-batch", type=int, default=0, help="samples a step (default: the demo's, 48: 3 micro-batches)"
    )
    parser.add_argument("--workdir", default="", help="where the swarm's temporary directory goes (default: TMPDIR)")
    add_quick(parser, "4 timed optimizer steps on each side instead of 30")
    run(parser, body)


if __name__ == "__main__":
    main()
