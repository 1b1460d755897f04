"""What the swarm's security costs and how fast it catches a wrong server, in one run.

Three measurements, each on a small model with real peers (separate processes) on loopback:

1. TLS + credentials: the trainer's samples/s with `[admission] mode = "off"` (plaintext gRPC, no
   credentials) against `mode = "open"` (coordinator-signed credentials, mutual TLS everywhere), a
   coordinator, one server per stage and one trainer each, spot checks off on both sides. Both
   swarms are up through the whole part, and their trainers run at the same time (`--tls-rounds`
   rounds of `--tls-micro-batches` each): each round measures both over one window, from when both
   trainers are past their first `--warmup` micro-batches to when one has done 90 % of its own. This
   machine's fast and slow spells (tens of % between runs) then fall on both sides alike, and the two
   swarms compete for the same cores: the one that costs more per sample gets fewer samples. Beside
   samples/s, the CPU seconds all of each swarm's processes spent per sample in that window (read
   from /proc). Each round's ratio is taken, then the median over rounds.
2. Spot checks at the default rate: open mode, stage 0 served by 2 replicas, a trainer with
   `trainer.spot_check=0` against one with the default rate, taking turns on the same swarm
   (honest_banned counts the default-rate trainers' bans there: all replicas are honest).
3. Micro-batches until a wrong server is banned: open mode, stage 0 served by 3 replicas of which
   one adds Gaussian noise to its outputs (`server.perturb_outputs`), `revoke_after_reports = 1`;
   the micro-batch whose spot check caught it, whether the caught peer was the perturbing one, and
   the seconds from the trainer's catch to the coordinator's "Revoked peer" line. Repeated.

4. Attacks by admitted peers (the attackers of tests/test_attacks.py, tests/helpers/), one after another on one
   swarm with three honest replicas of stage 0 and a trainer: a replica that claims 1000 steps more than its
   partners (far_claim_refused_s: from its first claim to the first honest replica's "not believed"), one that
   claims 2 with noised weights (takeover_refused_s: to the first "refused the state"), one that poisons every
   averaging round (poison_refused_s: from its first poisoned round to the first "refused the mean"), and 16
   streams each claiming a 64 MiB tensor and sending none (bomb_codes: how the calls ended; bomb_s: how long
   all of them took, server.read_timeout being 5 s there).

The last line is

    tls_overhead_pct=... tls_cpu_overhead_pct=... spot_check_overhead_pct=... micro_batches_until_ban=... ...
    ... far_claim_refused_s=... takeover_refused_s=... poison_refused_s=... bomb_codes=... bomb_s=...

where an overhead is (1 - with / without) x 100 of samples/s (for TLS: the median over rounds of each round's ratio;
tls_cpu_overhead_pct: (with / without - 1) x 100 of the CPU ms per sample, likewise; goal <= 5 for both), and
micro_batches_until_ban
the median number of micro-batches a trainer made up to and including the one whose check caught
the perturbing server (the spot_check entry's index + 1; ban_indices lists the raw 0-based indices,
"-" for a swarm where nobody was caught).

    python benchmarks/security.py [--micro-batches 150] [--rounds 2] [--repeats 2] [--keep] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cputime import paired, train_together  # noqa: E402
from benchmarks.report import Figures, add_quick, run  # noqa: E402
from dht.identity import Identity  # noqa: E402
from peer.cli.demo import SERVING, Processes, loopback_coordinator, loopback_join, read_log, spec_to_toml  # noqa: E402
from peer.config import RunSpec  # noqa: E402

START_TIMEOUT = 180.0  # s for a swarm's peers to come up (a loaded 2-core machine is slow)
STOP_GRACE = 6.0  # s the peers get to leave before they are killed (a server takes server.shutdown_grace)


def make_spec(args, mode: str, revoke_after_reports: int = 2) -> RunSpec:
    s = RunSpec()
    s.name = "security"
    m = s.model
    m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size = args.hidden, args.layers, 4, 2 * args.hidden
    m.max_seq_len = s.training.seq_len = args.seq_len
    s.stages.num_stages = 2
    t = s.training
    t.micro_batch_size, t.target_batch_size, t.total_steps = args.micro_batch, args.target_batch, 100_000
    a = s.averaging
    a.request_timeout, a.averaging_timeout = 2.0, 8.0
    s.admission.mode = mode
    s.admission.revoke_after_reports = revoke_after_reports
    s.validate()
    return s


class Swarm:
    """A coordinator and servers on loopback in their own directory; trainers run on it one at a time."""

    def __init__(self, workdir: Path, spec: RunSpec):
        workdir.mkdir(parents=True)
        self.workdir, self.spec, self.procs = workdir, spec, Processes(workdir)
        self.servers: list[str] = []
        self.maddr = ""

    def _wait(self, condition, names: list[str], what: str, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            for name in names:
                if self.procs.procs[name][0].poll() is not None:
                    raise SystemExit(
                        f"{name} exited early (code {self.procs.procs[name][0].returncode}):\n"
                        f"{self.procs.log(name)[-3000:]}"
                    )
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {n}:\n{self.procs.log(n)[-1500:]}" for n in names)
                raise SystemExit(f"waited {timeout:.0f} s for {what}\n{tails}")
            time.sleep(0.2)

    def start(self, servers: list[tuple[str, int, list[str]]], coordinator: list[str] = ()) -> float:
        """Start the coordinator (with `coordinator` args) and `servers` (name, stage, extra args); the seconds until
        all serve."""
        started = time.monotonic()
        (self.workdir / "run.toml").write_text(spec_to_toml(self.spec))
        info = self.workdir / "coordinator.json"
        self.procs.start("coordinator", [*loopback_coordinator("run.toml", str(info)), *coordinator])
        self._wait(info.exists, ["coordinator"], "the coordinator")
        self.maddr = json.loads(info.read_text())["join"].split()[-1]
        for name, stage, extra in servers:
            self.procs.start(name, loopback_join(self.maddr, name, "--stage", str(stage), *extra))
            self.servers.append(name)
        self._wait(
            lambda: all(SERVING.search(self.procs.log(n)) for n in self.servers),
            ["coordinator", *self.servers],
            "the servers to serve",
        )
        return time.monotonic() - started

    def peer_id(self, name: str) -> str:
        return Identity.load(self.workdir / f"{name}.pem").peer_id

    def start_trainer(self, name: str, micro_batches: int, extra: list[str]):
        args = ["--role", "trainer", "--seed", "0", "--max-inflight", "2", "--log-file", f"{name}.jsonl"]
        return self.procs.start(
            name, loopback_join(self.maddr, name, *args, "--max-micro-batches", str(micro_batches), *extra)
        )

    def train(self, name: str, micro_batches: int, warmup: int, extra: list[str], timeout: float) -> float:
        """Run a trainer for `micro_batches` to its end; its samples/s after the first `warmup`."""
        proc = self.start_trainer(name, micro_batches, extra)
        self._wait(lambda: proc.poll() is not None, ["coordinator", *self.servers], f"trainer {name}", timeout)
        return self._rate(proc, name, warmup)[0]

    def _rate(self, proc, name: str, warmup: int) -> tuple[float, float]:
        """A finished trainer's samples/s after its first `warmup` micro-batches, and its samples per micro-batch."""
        if proc.returncode != 0:
            raise SystemExit(f"trainer {name} failed (code {proc.returncode}):\n{self.procs.log(name)[-3000:]}")
        batches = sorted(
            (e for e in read_log(self.workdir / f"{name}.jsonl") if e["type"] == "micro_batch"),
            key=lambda e: e["time"],
        )
        if len(batches) < warmup + 2:
            raise SystemExit(f"trainer {name} logged only {len(batches)} micro-batches")
        timed = batches[warmup:] if warmup else batches[1:]
        begun = batches[warmup - 1]["time"] if warmup else batches[0]["time"]
        samples = sum(e["samples"] for e in timed)
        return samples / max(timed[-1]["time"] - begun, 1e-9), samples / len(timed)

    def stop(self) -> None:
        self.procs.stop(grace=STOP_GRACE)


