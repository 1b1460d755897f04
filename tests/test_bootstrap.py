"""A run on an existing DHT, joined through any peer: the coordinator is the trust anchor, not the door.

Real processes: hivemind's own `hivemind-dht` as a plain bootstrap node, a coordinator started
on it with `--initial-peers`, and servers and a trainer that join through the bootstrap node with
`--coordinator PEER_ID`, the last ones while the coordinator is stopped (SIGSTOP).
"""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
from helpers.swarm import PEER

from dht.identity import Identity
from peer.cli.demo import loopback_join

SPEC = {
    "name": "anywhere",
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64, "max_seq_len": 16},
    "stages": {"num_stages": 2},
    "training": {"micro_batch_size": 4, "seq_len": 16, "target_batch_size": 8, "total_steps": 1000},
    # a newcomer's credential needs the coordinator; the DHT, the spec and the data path do not
    "admission": {"mode": "off"},
}


@pytest.mark.slow  # a long scenario (about 20 s): the slow tier, to keep the README suite under 10 minutes
def test_a_run_on_a_plain_dht_is_joined_through_any_peer_while_its_coordinator_is_stopped(swarm):
    bootstrap = swarm.start(
        "bootstrap", ["-m", "hivemind.hivemind_cli.run_dht", "--host_maddrs", "/ip4/127.0.0.1/tcp/0"], python=True
    )
    door = bootstrap.wait_for(r"--initial_peers (/ip4/127\.0\.0\.1/tcp/\d+/p2p/\S+)", 60).group(1)
    # meanwhile: a real peer id that is no run's coordinator is said within seconds, not after 20
    nobody = door.rsplit("/", 1)[1]
    lost = swarm.start("lost", ["join", door, "--coordinator", nobody, "--identity", "lost.pem", "--host", "127.0.0.1"])
    # and the right address with a wrong /p2p/ id (a typo, an old run's): the handshake fails at once
    mistyped = door.rsplit("/", 1)[0] + "/" + Identity.generate().peer_id
    typo = swarm.start("typo", ["join", mistyped, "--identity", "typo.pem", "--host", "127.0.0.1"])
    swarm.coordinator(SPEC, extra=["--initial-peers", door])
    coordinator = swarm.peers[-1]
    assert "Joined the existing DHT through" in coordinator.output()
    anchor = json.loads((swarm.workdir / "coordinator.json").read_text())["peer_id"]
    assert anchor not in door  # the door is not the coordinator

    def join(name: str, *extra: str):
        return swarm.start(name, loopback_join(door, name, "--coordinator", anchor, *extra))

    first = join("s0", "--stage", "0")
    assert lost.wait(30) == 2, lost.output()
    # said after the DHT's start and network.spec_timeout (5 s), not after the 20 s start-up bound
    assert f"no run spec signed by coordinator {nobody} was found in the DHT within 5 s" in lost.output()
    assert "Traceback" not in lost.output()
    assert typo.wait(30) == 2 and "is that peer's" in typo.output() and "Traceback" not in typo.output()
    swarm.endpoint(first)

    coordinator.signal(signal.SIGSTOP)
    try:
        last = join("s1", "--stage", "1")
        swarm.endpoint(last, timeout=90)
        trainer = join("t0", "--role", "trainer", "--log-file", "t0.jsonl", "--max-micro-batches", "12")
        assert trainer.wait(120) == 0, trainer.output()[-3000:]
        batches = [e for e in swarm.log("t0") if e["type"] == "micro_batch"]
        assert len(batches) == 12
        # and `peer status` reads the run through the same door
        status = subprocess.run(
            [*PEER, "status", door, "--coordinator", anchor],
            cwd=swarm.workdir,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert "Run 'anywhere'" in status.stdout
    finally:
        coordinator.signal(signal.SIGCONT)
