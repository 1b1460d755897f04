"""DiLoCo (local updates) against per-step gradient averaging, at equal samples: averaging bytes and loss.

What is measured: the bytes the stage servers spend on averaging per trained sample, and the validation
loss after the same number of samples, for two runs of the same swarm:

(a) `averaging.mode = "gradients"`, compression none: the replicas average their gradients at every
    global step (target_batch_size samples), as a run does by default;
(b) `averaging.mode = "local"` (DiLoCo): each replica takes an inner AdamW step every
    target_batch_size / 2 samples of its own, and every `--inner-steps` (H) inner steps the replicas
    average their pseudo-gradients, compressed to int4 (error feedback carries each round's rounding
    into the next), and take an outer Nesterov step.

How: in the WAN lab (benchmarks/lab.py, needs root) a coordinator, 2 stage servers and 2 trainers run,
each in its own network namespace capped at `--rate` Mbit/s both ways (or uncapped, `--no-cap`). The
model is the demo's (hidden 192, 4 layers) in one stage, so both servers hold the whole model and
what reaches them from the trainers is only token ids and losses. Each trainer does
`--micro-batches`/2 micro-batches of 16 with its own seed; trainer 0 validates once at the end (on
`--eval-batches` held-out micro-batches; same data order and seeds in both runs). Averaging bytes =
the servers' interface bytes (tx + rx, both servers) minus the trainers' (what the trainers exchange
with the servers, plus their small DHT traffic), between the trainers' start and their exit, over
the samples trained. Both include DHT chatter (signed records every few seconds, each stored on
every node of this small swarm), so the local mode's figure is an upper bound of its averaging
traffic; there the servers announce about once per `network.announce_period`. Outer steps are counted from the servers' logs
("stage 0 step K: ... averaged with 1 peer(s)").

    sudo .venv/bin/python benchmarks/diloco.py [--micro-batches 256] [--inner-steps 32] [--rate 100] [--quick]

Last line: key=value pairs: each run's figures as it ends (val_gradients, steps_gradients,
samples_gradients, wall_gradients in s; val_local, outer_steps (local mode's averaged rounds),
samples_local, wall_local), then val_ratio (local / gradients; goal <= 1.03), bytes_ratio
(gradient mode's averaging bytes per sample over local mode's; goal >= 100) and status
(benchmarks/report.py). `--quick`: 32 micro-batches a run, H=2 (the bytes ratio then says little).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.lab import Lab, LabError, open_benchmark  # noqa: E402
from benchmarks.rehearsal import join_args, start_peer, wait_for  # noqa: E402
from benchmarks.report import Figures, add_quick, add_workdir, run, workdir  # noqa: E402
from peer.cli.demo import SERVING, spec_to_toml  # noqa: E402
from peer.config import RunSpec  # noqa: E402

MICRO_BATCH = 16
TARGET_BATCH = 64
STEP_RE = re.compile(r"stage 0 step (\d+): (\d+) samples, averaged with (\d+) peer\(s\)")
SERVERS, TRAINERS = ("server0", "server1"), ("trainer0", "trainer1")
# s the peers have to leave before the lab kills them: enough for a round in flight as the trainers end (its step
# is counted from the servers' logs), not for a server's whole leave (10 s), as nothing is measured then
STOP_GRACE = 3.0
QUICK = {"micro_batches": 32, "inner_steps": 2, "eval_batches": 2, "timeout": 120.0, "start_timeout": 90.0}


def make_spec(mode: str, args: argparse.Namespace) -> RunSpec:
    """The demo model in one stage; `mode` is gradients (baseline) or local (DiLoCo, int4 pseudo-gradients)."""
    steps = max(1, args.micro_batches * MICRO_BATCH // TARGET_BATCH)
    data = {
        "name": f"diloco-{mode}",
        "seed": 0,
        "model": {"hidden_size": 192, "num_layers": 4, "num_heads": 6, "intermediate_size": 512, "max_seq_len": 128},
        "stages": {"num_stages": 1},
        "admission": {"mode": "open"},  # its own peers, started without invite codes
        "training": {
            "micro_batch_size": MICRO_BATCH,
            "seq_len": 128,
            "target_batch_size": TARGET_BATCH,
            "total_steps": steps,  # gradient mode: global steps; local mode: each replica's inner steps
            "lr": 0.008,
            "warmup_steps": 10,
        },
        "averaging": {"averaging_timeout": 60.0},
    }
    if mode == "local":
        data["averaging"].update(mode="local", inner_steps=args.inner_steps, inner_batch_size=TARGET_BATCH // 2)
        data["compression"] = {"averaging": "int4"}
    return RunSpec.from_dict(data)


def peer_log(work: Path, name: str) -> str:
    with contextlib.suppress(OSError):
        return (work / name / "peer.log").read_text(errors="replace")
    return ""


def entries(work: Path, name: str) -> list[dict]:
    """The JSON lines of a trainer's log."""
    out = []
    with contextlib.suppress(OSError):
        for line in (work / name / "trainer.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def train(mode: str, args: argparse.Namespace, work: Path) -> dict:
    """One swarm in a fresh lab, trained on `--micro-batches` micro-batches; its traffic, samples and val loss."""
    spec = make_spec(mode, args)
    work.mkdir(parents=True, exist_ok=True)
    for stale in (work / "coordinator.json", *(work / n / "trainer.jsonl" for n in TRAINERS)):  # a reused workdir
        stale.unlink(missing_ok=True)
    (work / "run.toml").write_text(spec_to_toml(spec))
    rate = None if args.no_cap else args.rate
    procs: dict[str, subprocess.Popen] = {}
    with Lab() as lab:
        hosts = {name: lab.add_host(name, rate) for name in ("coordinator", *SERVERS, *TRAINERS)}
        try:
            coord, info = hosts["coordinator"], work / "coordinator.json"
            argv = ["coordinator", str(work / "run.toml"), "--identity", "coordinator.pem", "--host", coord.ip]
            procs["coordinator"] = start_peer(coord, work, [*argv, "--info-file", str(info)])
            wait_for("the coordinator", info.exists, procs, work, hosts, args.start_timeout)
            maddr = json.loads(info.read_text())["join"].split()[-1]

            for name in SERVERS:
                procs[name] = start_peer(hosts[name], work, [*join_args(maddr, hosts[name]), "--stage", "0"])
            # "Serving stage N at ADDR" comes after the benchmark and the state download ("Joined ... Serving
            # stage N of M" comes before): the counters start after the second server has loaded the state
            serving = lambda: all(SERVING.search(peer_log(work, n)) for n in SERVERS)  # noqa: E731
            wait_for("the stage servers", serving, procs, work, hosts, args.start_timeout)
            base, started = {n: h.counters() for n, h in hosts.items()}, time.time()
            for i, name in enumerate(TRAINERS):
                trainer = [
                    *("--role", "trainer", "--seed", str(i), "--log-file", "trainer.jsonl"),
                    *("--max-micro-batches", str(args.micro_batches // 2), "--max-inflight", str(args.inflight)),
                ]
                if i == 0:  # validates once, at the end
                    trainer += ["--eval-every", "1000000", "--set", f"trainer.eval_batches={args.eval_batches}"]
                procs[name] = start_peer(hosts[name], work, [*join_args(maddr, hosts[name]), *trainer])
            print(f"  {mode}: servers up, trainers started (logs in {work})", flush=True)
            _wait_for_trainers(mode, procs, work, args, started)
            wall = time.time() - started
            end = {n: h.counters() for n, h in hosts.items()}
            failed = [n for n in TRAINERS if procs[n].returncode != 0]
            if failed:
                raise LabError(
                    f"{failed[0]} failed (status {procs[failed[0]].returncode}):\n{peer_log(work, failed[0])[-3000:]}"
                )
        finally:
            lab.close(grace=STOP_GRACE)
    return _outcome(mode, work, hosts, base, end, started, wall)


def _wait_for_trainers(mode: str, procs: dict, work: Path, args: argparse.Namespace, started: float) -> None:
    """Until every trainer has exited; LabError if a server or the coordinator exits first, or on timeout."""
    deadline, last = time.monotonic() + args.timeout, time.monotonic()
    while any(procs[n].poll() is None for n in TRAINERS):
        for name in ("coordinator", *SERVERS):
            if procs[name].poll() is not None:
                raise LabError(f"{name} exited during training:\n{peer_log(work, name)[-3000:]}")
        if time.monotonic() > deadline:
            raise LabError(f"the trainers did not finish within {args.timeout:.0f} s; logs in {work}")
        if time.monotonic() - last > 30:
            last = time.monotonic()
            done = sum(e["samples"] for n in TRAINERS for e in entries(work, n) if e["type"] == "micro_batch")
            print(f"  {mode}: {time.time() - started:.0f} s, {done} samples", flush=True)
        time.sleep(0.5)


def _outcome(mode: str, work: Path, hosts: dict, base: dict, end: dict, started: float, wall: float) -> dict:
    """A run's figures from its hosts' byte counters, the trainers' JSON lines and the servers' logs."""
    traffic = {n: (end[n][0] - base[n][0]) + (end[n][1] - base[n][1]) for n in hosts}
    batches = [e for n in TRAINERS for e in entries(work, n) if e["type"] == "micro_batch"]
    samples = sum(e["samples"] for e in batches)
    train = max((e["time"] for e in batches), default=started + wall) - started  # wall less the trainers' drain
    evals = [e["loss"] for e in entries(work, "trainer0") if e["type"] == "eval"]
    steps = [STEP_RE.findall(peer_log(work, n)) for n in SERVERS]
    averaged = max(sum(int(peers) >= 1 for _, _, peers in found) for found in steps)
    alone = max(sum(int(peers) == 0 for _, _, peers in found) for found in steps)
    avg_bytes = sum(traffic[n] for n in SERVERS) - sum(traffic[n] for n in TRAINERS)
    return {
        "mode": mode,
        "samples": samples,
        "wall": wall,
        "train": train,
        "val": evals[-1] if evals else None,
        "traffic": traffic,
        "averaging_bytes": avg_bytes,
        "per_sample": avg_bytes / max(samples, 1),
        "averaged": averaged,
        "alone": alone,
    }


def describe(r: dict, figures: Figures) -> None:
    """Print one run's line and add its figures."""
    t, mode = r["traffic"], r["mode"]
    val = f"{r['val']:.4f}" if r["val"] is not None else "none"
    print(
        f"{mode:>9}: {r['samples']} samples in {r['train']:.0f} s ({r['samples'] / r['train']:.1f}/s; "
        f"{r['wall']:.0f} s with the trainers' drain); "
        f"servers {(t['server0'] + t['server1']) / 1e6:.1f} MB, trainers {(t['trainer0'] + t['trainer1']) / 1e6:.1f} "
        f"MB, coordinator {t['coordinator'] / 1e6:.1f} MB (tx+rx); averaging {r['averaging_bytes'] / 1e6:.1f} MB "
        f"= {r['per_sample'] / 1e3:.2f} kB/sample; {r['averaged']} rounds averaged, {r['alone']} steps alone; "
        f"val {val}",
        flush=True,
    )
    figures[f"val_{mode}"] = val
    figures["outer_steps" if mode == "local" else f"steps_{mode}"] = r["averaged"]
    figures.update({f"samples_{mode}": r["samples"], f"wall_{mode}": f"{r['wall']:.0f}"})


def compare(g: dict, loc: dict, figures: Figures) -> None:
    """The two runs against each other: the loss and the bytes ratios."""
    if g["val"] and loc["val"]:
        figures["val_ratio"] = f"{loc['val'] / g['val']:.4f}"
    if loc["per_sample"] > 0:
        figures["bytes_ratio"] = f"{g['per_sample'] / loc['per_sample']:.1f}"
    else:
        figures["bytes_ratio"] = "inf"  # DHT chatter of the trainers outweighed the servers' averaging
    print(
        f"averaging bytes per sample: gradients / local = {figures['bytes_ratio']} (goal >= 100); "
        f"val loss local / gradients = {figures.get('val_ratio', 'n/a')} (goal <= 1.03)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco.py",
        description="Compare DiLoCo (averaging.mode=local, int4 pseudo-gradients every H inner steps) with per-step "
        "gradient averaging at equal samples, in the WAN lab: averaging bytes per sample and validation loss. "
        "Needs root; removes everything it creates.",
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=256,
        help="micro-batches of 16 per run, split over 2 trainers (default 256: 1-2 min a run on 2 cores; quick 32)",
    )
    parser.add_argument(
        "--inner-steps", type=int, default=32, help="local mode: inner steps per outer step, H (32; quick 2)"
    )
    parser.add_argument("--rate", type=float, default=100.0, help="every host's cap in Mbit/s, both ways (default 100)")
    parser.add_argument("--no-cap", action="store_true", help="no bandwidth cap")
    parser.add_argument("--inflight", type=int, default=2, help="micro-batches each trainer keeps in flight (2)")
    parser.add_argument(
        "--eval-batches", type=int, default=16, help="held-out micro-batches of the final validation (16; quick 2)"
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="s for one run's trainers to finish (300; quick 120)"
    )
    parser.add_argument(
        "--start-timeout", type=float, default=180.0, help="s for the coordinator and servers (180; quick 90)"
    )
    add_workdir(parser)
    add_quick(parser, "32 micro-batches a run, H=2, 2 validation micro-batches")
    return parser


def body(args: argparse.Namespace, figures: Figures) -> None:
    if args.micro_batches < 2 or args.inner_steps < 1 or args.eval_batches < 1 or args.rate <= 0:
        print(
            "diloco.py: need --micro-batches >= 2, --inner-steps >= 1, --eval-batches >= 1, --rate > 0", file=sys.stderr
        )
        raise SystemExit(2)
    open_benchmark("diloco.py", figures)
    cap = "no cap" if args.no_cap else f"{args.rate:g} Mbit/s"
    results = {}
    with workdir(args.workdir, "swarmtrain-diloco-") as work:
        print(
            f"{args.micro_batches} micro-batches of {MICRO_BATCH} per run, H={args.inner_steps}, {cap}; logs in {work}"
        )
        for mode in ("gradients", "local"):
            try:
                results[mode] = train(mode, args, work / mode)
            except (LabError, OSError) as e:  # a peer that failed or a wait that timed out: one line, no traceback
                raise SystemExit(f"diloco.py: {e}") from None
            describe(results[mode], figures)
    compare(results["gradients"], results["local"], figures)


def main() -> None:
    parser = build_parser()
    if parser.parse_known_args()[0].quick:  # the quick defaults; flags given still win
        parser.set_defaults(**QUICK)
    run(parser, body)


if __name__ == "__main__":
    main()