def overhead(without: list[float], with_: list[float]) -> float:
    return (1.0 - statistics.median(with_) / statistics.median(without)) * 100.0


def fmt(rates: list[float]) -> str:
    return "/".join(f"{r:.1f}" for r in rates)


def tls_phase(args, root: Path) -> dict[str, list[float]]:
    """Samples/s and CPU per sample without and with admission (TLS + credentials): both swarms up, their trainers
    running at the same time (`train_together`), `tls_rounds` times."""
    swarms = {mode: Swarm(root / f"tls-{mode}", make_spec(args, mode)) for mode in ("off", "open")}
    rates: dict[str, list[float]] = {"off": [], "open": [], "off_cpu": [], "open_cpu": []}
    try:
        for mode, swarm in swarms.items():
            took = swarm.start([(f"s{st}", st, []) for st in range(2)])
            print(f"[tls] {mode} swarm serving after {took:.1f} s", flush=True)
        for r in range(args.tls_rounds):
            both = train_together(
                swarms,
                f"t{r}",
                args.tls_micro_batches,
                args.warmup,
                ["--set", "trainer.spot_check=0"],
                args.trainer_timeout,
            )
            for mode, (rate, cpu) in both.items():
                rates[mode].append(rate)
                rates[f"{mode}_cpu"].append(cpu)
            print(
                f"[tls] round {r}: off {both['off'][0]:.1f} samples/s, {both['off'][1]:.2f} CPU s per 1000 samples; "
                f"open {both['open'][0]:.1f} samples/s, {both['open'][1]:.2f} CPU s per 1000 samples",
                flush=True,
            )
    finally:
        for swarm in swarms.values():
            swarm.stop()
    return rates


