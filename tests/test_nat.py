"""A stage server behind a real NAT (network namespaces, iptables MASQUERADE; benchmarks/lab.py).

It finds out by itself that nobody can dial it, serves through a relay, and the run goes on when that
relay is SIGKILLed. Needs root, `ip netns` and iptables; skipped otherwise. Leaves no namespace behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from helpers.processes import hivemind_sockets, remove_stale_sockets  # noqa: E402

from benchmarks import lab, rehearsal  # noqa: E402

WHY_NOT = lab.nat_available()
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=f"NAT hosts cannot be made here: {WHY_NOT}")

SPEC = """
name = "nat"
seed = 7
[admission]
mode = "open"
[model]
hidden_size = 32
num_layers = 2
num_heads = 2
intermediate_size = 64
max_seq_len = 16
[stages]
num_stages = 2
[training]
micro_batch_size = 4
seq_len = 16
target_batch_size = 16
total_steps = 100000
lr = 0.003
warmup_steps = 2
"""

LISTEN = "import socket, sys; s = socket.socket(); s.bind((sys.argv[1], 5001)); s.listen(1); print('up', flush=True); s.accept()"
DIAL = "import socket, sys; socket.create_connection((sys.argv[1], 5001), timeout=3); print('connected')"


def _can_dial(client: lab.Host, server: lab.Host) -> bool:
    listener = server.popen([sys.executable, "-c", LISTEN, server.ip], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "up"
        dial = client.run([sys.executable, "-c", DIAL, server.ip], capture_output=True, text=True, timeout=20)
        return dial.returncode == 0
    finally:
        listener.kill()
        listener.wait(5)
        listener.stdout.close()


@pytest.fixture
def nothing_left():
    """The test's lab leaves no namespace (nor a p2p daemon's socket) behind; other live labs may come and go."""
    before, sockets = set(lab.namespaces()), hivemind_sockets()
    yield
    remove_stale_sockets(sockets)
    mine = [ns for ns in set(lab.namespaces()) - before if (m := lab.STALE_RE.match(ns)) and int(m[1]) == os.getpid()]
    assert not mine


class Swarm:
    def __init__(self, wan: lab.Lab, work: Path):
        self.wan, self.work, self.procs, self.hosts = wan, work, {}, {}

    def log(self, name: str) -> str:
        return rehearsal.host_log(self.work, self.hosts[name])

    def start(self, name: str, host: lab.Host, args: list[str]) -> None:
        self.hosts[name] = host
        self.procs[name] = rehearsal.start_peer(host, self.work, args)

    def wait(self, name: str, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while not (found := re.search(pattern, self.log(name))):
            if self.procs[name].poll() is not None:
                raise AssertionError(f"{name} exited before {pattern!r}:\n{self.log(name)[-3000:]}")
            assert time.monotonic() < deadline, f"{name}: no {pattern!r} in {timeout:.0f} s:\n{self.log(name)[-3000:]}"
            time.sleep(0.2)
        return found

    def micro_batches(self) -> int:
        path = self.work / "t0" / "t0.jsonl"
        text = path.read_text() if path.exists() else ""
        return sum(1 for line in text.splitlines() if '"micro_batch"' in line)

    def wait_micro_batches(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.micro_batches() < n:
            assert self.procs["t0"].poll() is None, self.log("t0")[-3000:]
            assert time.monotonic() < deadline, f"only {self.micro_batches()} micro-batches:\n{self.log('t0')[-3000:]}"
            time.sleep(0.3)


@pytest.mark.slow  # a scenario of about 23 s in network namespaces (a relay dies): the slow tier, as test_relay's
def test_a_server_behind_nat_serves_through_a_relay_and_outlives_it(tmp_path, nothing_left):
    with lab.Lab() as wan:
        public = {name: wan.add_host(name) for name in ("coord", "r1", "r2", "s0", "t0")}
        home = wan.add_nat_host("home")
        assert _can_dial(home, public["s0"]) and not _can_dial(public["s0"], home)  # a real NAT: out, not in

        swarm = Swarm(wan, tmp_path)
        (tmp_path / "run.toml").write_text(SPEC)
        info = tmp_path / "coordinator.json"
        coord = public["coord"]
        argv = ["coordinator", str(tmp_path / "run.toml"), "--identity", "coordinator.pem", "--host", coord.ip]
        swarm.start("coord", coord, [*argv, "--info-file", str(info), "--set", "coordinator.relay=false"])
        swarm.wait("coord", r"To join, run", 60)
        maddr = json.loads(info.read_text())["join"].split()[-1]
        relay_ids = {}
        for name in ("r1", "r2"):
            swarm.start(name, public[name], [*rehearsal.join_args(maddr, public[name]), "--role", "relay"])
        for name in ("r1", "r2"):
            relay_ids[swarm.wait(name, r"Relaying for peers that cannot be dialled, at \S+ \(peer (\w+)\)", 60)[1]] = (
                name
            )
        swarm.start("s0", public["s0"], [*rehearsal.join_args(maddr, public["s0"]), "--stage", "0"])
        swarm.start("home", home, [*rehearsal.join_args(maddr, home), "--stage", "1", "--set", "relay.dead_after=3"])

        swarm.wait("home", r"Joined run", 90)
        joined = time.monotonic()
        verdict = swarm.wait("home", rf"Not reachable at {re.escape(home.ip)}:\d+ from outside", 30)
        assert verdict and time.monotonic() - joined < 20  # it finds out within seconds of joining
        carrier = relay_ids[swarm.wait("home", r"Serving through relay (\w+) at (\S+)\.", 10)[1]]
        swarm.wait("home", r"Serving stage 1 at \S+ from step", 60)
        assert re.search(rf"Reachable at {re.escape(public['s0'].ip)}:\d+", swarm.wait("s0", r"Reachable at .*", 60)[0])

        swarm.start(
            "t0",
            public["t0"],
            [*rehearsal.join_args(maddr, public["t0"]), "--role", "trainer", "--log-file", "t0.jsonl"],
        )
        swarm.wait_micro_batches(6, 150)

        killed = time.monotonic()
        os.killpg(swarm.procs[carrier].pid, signal.SIGKILL)
        moved = swarm.wait("home", r"Moved to relay (\w+) in", 30)
        assert relay_ids[moved[1]] != carrier and time.monotonic() - killed < 15  # within seconds
        done = swarm.micro_batches()
        swarm.wait_micro_batches(done + 6, 120)  # the run goes on through the other relay
        assert "Serving through relay" not in swarm.log("s0")  # reachable: never relayed
