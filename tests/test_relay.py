"""Relays on loopback, real processes: a server that cannot be dialled serves through a relay (peer.net.relay,
peer.net.uplink), moves to another when its relay is killed, and a reachable one never uses a relay.

Here "cannot be dialled" is declared (`relay.reachability = private`): on loopback every peer can dial
every other. tests/test_nat.py puts the server behind a real NAT and lets it find out by itself.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
import urllib.request

import pytest
from helpers.calls import info
from helpers.swarm import PEER

SPEC = {
    "name": "relayed",
    "seed": 5,
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64, "max_seq_len": 16},
    "stages": {"num_stages": 2},
    "training": {
        "micro_batch_size": 4,
        "seq_len": 16,
        "target_batch_size": 16,
        "total_steps": 100000,
        "lr": 0.003,
        "warmup_steps": 2,
    },
}


def micro_batches(swarm, trainer: str) -> int:
    return sum(1 for e in swarm.log(trainer) if e["type"] == "micro_batch")


def wait_micro_batches(swarm, trainer: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while micro_batches(swarm, trainer) < n:
        assert time.monotonic() < deadline, f"{trainer} did only {micro_batches(swarm, trainer)} micro-batches"
        time.sleep(0.3)


@pytest.mark.slow  # a long scenario (about 20 s): the slow tier, to keep the README suite under 10 minutes
def test_a_server_behind_a_relay_serves_and_moves_when_its_relay_dies(swarm):
    swarm.coordinator(SPEC, extra=["--set", "coordinator.relay=false"])
    relays = {name: swarm.start(name, _join(swarm, name, "--role", "relay")) for name in ("r1", "r2")}
    for relay in relays.values():
        relay.wait_for(r"Relaying for peers that cannot be dialled, at", 60)
    public = swarm.server("s0", 0)
    hidden = swarm.server("s1", 1, ["--set", "relay.reachability=private", "--set", "relay.dead_after=3"])
    swarm.endpoint(public)
    relayed_at = swarm.endpoint(hidden)
    assert re.search(r"Reachable at \S+: relay \S+ dialled it back", public.output())
    first = hidden.wait_for(r"Serving through relay (\S+) at (\S+)\.", 10)
    assert first.group(2) == relayed_at  # it announces the relay's endpoint, not its own
    peer_ids = {name: _peer_id(p) for name, p in relays.items()}
    carrier = next(name for name, pid in peer_ids.items() if pid == first.group(1))
    assert info(relayed_at).stage == 1  # a client of this test reaches it through the relay (TLS end to end)

    swarm.trainer("t0")
    wait_micro_batches(swarm, "t0", 8, 120)
    # the relay's cost is visible: in peer status and in both sides' metrics
    status = subprocess.run(
        [*PEER, "status", swarm.maddr], capture_output=True, text=True, timeout=60, cwd=swarm.workdir
    ).stdout
    assert "Relays (for peers that cannot be dialled)" in status and "via relay" in status, status
    assert re.search(rf"{first.group(1)[-8:]}.*relay.*1/8", status), status
    assert _metric(hidden, "swarm_relayed") == 1 and _metric(public, "swarm_relayed") == 0
    assert (
        _metric(relays[carrier], "swarm_relay_peers") == 1 and _metric(relays[carrier], "swarm_relay_bytes_total") > 1e4
    )
    killed = time.monotonic()
    relays[carrier].signal(signal.SIGKILL)
    moved = hidden.wait_for(r"Moved to relay (\S+) in ([\d.]+) s", 30)
    assert time.monotonic() - killed < 15
    assert moved.group(1) == peer_ids[next(n for n in relays if n != carrier)]
    done = micro_batches(swarm, "t0")
    wait_micro_batches(swarm, "t0", done + 8, 90)  # the run goes on through the other relay
    assert "Serving through relay" not in public.output()  # a reachable server never uses one


def _metric(peer, name: str) -> float:
    url = peer.wait_for(r"Prometheus metrics at (\S+/metrics)", 10).group(1)
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def _join(swarm, name: str, *extra: str) -> list[str]:
    from peer.cli.demo import loopback_join

    return loopback_join(swarm.maddr, name, *extra)


def _peer_id(peer) -> str:
    return peer.wait_for(r"Relaying for peers that cannot be dialled, at \S+ \(peer (\w+)\)", 30).group(1)
