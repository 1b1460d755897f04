"""Throughput of a stage server behind NAT, served through a relay, against the same server reachable directly.

In the WAN lab (benchmarks/lab.py, needs root and iptables), every host capped at `--rate` Mbit/s
both ways: a coordinator, a relay (`peer join --role relay`), a stage-0 server and a trainer on
public hosts; stage 1 is served in turns by a server on a public host (dialled directly) and by
the same server on a host behind a home router (MASQUERADE: it finds out it cannot be dialled and
serves through the relay). The trainer runs throughout; each turn measures its samples/s over a
window once `--warmup` micro-batches went through the new stage-1 server. Turns alternate
(direct, relayed, direct, ...) so drift on this machine hits both sides alike.

    sudo .venv/bin/python benchmarks/relay.py [--rate 50] [--window 20] [--rounds 2] [--quick]

Last line: `direct_sps=... relayed_sps=... ratio=<relayed samples/s / direct samples/s> ... status=ok`,
the turns' figures as they come (benchmarks/report.py). Goal >= 0.9 (Petals assumes a relayed server
keeps only 0.2 of its throughput). `--quick`: one turn a side, 5 s windows. A window counts whole
micro-batches (16-21 in 20 s here), so one more or less moves a side by about 5 %.
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.lab import Lab, LabError, open_benchmark  # noqa: E402
from benchmarks.rehearsal import Tail, join_args, start_peer, wait_for  # noqa: E402
from benchmarks.report import Figures, add_quick, add_workdir, run, workdir  # noqa: E402
from peer.cli.demo import SERVING, spec_to_toml  # noqa: E402
from peer.config import RunSpec  # noqa: E402

QUICK = {"rounds": 1, "window": 5.0, "warmup": 2}
STOP_GRACE = 1.0  # s the peers have to leave at the end, before the lab kills them: nothing is measured then
LEAVE_GRACE = 5.0  # s a stopped server has to leave (the relay then logs what it carried for it) before SIGKILL


def make_spec(width: int) -> RunSpec:
    return RunSpec.from_dict(
        {
            "name": "relaybench",
            "seed": 0,
            "model": {
                "hidden_size": width,
                "num_layers": 4,
                "num_heads": max(2, width // 64),
                "intermediate_size": (width * 8 // 3 + 63) // 64 * 64,
                "max_seq_len": 128,
            },
            "stages": {"num_stages": 2},
            "admission": {"mode": "open"},  # its own peers, started without invite codes
            "training": {
                "micro_batch_size": 16,
                "seq_len": 128,
                "target_batch_size": 64,
                "total_steps": 100000,
                "lr": 0.003,
                "warmup_steps": 10,
            },
        }
    )


class Bench:
    def __init__(self, lab: Lab, work: Path, args):
        self.lab, self.work, self.args = lab, work, args
        (work / "run.toml").write_text(spec_to_toml(make_spec(args.width)))
        self.hosts = {
            name: lab.add_host(name, args.rate) for name in ("coordinator", "relay", "server0", "public", "trainer")
        }
        self.hosts["home"] = lab.add_nat_host("home", args.rate)
        self.procs: dict[str, subprocess.Popen] = {}
        coord = self.hosts["coordinator"]
        info = work / "coordinator.json"
        argv = ["coordinator", str(work / "run.toml"), "--identity", "coordinator.pem", "--host", coord.ip]
        self.procs["coordinator"] = start_peer(
            coord, work, [*argv, "--info-file", str(info), "--set=coordinator.relay=false"]
        )
        wait_for("the coordinator", info.exists, self.procs, work, self.hosts, 120)
        self.maddr = json.loads(info.read_text())["join"].split()[-1]
        self.start("relay", ["--role", "relay"])
        self.start("server0", ["--stage", "0"])
        wait_for(
            "the relay and stage 0",
            lambda: "Relaying for" in self.log("relay") and self.serving("server0"),
            self.procs,
            work,
            self.hosts,
            180,
        )
        trainer = [
            "--role",
            "trainer",
            "--seed",
            "0",
            "--log-file",
            "trainer.jsonl",
            "--max-inflight",
            str(args.inflight),
        ]
        self.start("trainer", trainer)
        self.tail = Tail(work / "trainer" / "trainer.jsonl")

    def start(self, name: str, extra: list[str]) -> None:
        host = self.hosts[name]
        self.procs[name] = start_peer(host, self.work, [*join_args(self.maddr, host), *extra])

    def log(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.work / name / "peer.log").read_text(errors="replace")
        return ""

    def serving(self, name: str) -> bool:
        return bool(SERVING.search(self.log(name)))

    def samples(self) -> tuple[int, int]:
        batches = [e for e in self.tail.read() if e.get("type") == "micro_batch"]
        return len(batches), sum(e["samples"] for e in batches)

    def turn(self, name: str) -> float:
        """Serve stage 1 from host `name`; the trainer's samples/s over a window; then stop that server."""
        args = self.args
        before = len(self.log(name))
        # each turn replaces the stage's only server, which leaves first: what is measured is throughput, not
        # that stage's training, so it starts from the seed again (else it would wait for the state: peer.server.stage)
        self.start(name, ["--stage", "1", "--set", "server.seed_start=true"])
        wait_for(
            f"stage 1 on {name}",
            lambda: self.serving(name) and len(self.log(name)) > before,
            self.procs,
            self.work,
            self.hosts,
            180,
        )
        start_count = self.samples()[0]
        wait_for(
            "the warmup", lambda: self.samples()[0] >= start_count + args.warmup, self.procs, self.work, self.hosts, 300
        )
        (_, s0), t0 = self.samples(), time.monotonic()
        time.sleep(args.window)
        (_, s1), t1 = self.samples(), time.monotonic()
        if self.procs["trainer"].poll() is not None:
            raise LabError(f"the trainer ended:\n{self.log('trainer')[-2000:]}")
        self.stop(name)
        return (s1 - s0) / (t1 - t0)

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(LEAVE_GRACE)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)