def spot_check_phase(args, root: Path) -> tuple[dict[str, list[float]], int]:
    """Samples/s with spot checks off and at the default rate, stage 0 with 2 replicas, open mode."""
    swarm = Swarm(root / "spot", make_spec(args, "open"))
    rates: dict[str, list[float]] = {"off": [], "default": []}
    false_bans = 0
    try:
        took = swarm.start([("s0a", 0, []), ("s0b", 0, []), ("s1", 1, [])])
        print(f"[spot] swarm (2 replicas of stage 0) serving after {took:.1f} s", flush=True)
        for r in range(args.rounds):
            order = ("off", "default") if r % 2 == 0 else ("default", "off")
            for kind in order:
                extra = ["--set", "trainer.spot_check=0"] if kind == "off" else []
                rate = swarm.train(f"t{r}{kind}", args.micro_batches, args.warmup, extra, args.trainer_timeout)
                rates[kind].append(rate)
                checks = [e for e in read_log(swarm.workdir / f"t{r}{kind}.jsonl") if e["type"] == "spot_check"]
                false_bans += len(checks)  # every replica here is honest
                note = f" (banned {len(checks)} honest server(s)!)" if checks else ""
                print(f"[spot] round {r} spot_check={kind}: {rate:.1f} samples/s{note}", flush=True)
    finally:
        swarm.stop()
    return rates, false_bans


