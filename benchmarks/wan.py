"""Throughput of a swarm behind 100 Mbit/s links, against what its compute and its links allow.

Each configuration (activation codec none/fp16/int8, at two model widths) runs a real swarm in
the WAN lab (benchmarks/lab.py, needs root): a coordinator, one server for each of two stages and
one trainer, each in its own network namespace. In one run of the swarm:

1. uncapped window: samples/s with no bandwidth cap. On this machine every peer shares the same
   CPU cores, so this is the swarm's compute bound (what it does when links cost nothing).
2. capped window: every host capped at `--rate` Mbit/s both ways (`tc tbf`). Bytes per sample are
   measured on each host's interface (IP/TCP headers, DHT traffic and all) in both windows; the
   bandwidth bound is min over hosts and directions of cap / bytes per sample.
3. ratio = capped samples/s / min(compute bound, bandwidth bound). Goal >= 0.9.

Then, at the first width, one more swarm per codec trains a fixed number of micro-batches with one
in flight (uncapped) and validates: with one server per stage and one micro-batch at a time the
swarm is plain sequential training, so the codecs compare on validation loss after equal samples
with nothing else differing (same seeds, same data order).

    sudo .venv/bin/python benchmarks/wan.py [--rate 100] [--window 25] [--widths 192,512]

Last line: key=value pairs: ratio_<codec>_<width>, val_<codec>, val_int8_over_none, and
bytes_int8_over_none (the trainer's interface bytes per sample over the whole validation runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.lab import Lab, LabError, Tail, check_available, join_args, start_peer, wait_for  # noqa: E402
from peer.config import RunSpec  # noqa: E402
from peer.demo import spec_to_toml  # noqa: E402

CODECS = ("none", "fp16", "int8")


def make_spec(width: int, codec: str, name: str, total_steps: int = 100000) -> RunSpec:
    heads = max(2, width // 64)
    spec = RunSpec.from_dict(
        {
            "name": name,
            "seed": 0,
            "model": {
                "hidden_size": width,
                "num_layers": 4,
                "num_heads": heads,
                "intermediate_size": (width * 8 // 3 + 63) // 64 * 64,
                "max_seq_len": 128,
            },
            "stages": {"num_stages": 2},
            "training": {
                "micro_batch_size": 16,
                "seq_len": 128,
                "target_batch_size": 48,
                "total_steps": total_steps,  # throughput runs: never reached; validation runs: the run's length
                "lr": 0.008,
                "warmup_steps": 10,
            },
            "compression": {"activations": codec},
        }
    )
    return spec


class Swarm:
    """One swarm in the lab: coordinator, a server per stage, a trainer."""

    def __init__(self, lab: Lab, work: Path, spec: RunSpec, micro_batches: int, inflight: int):
        self.lab, self.work = lab, work
        work.mkdir(parents=True, exist_ok=True)
        (work / "run.toml").write_text(spec_to_toml(spec))
        self.hosts = {name: lab.add_host(name) for name in ("coordinator", "server0", "server1", "trainer")}
        self.procs: dict[str, subprocess.Popen] = {}
        coord = self.hosts["coordinator"]
        info = work / "coordinator.json"
        argv = ["coordinator", str(work / "run.toml"), "--identity", "coordinator.pem", "--host", coord.ip]
        self.procs["coordinator"] = start_peer(coord, work, [*argv, "--info-file", str(info)])
        wait_for("the coordinator", info.exists, self.procs, work, self.hosts, 120)
        maddr = json.loads(info.read_text())["join"].split()[-1]
        for stage in range(2):
            host = self.hosts[f"server{stage}"]
            self.procs[host.name] = start_peer(host, work, [*join_args(maddr, host), "--stage", str(stage)])
        servers_up = lambda: all(re.search(r"Serving stage \d+ at ", self.log(f"server{s}")) for s in range(2))  # noqa: E731
        wait_for("the stage servers", servers_up, self.procs, work, self.hosts, 180)
        trainer = self.hosts["trainer"]
        args = [
            *join_args(maddr, trainer),
            *("--role", "trainer", "--seed", "0", "--log-file", "trainer.jsonl"),
            *("--max-inflight", str(inflight), "--max-micro-batches", str(micro_batches), "--eval-every", "100000"),
        ]
        self.procs["trainer"] = start_peer(trainer, work, args)
        self.tail = Tail(work / "trainer" / "trainer.jsonl")

    def log(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.work / name / "peer.log").read_text(errors="replace")
        return ""

    def samples(self) -> int:
        return sum(e["samples"] for e in self.tail.read() if e.get("type") == "micro_batch")

    def counters(self) -> dict[str, tuple[int, int]]:
        return {name: host.counters() for name, host in self.hosts.items()}

    def drops(self) -> int:
        """Packets the caps dropped (both ends of every host's link): each is a TCP loss to recover from."""
        total = 0
        for host in self.hosts.values():
            for argv in (
                ["tc", "-n", host.netns, "-s", "qdisc", "show", "dev", "eth0"],
                ["tc", "-n", self.lab.hub, "-s", "qdisc", "show", "dev", host.hub_dev],
            ):
                out = subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout
                total += sum(int(m) for m in re.findall(r"dropped (\d+)", out))
        return total

    def set_rate(self, mbit: float | None) -> None:
        for host in self.hosts.values():
            self.lab.set_rate(host, mbit)

    def window(self, seconds: float) -> dict:
        """samples/s and per-host (tx, rx) bytes per sample over `seconds`."""
        s0, c0, t0 = self.samples(), self.counters(), time.monotonic()
        time.sleep(seconds)
        s1, c1, t1 = self.samples(), self.counters(), time.monotonic()
        if self.procs["trainer"].poll() is not None:
            raise LabError(f"the trainer ended during a window:\n{self.log('trainer')[-2000:]}")
        samples = max(1, s1 - s0)
        per_sample = {n: ((c1[n][0] - c0[n][0]) / samples, (c1[n][1] - c0[n][1]) / samples) for n in c1}
        return {"rate": (s1 - s0) / (t1 - t0), "per_sample": per_sample}

    def wait_trainer(self, timeout: float) -> int:
        try:
            return self.procs["trainer"].wait(timeout)
        except subprocess.TimeoutExpired:
            raise LabError(f"the trainer did not finish within {timeout:.0f} s") from None

    def val_loss(self) -> float | None:
        evals = [e for e in self.tail.read() if e.get("type") == "eval"]
        return evals[-1]["loss"] if evals else None

    def stop(self) -> None:
        for name in ("trainer", "server0", "server1", "coordinator"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


def bandwidth_bound(per_sample: dict[str, tuple[float, float]], mbit: float) -> tuple[float, str]:
    """Samples/s the busiest link direction allows at `mbit`, and which one it is."""
    cap = mbit * 1e6 / 8
    bounds = {
        f"{name} {'up' if d == 0 else 'down'}": cap / b[d] for name, b in per_sample.items() for d in (0, 1) if b[d] > 0
    }
    link = min(bounds, key=bounds.get)
    return bounds[link], link


def throughput(codec: str, width: int, args, lab: Lab, work: Path) -> dict:
    """Samples/s uncapped (the compute bound) and capped, with bytes per sample, on one swarm."""
    spec = make_spec(width, codec, f"wan-{codec}-{width}")
    swarm = Swarm(lab, work / f"{codec}-{width}", spec, 1_000_000, args.inflight)
    try:
        deadline = time.monotonic() + 300
        while swarm.samples() < args.warmup * 16:
            if time.monotonic() > deadline or swarm.procs["trainer"].poll() is not None:
                raise LabError(f"the trainer did not get going:\n{swarm.log('trainer')[-2000:]}")
            time.sleep(0.5)
        free = swarm.window(args.window)
        swarm.set_rate(args.rate)
        time.sleep(2)
        dropped = swarm.drops()
        capped = swarm.window(args.window)
        dropped = swarm.drops() - dropped
        bound, link = bandwidth_bound(capped["per_sample"], args.rate)
        return {
            "codec": codec,
            "width": width,
            "compute": free["rate"],
            "capped": capped["rate"],
            "bandwidth_bound": bound,
            "link": link,
            "ratio": capped["rate"] / min(free["rate"], bound),
            "trainer_bytes_per_sample": sum(capped["per_sample"]["trainer"]),
            "drops": dropped,
        }
    finally:
        swarm.stop()


def validation(codec: str, width: int, args, lab: Lab, work: Path) -> tuple[float, float]:
    """Validation loss after a fixed number of micro-batches, one in flight (the same sequence for every
    codec, with the learning-rate schedule ending with them), and the trainer's bytes per sample."""
    steps = args.micro_batches * 16 // 48
    spec = make_spec(width, codec, f"val-{codec}-{width}", total_steps=steps + 1)
    swarm = Swarm(lab, work / f"val-{codec}-{width}", spec, args.micro_batches, 1)
    try:
        code = swarm.wait_trainer(args.timeout)
        if code != 0:
            raise LabError(f"the trainer failed ({code}):\n{swarm.log('trainer')[-2000:]}")
        loss = swarm.val_loss()
        if loss is None:
            raise LabError(f"the trainer logged no validation:\n{swarm.log('trainer')[-2000:]}")
        # the whole run on the trainer's link (its DHT join and the final validation included)
        return loss, sum(swarm.hosts["trainer"].counters()) / swarm.samples()
    finally:
        swarm.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100.0, help="cap per host, Mbit/s each way")
    parser.add_argument("--window", type=float, default=25.0, help="s per measurement window; 0: skip throughput")
    parser.add_argument("--warmup", type=int, default=6, help="micro-batches before the first window")
    parser.add_argument("--widths", default="192,512", help="model widths; the first also compares validation loss")
    parser.add_argument("--codecs", default=",".join(CODECS), help="activation codecs to compare")
    parser.add_argument("--inflight", type=int, default=8, help="trainer: micro-batches in flight")
    parser.add_argument(
        "--micro-batches", type=int, default=300, help="validation runs (first width): micro-batches; 0: skip them"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="s for a validation run's trainer to finish")
    parser.add_argument("--workdir", default="", help="keep logs here (default: a temporary directory)")
    args = parser.parse_args()
    args.widths = [int(w) for w in args.widths.split(",")]
    try:
        check_available()
    except LabError as e:
        print(f"wan.py: {e}", file=sys.stderr)
        return 2
    work = Path(args.workdir or tempfile.mkdtemp(prefix="swarmtrain-wan-"))
    results, vals = [], {}
    codecs = args.codecs.split(",")
    for width in args.widths if args.window else []:
        for codec in codecs:
            with Lab() as lab:
                r = throughput(codec, width, args, lab, work)
            results.append(r)
            print(
                f"width {width:4d} {codec:>5}: compute {r['compute']:6.1f} samples/s, "
                f"bandwidth bound {r['bandwidth_bound']:7.1f} ({r['link']}), capped {r['capped']:6.1f} "
                f"-> ratio {r['ratio']:.3f}; trainer {r['trainer_bytes_per_sample'] / 1e3:.1f} kB/sample; "
                f"{r['drops']} packets dropped at the caps",
                flush=True,
            )
    if args.micro_batches:
        for codec in codecs:
            with Lab() as lab:
                vals[codec] = validation(codec, args.widths[0], args, lab, work)
            print(
                f"width {args.widths[0]:4d} {codec:>5}: validation loss {vals[codec][0]:.4f} after "
                f"{args.micro_batches * 16} samples; trainer {vals[codec][1] / 1e3:.1f} kB/sample over the whole run",
                flush=True,
            )
    fields = {f"ratio_{r['codec']}_{r['width']}": f"{r['ratio']:.3f}" for r in results}
    for codec, (loss, _) in vals.items():
        fields[f"val_{codec}"] = f"{loss:.4f}"
    if "none" in vals and "int8" in vals:
        fields["val_int8_over_none"] = f"{vals['int8'][0] / vals['none'][0]:.4f}"
        fields["bytes_int8_over_none"] = f"{vals['int8'][1] / vals['none'][1]:.3f}"
    print(f"logs in {work}")
    print(" ".join(f"{k}={v}" for k, v in fields.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
