"""One admitted attacker at a time against a training swarm, beside the same swarm honest, in one run.

Two swarms on loopback, each a coordinator (checkpointing every 5 steps), three replicas of stage 0, one server of
stage 1 and a trainer that validates every 10 steps on the same held-out batches (the same seed on both: the same
data in the same order), both training through the whole run. On the attacked swarm,
the third replica of stage 0 is a hostile one, replaced by the next attack once the last was stopped; meanwhile
hostile trainer keys try theirs in turn (one hostile server and one hostile trainer at a time). The attackers are the programs of tests/helpers (each performs the attack against live
peers):

- far: a replica claiming 1000 steps past its partners (hostile.py); stopped when an honest replica says the
  claim is not believed;
- takeover: one claiming 2 steps with noised weights (hostile.py); stopped when the honest replicas have stepped
  10 past where they were when it began to claim, on their own (`honest_loads` counts their loads);
- poison: one sending gradients of 1e4 to every averaging round (poisoner.py); stopped at "refused the mean";
- freeze: one claiming the next step and failing every state request (liar.py freeze); stopped likewise;
- stepped: one answering every averaging call that it already stepped the round (liar.py stepped); stopped when
  an honest replica leaves it out of its rounds;
- blame: one answering every call as the caller's fault (liar.py blame); stopped when the trainer bans it;
- weights: one whose state requests get other weights with a matching fingerprint (rotten.py --weights);
  stopped when the coordinator refuses that state for a checkpoint;
- report: two trainer keys that claim 10,000 samples done and report an honest replica (reporter.py); stopped
  when the coordinator's probe clears it;
- bomb: a trainer key opening 16 streams that each claim a 64 MiB tensor and send nothing (bomb.py); stopped
  when every call was refused or cut off.

Each attack has `--attack-timeout` s. Then both trainers go on for `--after` more validations and stop, and:
`val_ratio` (attacked / honest validation loss at the last step both validated at: equal samples, a step being
the same target batch on both; goal <= 1.05), `books` (whether the attacked coordinator's
books balance, `peer status`), `steps_monotonic` (no honest replica's step ever went down, from its log),
`honest_revoked` (honest peers the attacked coordinator revoked; goal 0), `stopped` (attacks stopped / tried)
and `<attack>_s` (seconds from the attack's first act to its stop; "none": not stopped in time).

    python benchmarks/adversary.py [--attack-timeout 30] [--after 2] [--keep] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import Figures, add_quick, run  # noqa: E402
from benchmarks.security import STOP_GRACE, Swarm, first_time, make_spec  # noqa: E402
from peer.cli.demo import loopback_join, read_log  # noqa: E402

HELPERS = Path(__file__).resolve().parent.parent / "tests" / "helpers"
PY = sys.executable
# name -> (program and its first arguments, what its own log says once it acts, whose log says it was stopped, what)
PASSED = "passed"  # stopped when the honest replicas step 10 past where they were when the attacker began
SERVER_ATTACKS = {
    "far": ([PY, str(HELPERS / "hostile.py"), "1000", "0"], "HOSTILE at", "honest", "which most replicas do not back"),
    "takeover": ([PY, str(HELPERS / "hostile.py"), "2", "0.5"], "HOSTILE at", "honest", PASSED),
    "poison": ([PY, str(HELPERS / "poisoner.py"), "1e4"], "POISONER sent", "honest", "refused the mean"),
    "freeze": ([PY, str(HELPERS / "liar.py"), "freeze"], "HOSTILE at", "honest", PASSED),
    "stepped": ([PY, str(HELPERS / "liar.py"), "stepped"], "LIAR stepped", "honest", "left out of this replica's"),
    "blame": (
        [PY, str(HELPERS / "liar.py"), "blame"],
        "Serving stage 0",
        "trainer",
        r"stage 0 \w+ on .*; banned [1-9]",
    ),
    "weights": ([PY, str(HELPERS / "rotten.py"), "--weights"], "Serving stage 0", "coordinator", "is not taken"),
}
EVAL_EVERY = 10  # steps between the trainers' validations
ATTACKER_START = 180.0  # s an attacker may take to start acting (it joins beside two swarms' training)
ATTACKER_GRACE = 2.0  # s an attacker gets to leave when its turn is over
TRAINER_NICENESS = 10  # the trainers train through everything: they yield the cores to joiners and attackers
STEP = re.compile(r"stage 0 step (\d+):|Loaded the state of stage 0 \(step (\d+)\)")


def attack_server(swarm: Swarm, name: str, timeout: float) -> float | None:
    """Run server attack `name` as stage 0's third replica; seconds from its first act to its stop (None: not
    stopped within `timeout`), after which it is stopped."""
    command, acts, where, stopped = SERVER_ATTACKS[name]
    logs = {"honest": ["s0a", "s0b"], "trainer": ["t"], "coordinator": ["coordinator"]}[where]
    extra = ["--set", "server.throughput=1e6"] if name == "weights" else []
    marks = {n: len(swarm.procs.log(n)) for n in logs}
    swarm.procs.start(name, [*loopback_join(swarm.maddr, name, "--stage", "0"), *extra], command=command)
    try:
        begun = first_time(swarm, [name], acts, ATTACKER_START)
        if begun is None:
            return None
        if stopped == PASSED:  # ten steps past where they were when it began, on their own: not frozen
            at = max((int(a) for a, _ in STEP.findall(swarm.procs.log("s0a")) if a), default=0)
            stopped = "|".join(rf"stage 0 step {step}:" for step in range(at + 10, at + 14))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(re.search(stopped, swarm.procs.log(n)[marks[n] :]) for n in logs):
                return max(time.monotonic() - begun, 0.0)
            time.sleep(0.1)
        return None
    finally:
        swarm.procs.stop([name], grace=ATTACKER_GRACE)


def attack_reports(swarm: Swarm, timeout: float) -> float | None:
    """Two trainer keys claiming 10,000 samples each report honest s0a; seconds until the coordinator's probe
    clears it (None: not within `timeout`)."""
    accused, mark = swarm.peer_id("s0a"), len(swarm.procs.log("coordinator"))
    names = ["r1", "r2"]
    for name in names:
        args = [swarm.maddr, str(swarm.workdir / f"{name}.pem"), accused, str(ATTACKER_START + timeout), "10000"]
        swarm.procs.start(name, args, command=[PY, str(HELPERS / "reporter.py")])
    try:
        if first_time(swarm, names, "REPORTER up", ATTACKER_START) is None:
            return None
        begun = time.monotonic()
        while time.monotonic() - begun < timeout:
            if f"reported {accused}; not revoked" in swarm.procs.log("coordinator")[mark:]:
                return time.monotonic() - begun
            time.sleep(0.1)
        return None
    finally:
        swarm.procs.stop(names, grace=STOP_GRACE)


def attack_bomb(swarm: Swarm, timeout: float) -> tuple[float | None, str]:
    """16 streams from a trainer key at s0a, each claiming 64 MiB and sending nothing: seconds until all ended, and
    how they ended."""
    endpoint = swarm.procs.log("s0a").split("Serving stage 0 at ", 1)[1].split()[0]
    args = ["claim", swarm.maddr, str(swarm.workdir / "bomb.pem"), endpoint, "16", str(16 << 20), "15"]
    proc = swarm.procs.start("bomb", args, command=[PY, str(HELPERS / "bomb.py")])
    try:
        proc.wait(ATTACKER_START + timeout)
    except subprocess.TimeoutExpired:
        swarm.procs.stop(["bomb"], grace=STOP_GRACE)
        return None, "none"
    line = next((x for x in swarm.procs.log("bomb").splitlines() if x.startswith("BOMB codes")), "")
    codes = [p for p in line.split()[2:] if not p.startswith("seconds=")]
    seconds = next((float(p.split("=")[1]) for p in line.split() if p.startswith("seconds=")), None)
    return seconds, ",".join(codes) or "none"


def evals(swarm: Swarm, name: str) -> dict[int, float]:
    """A trainer's validation losses by the step they were taken at, in tens (its log)."""
    found = {}
    for entry in read_log(swarm.workdir / f"{name}.jsonl"):
        if entry["type"] == "eval":
            found.setdefault(int(entry["epoch"]) // EVAL_EVERY, float(entry["loss"]))
    return found


def monotonic_steps(swarm: Swarm, names: list[str]) -> bool:
    """Whether each replica's step, by its log (steps taken, states loaded), never went down."""
    for name in names:
        steps = [int(a or b) for a, b in STEP.findall(swarm.procs.log(name))]
        if any(later < earlier for earlier, later in zip(steps, steps[1:], strict=False)):
            return False
    return True


def books_balance(swarm: Swarm, timeout: float = 60.0) -> str:
    """What `peer status` says of the attacked coordinator's books once the trainer's last record is in (asked
    until they balance, at most `timeout` s: the coordinator looks every few seconds): balance, disagree, or
    unknown."""
    deadline, said = time.monotonic() + timeout, "unknown"
    while said != "balance" and time.monotonic() < deadline:
        status = subprocess.run(
            [PY, "-m", "peer.cli", "status", swarm.maddr, "--timeout", "30"],
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        found = re.search(r"they (balance|disagree)", status.stdout)
        said = found.group(1) if found else "unknown"
        if said != "balance":
            print(f"[books] {status.stdout.strip().splitlines()[-3:]}", flush=True)
    return said


def start_swarm(root: Path, name: str, args, third: bool) -> Swarm:
    spec = make_spec(args, "open", revoke_after_reports=2)
    spec.name = name
    swarm = Swarm(root / name, spec)
    every = ["--set", "server.read_timeout=5"]
    servers = [("s0a", 0, every), ("s0b", 0, every), ("s1", 1, every)] + ([("s0c", 0, every)] if third else [])
    checkpoints = ["--checkpoints", str(root / name / "checkpoints"), "--set", "coordinator.checkpoint_every_steps=5"]
    swarm.start(servers, [*checkpoints, "--set", "coordinator.checkpoint_every_minutes=0"])
    return swarm


def train(swarm: Swarm, args) -> subprocess.Popen:
    """A trainer that goes on until stopped, validating every EVAL_EVERY steps on the same held-out batches."""
    extra = ["--set", f"trainer.eval_every={EVAL_EVERY}", "--set", f"trainer.eval_batches={args.eval_batches}"]
    proc = swarm.start_trainer("t", 10**9, extra)
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, proc.pid, TRAINER_NICENESS)
    return proc


def attacks(attacked: Swarm, args, figures: Figures) -> None:
    """Every attack in turn on the attacked swarm, the servers' and the trainer keys' side by side; the seconds
    each took to be stopped, in `figures`."""
    times: dict[str, float | None] = {}

    def trainer_keys() -> None:  # its processes die with this thread (tied_to_me): each is stopped before
        times["report"] = attack_reports(attacked, args.attack_timeout)
        times["bomb"], figures["bomb_codes"] = attack_bomb(attacked, args.attack_timeout)
        print(f"[attack] report: {times['report']}, bomb: {times['bomb']} ({figures['bomb_codes']})", flush=True)

    keys = threading.Thread(target=trainer_keys, name="trainer-keys")
    keys.start()
    for name in SERVER_ATTACKS:
        times[name] = attack_server(attacked, name, args.attack_timeout)
        print(f"[attack] {name}: {times[name]}", flush=True)
    keys.join()
    for key, took in times.items():
        figures[f"{key}_s"] = "none" if took is None else f"{took:.1f}"
    figures["stopped"] = f"{sum(t is not None for t in times.values())}/{len(times)}"


def compare(swarms: dict[str, Swarm], args, figures: Figures) -> None:
    """Both trainers on until each validated `--after` tens of steps past the attacks; then the validation of
    both at the last step (in tens) both reached: the same samples (the same target batch a step)."""
    start = max(evals(swarms["attacked"], "t"), default=0)
    deadline = time.monotonic() + args.settle_timeout
    while time.monotonic() < deadline:
        if all(max(evals(s, "t"), default=-1) >= start + args.after for s in swarms.values()):
            break
        time.sleep(1.0)
    for swarm in swarms.values():
        swarm.procs.stop(["t"], grace=STOP_GRACE)
    found = {side: evals(s, "t") for side, s in swarms.items()}
    common = sorted(set(found["honest"]) & set(found["attacked"]))
    if not common:
        figures["val_ratio"] = "none"
        return
    at = common[-1]
    figures["val_step"] = at * EVAL_EVERY
    figures["val_honest"], figures["val_attacked"] = f"{found['honest'][at]:.4f}", f"{found['attacked'][at]:.4f}"
    figures["val_ratio"] = f"{found['attacked'][at] / found['honest'][at]:.4f}"


def measure(args, root: Path, figures: Figures) -> None:
    # one after the other, from the main thread: each peer dies with the thread that started it (tied_to_me)
    swarms = {side: start_swarm(root, side, args, side == "honest") for side in ("honest", "attacked")}
    attacked = swarms["attacked"]
    try:
        for swarm in swarms.values():
            train(swarm, args)
        first_time(attacked, ["s0a"], "step 2:", args.attack_timeout)
        attacks(attacked, args, figures)
        compare(swarms, args, figures)
        figures["books"] = books_balance(attacked)
        figures["steps_monotonic"] = str(monotonic_steps(attacked, ["s0a", "s0b"]))
        # loads past each honest replica's first (a resync after a missed round is one; a taken-over state another)
        loads = [len(re.findall(r"Loaded the state of stage 0", attacked.procs.log(n))) for n in ("s0a", "s0b")]
        figures["honest_loads"] = str(sum(max(n - 1, 0) for n in loads))
        ids = {attacked.peer_id(n) for n in ("s0a", "s0b", "s1", "t")}
        revoked = set(re.findall(r"Revoked peer (\S+):", attacked.procs.log("coordinator")))
        figures["honest_revoked"] = str(len(revoked & ids))
    finally:
        for swarm in swarms.values():
            swarm.stop()


def body(args: argparse.Namespace, figures: Figures) -> None:
    if args.quick:
        args.attack_timeout, args.after, args.eval_batches = 20.0, 1, 4
    started = time.monotonic()
    figures.update(cpus=os.cpu_count())
    root = Path(tempfile.mkdtemp(prefix="swarmtrain-adversary-"))
    try:
        measure(args, root, figures)
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
    parser.add_argument("--target-batch", type=int, default=64, help="training.target_batch_size")
    parser.add_argument("--after", type=int, default=2, help="validations (every 10 steps) after the attacks")
    parser.add_argument("--settle-timeout", type=float, default=120.0, help="s for those validations to come")
    parser.add_argument("--attack-timeout", type=float, default=30.0, help="s each attack has to be stopped")
    parser.add_argument("--eval-batches", type=int, default=8, help="micro-batches of each validation")
    parser.add_argument("--keep", action="store_true", help="keep the peers' logs")
    add_quick(parser, "20 s per attack, 1 validation after")
    run(parser, body)


if __name__ == "__main__":
    main()