def ban_phase(args, root: Path, repeat: int) -> dict:
    """One swarm with a perturbing replica of stage 0: when and whom the trainer's spot checks catch."""
    swarm = Swarm(root / f"ban{repeat}", make_spec(args, "open", revoke_after_reports=1))
    result = {"index": None, "right": False, "revoke_s": None, "revoked": False}
    try:
        bad = ["--set", f"server.perturb_outputs={args.perturb}"]
        took = swarm.start([("s0a", 0, []), ("s0b", 0, []), ("s0bad", 0, bad), ("s1", 1, [])])
        perturber = swarm.peer_id("s0bad")
        print(f"[ban {repeat}] swarm serving after {took:.1f} s; the perturbing server is {perturber}", flush=True)
        log = swarm.workdir / "t.jsonl"
        trainer = swarm.start_trainer("t", args.ban_limit, [])
        caught_at = revoked_at = None
        deadline = time.monotonic() + args.trainer_timeout
        while time.monotonic() < deadline:
            now = time.time()
            if caught_at is None:
                checks = [e for e in read_log(log) if e["type"] == "spot_check"]
                if checks:
                    caught_at, first = now, checks[0]
                    result.update(index=first["index"], wrong=first["wrong"], right=first["wrong"] == perturber)
                    print(
                        f"[ban {repeat}] caught {first['wrong']} at micro-batch {first['index']} "
                        f"(stage {first['stage']}, {'the perturbing server' if result['right'] else 'AN HONEST ONE'})",
                        flush=True,
                    )
            if revoked_at is None and "Revoked peer" in swarm.procs.log("coordinator"):
                revoked_at = now
                line = swarm.procs.log("coordinator").split("Revoked peer ", 1)[1].splitlines()[0]
                result["revoked"] = line.split(":")[0].strip() == perturber
                print(f"[ban {repeat}] coordinator: Revoked peer {line}", flush=True)
            if caught_at is not None and revoked_at is not None:
                result["revoke_s"] = revoked_at - caught_at
                break
            if trainer.poll() is not None:
                if caught_at is not None:  # give the coordinator a few more seconds
                    if time.time() - caught_at > 30:
                        break
                else:
                    break
            time.sleep(0.2)
        batches = [e for e in read_log(log) if e["type"] == "micro_batch"]
        result["micro_batches"] = len(batches)
        if caught_at is None:
            print(
                f"[ban {repeat}] NOT caught after {len(batches)} micro-batches "
                f"(trainer {'exited' if trainer.poll() is not None else 'still running'})",
                flush=True,
            )
        elif revoked_at is None:
            print(f"[ban {repeat}] the coordinator did not revoke anyone", flush=True)
    finally:
        swarm.stop()
    return result


HELPERS = Path(__file__).resolve().parent.parent / "tests" / "helpers"  # the attackers tests/test_attacks.py runs