def relay_bytes(log: str) -> float:
    found = re.findall(r"stopped relaying for \S+ \(([\d.]+) MB carried\)", log)
    return sum(map(float, found))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=50.0, help="cap per host, Mbit/s each way")
    parser.add_argument("--window", type=float, default=20.0, help="s of measurement per turn (quick 5)")
    parser.add_argument(
        "--warmup", type=int, default=8, help="micro-batches through a new server before its window (quick 2)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="turns per side (direct, relayed, alternating; quick 1)")
    parser.add_argument("--width", type=int, default=256, help="hidden size of the model")
    parser.add_argument("--inflight", type=int, default=4, help="trainer: micro-batches in flight")
    add_workdir(parser)
    add_quick(parser, "one turn a side, 5 s windows after 2 micro-batches")
    return parser


def body(args: argparse.Namespace, figures: Figures) -> None:
    open_benchmark("relay.py", figures, nat=True)
    started = time.time()
    try:
        with workdir(args.workdir, "swarmtrain-relay-") as work:
            turns(args, work, figures)
    except LabError as e:  # a peer that failed or a wait that timed out: one line, no traceback
        raise SystemExit(f"relay.py: {e}") from None
    finally:
        figures.update(rate_mbit=f"{args.rate:g}", width=args.width, window_s=f"{args.window:g}", rounds=args.rounds)
        figures.update(cpus=os.cpu_count(), seconds=f"{time.time() - started:.0f}")


def turns(args: argparse.Namespace, work: Path, figures: Figures) -> None:
    """Alternate direct and relayed turns; each turn's samples/s (and the ratio so far) go to `figures`."""
    sps: dict[str, list[float]] = {"direct": [], "relayed": []}
    with Lab() as lab:
        bench = Bench(lab, work, args)
        try:
            for _ in range(args.rounds):
                for name, side in (("public", "direct"), ("home", "relayed")):
                    sps[side].append(bench.turn(name))
                    print(f"{side:<7}: {sps[side][-1]:.1f} samples/s", flush=True)
                    figures[f"{side}_sps"] = "/".join(f"{x:.1f}" for x in sps[side])
                figures["ratio"] = f"{mean(sps['relayed']) / mean(sps['direct']):.3f}"
            if "Not reachable at" not in bench.log("home") or "Serving through relay" in bench.log("public"):
                raise LabError(f"the home server was not relayed, or the public one was; logs in {work}")
        finally:
            lab.close(grace=STOP_GRACE)
            figures["relay_mb"] = f"{relay_bytes(bench.log('relay')):.0f}"


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def main() -> None:
    parser = build_parser()
    if parser.parse_known_args()[0].quick:  # the quick defaults; flags given still win
        parser.set_defaults(**QUICK)
    run(parser, body)


if __name__ == "__main__":
    main()