def first_time(swarm: Swarm, names: list[str], text: str, timeout: float) -> float | None:
    """time.monotonic() when `text` first shows in the logs of `names` (polled); None after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(text in swarm.procs.log(n) for n in names):
            return time.monotonic()
        time.sleep(0.05)
    return None


def timed_attack(swarm: Swarm, name: str, command: list[str], started: str, refused: str, timeout: float):
    """Start attacker `name`; seconds from its first `started` line to the first `refused` line of stage 0's honest
    replicas (None if either never came), and it is stopped again."""
    honest = [n for n in swarm.servers if n.startswith("s0")]
    join = loopback_join(swarm.maddr, name, "--stage", "0")
    swarm.procs.start(name, join, command=command)
    try:
        begun = first_time(swarm, [name], started, timeout)
        done = first_time(swarm, honest, refused, timeout) if begun is not None else None
        return None if done is None else max(done - begun, 0.0)
    finally:
        swarm.procs.stop([name], grace=STOP_GRACE)


def attack_phase(args, root: Path) -> dict[str, str]:
    """Three honest replicas of stage 0 and a trainer; attackers one after another (tests/helpers): a replica
    claiming 1000 steps ahead, one claiming 2 with noised weights (a takeover), one poisoning every averaging
    round, and 16 streams claiming 64 MiB each; how long each took to be refused."""
    swarm = Swarm(root / "attacks", make_spec(args, "open"))
    figures = {}
    try:
        quick = ["--set", "server.read_timeout=5"]
        swarm.start([("s0a", 0, quick), ("s0b", 0, quick), ("s0c", 0, quick), ("s1", 1, quick)])
        swarm.start_trainer("t", 100_000, [])
        first_time(swarm, ["s0a"], "step 3:", args.trainer_timeout)
        python = sys.executable
        attacks = {
            "far_claim_refused_s": ([python, str(HELPERS / "hostile.py"), "1000", "0"], "HOSTILE at", "which most"),
            "takeover_refused_s": (
                [python, str(HELPERS / "hostile.py"), "2", "0.5"],
                "HOSTILE at",
                "refused the state",
            ),
            "poison_refused_s": ([python, str(HELPERS / "poisoner.py"), "1e4"], "POISONER sent", "refused the mean"),
        }
        for key, (command, started, refused) in attacks.items():
            took = timed_attack(swarm, key.split("_")[0], command, started, refused, args.trainer_timeout)
            figures[key] = "none" if took is None else f"{took:.2f}"
            print(f"[attacks] {key}={figures[key]}", flush=True)
        figures.update(bomb_phase(swarm))
        print(f"[attacks] bomb: {figures['bomb_codes']} in {figures['bomb_s']} s", flush=True)
    finally:
        swarm.stop()
    return figures


def bomb_phase(swarm: Swarm) -> dict[str, str]:
    """16 ForwardStream calls at s0a, each header claiming a tensor of 64 MiB, and no byte of it (as an admitted
    trainer): how they ended (refused at once, or cut at server.read_timeout) and how long all took."""
    endpoint = swarm.procs.log("s0a").split("Serving stage 0 at ", 1)[1].split()[0]
    command = [sys.executable, str(HELPERS / "bomb.py")]
    args = ["claim", swarm.maddr, "bomb.pem", endpoint, "16", str(16 << 20), "15"]
    proc = swarm.procs.start("bomb", args, command=command)
    swarm._wait(lambda: proc.poll() is not None, ["s0a"], "the bomb's calls", 120)
    line = next((x for x in swarm.procs.log("bomb").splitlines() if x.startswith("BOMB codes")), "")
    codes = " ".join(p for p in line.split()[2:] if not p.startswith("seconds="))
    seconds = next((p.split("=")[1] for p in line.split() if p.startswith("seconds=")), "none")
    return {"bomb_codes": codes.replace(" ", ",") or "none", "bomb_s": seconds}


FULL = {
    "micro_batches": 150,
    "tls_micro_batches": 450,
    "warmup": 10,
    "rounds": 2,
    "tls_rounds": 3,
    "repeats": 2,
    "ban_limit": 400,
    "trainer_timeout": 300.0,
}
QUICK = {
    "micro_batches": 30,
    "tls_micro_batches": 100,
    "warmup": 5,
    "rounds": 1,
    "tls_rounds": 2,
    "repeats": 1,
    "ban_limit": 300,
    "trainer_timeout": 120.0,
}


def measure(args: argparse.Namespace, root: Path, figures: Figures, started: float) -> None:
    skip = set(filter(None, args.skip.split(",")))
    if "tls" not in skip:
        rates = tls_phase(args, root)
        figures["tls_overhead_pct"] = f"{paired(rates['off'], rates['open']):.1f}"
        figures["tls_cpu_overhead_pct"] = f"{paired(rates['off_cpu'], rates['open_cpu'], cost=True):.1f}"
        figures["off_sps"], figures["tls_sps"] = fmt(rates["off"]), fmt(rates["open"])
        figures["off_cpu_ms_per_sample"], figures["tls_cpu_ms_per_sample"] = (
            fmt(rates["off_cpu"]),
            fmt(rates["open_cpu"]),
        )
        print(
            f"[tls] off {figures['off_sps']} vs open {figures['tls_sps']} samples/s "
            f"({time.monotonic() - started:.0f} s so far)",
            flush=True,
        )
    if "spot" not in skip:
        rates, false_bans = spot_check_phase(args, root)
        figures["spot_check_overhead_pct"] = f"{overhead(rates['off'], rates['default']):.1f}"
        figures["nocheck_sps"], figures["check_sps"] = fmt(rates["off"]), fmt(rates["default"])
        figures["honest_banned"] = str(false_bans)
        print(
            f"[spot] off {figures['nocheck_sps']} vs default {figures['check_sps']} samples/s "
            f"({time.monotonic() - started:.0f} s so far)",
            flush=True,
        )
    if "ban" not in skip:
        results = [ban_phase(args, root, i) for i in range(args.repeats)]
        caught = [r for r in results if r["index"] is not None]
        figures["micro_batches_until_ban"] = (
            f"{statistics.median(r['index'] + 1 for r in caught):g}" if caught else "none"
        )
        figures["ban_indices"] = ",".join(str(r["index"]) if r["index"] is not None else "-" for r in results)
        figures["caught_right"] = f"{sum(r['right'] for r in results)}/{len(results)}"
        figures["revoked_right"] = f"{sum(r['revoked'] for r in results)}/{len(results)}"
        revokes = [r["revoke_s"] for r in results if r["revoke_s"] is not None]
        figures["catch_to_revoke_s"] = f"{statistics.median(revokes):.1f}" if revokes else "none"
    if "attacks" not in skip:
        figures.update(attack_phase(args, root))


def body(args: argparse.Namespace, figures: Figures) -> None:
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    started = time.monotonic()
    print(
        f"model: {args.layers} blocks x {args.hidden}, 2 stages, micro-batch {args.micro_batch}x{args.seq_len}, "
        f"step {args.target_batch} samples; {os.cpu_count()} CPUs",
        flush=True,
    )
    figures.update(
        cpus=os.cpu_count(),
        micro_batches=args.micro_batches,
        warmup=args.warmup,
        rounds=args.rounds,
        repeats=args.repeats,
    )
    root = Path(tempfile.mkdtemp(prefix="swarmtrain-security-"))
    try:
        measure(args, root, figures, started)
    finally:
        figures["seconds"] = f"{time.monotonic() - started:.0f}"
        if args.keep:
            print(f"logs kept in {root}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64, help="model.hidden_size")
    parser.add_argument("--layers", type=int, default=2, help="model.num_layers (2 stages)")
    parser.add_argument("--seq-len", type=int, default=64, help="training.seq_len")
    parser.add_argument("--micro-batch", type=int, default=8, help="training.micro_batch_size")
    parser.add_argument("--target-batch", type=int, default=256, help="training.target_batch_size")
    parser.add_argument("--micro-batches", type=int, help="micro-batches of each timed trainer run (default 150)")
    parser.add_argument("--warmup", type=int, help="micro-batches of each trainer run not timed (default 10)")
    parser.add_argument("--rounds", type=int, help="trainer runs per side of part 2, alternating (default 2)")
    parser.add_argument("--tls-rounds", type=int, help="rounds of part 1, both trainers at once (default 3)")
    parser.add_argument("--tls-micro-batches", type=int, help="micro-batches of each part-1 trainer run (default 450)")
    parser.add_argument("--repeats", type=int, help="swarms with a perturbing server, part 3 (default 2)")
    parser.add_argument("--perturb", type=float, default=0.5, help="std of the perturbing server's noise")
    parser.add_argument("--ban-limit", type=int, help="part 3: micro-batches before giving up (default 400)")
    parser.add_argument("--trainer-timeout", type=float, help="s one trainer run may take (default 300)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: tls,spot,ban,attacks")
    parser.add_argument("--keep", action="store_true", help="keep the peers' logs and keys (the directory is printed)")
    add_quick(parser, "each part once: 30 micro-batches a trainer run, one swarm with a perturbing server")
    run(parser, body)


if __name__ == "__main__":
    main()
