"""Signed records over a real hivemind DHT: forged or unsigned ones are ignored; joining nothing fails clearly."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import hivemind
import msgpack
import pytest
from hivemind.utils import get_dht_time

from dht import keys
from dht.identity import Identity
from dht.node import SwarmDHT
from dht.records import RevocationList, RunSpecRecord, ServerRecord, TrainerRecord
from peer.config import RunSpec
from peer.swarm.discovery import RunNotFound, fetch_spec
from protocols.version import software_version

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture
def two_nodes():
    a = SwarmDHT(Identity.generate(), host_maddrs=LOOPBACK)
    b = None
    try:
        b = SwarmDHT(Identity.generate(), initial_peers=a.visible_maddrs(), host_maddrs=LOOPBACK)
        yield a, b
    finally:
        if b is not None:
            b.shutdown()
        a.shutdown()


def test_signed_records_roundtrip_and_forgeries_are_refused(two_nodes):
    a, b = two_nodes
    key = keys.servers_key("run", 0)
    assert b.store(key, ServerRecord(stage=0, endpoint="127.0.0.1:1", throughput=5.0), ttl=30)
    records = a.get(key, ServerRecord)
    assert list(records) == [b.peer_id] and records[b.peer_id].throughput == 5.0
    assert records[b.peer_id].software == software_version() != ""  # every stored record names its release
    assert ServerRecord.model_validate_json('{"stage": 0, "endpoint": "x:1", "throughput": 1}').software == ""

    # b signs a record but files it under a's subkey: refused by the validators of both nodes
    forged = ServerRecord(stage=0, endpoint="evil:1", throughput=1e9)
    expiration = get_dht_time() + 30
    _, sealed = b._seal(key, expiration, forged)
    assert not b.store_raw(key, keys.signed_subkey(a.peer_id), sealed, ttl=30)
    # unsigned bytes under a signed subkey: refused
    assert not b.store_raw(key, keys.signed_subkey(b.peer_id), forged.model_dump_json().encode(), ttl=30)
    records = a.get(key, ServerRecord)
    assert set(records) == {b.peer_id} and records[b.peer_id].endpoint == "127.0.0.1:1"


class _Raw:
    """A record's JSON as a hostile peer writes it (no pydantic on its side to refuse NaN or a negative load)."""

    software = "hostile"

    def __init__(self, text: str):
        self.text = text

    def model_dump_json(self) -> str:
        return self.text


def test_a_record_whose_numbers_no_reader_can_do_sums_with_is_ignored(two_nodes):
    """Routing weighs a server by throughput / (1 + load), expiry adds its ttl, the books add a trainer's earlier
    starts: a signed, admitted record with a NaN, an infinity or a negative amount there (a trainer's routing raised
    on every forward; the coordinator's books on an empty start) is ignored like any malformed record."""
    a, b = two_nodes
    server, trainer = keys.servers_key("run", 0), keys.trainers_key("run")
    bad = [
        (server, ServerRecord, '{"stage": 0, "endpoint": "x:1", "throughput": NaN}'),
        (server, ServerRecord, '{"stage": 0, "endpoint": "x:1", "throughput": 1e400}'),
        (server, ServerRecord, '{"stage": 0, "endpoint": "x:1", "throughput": 5, "load": -1}'),
        (server, ServerRecord, '{"stage": 0, "endpoint": "x:1", "throughput": 5, "ttl": NaN}'),
        (trainer, TrainerRecord, '{"samples": 5, "predecessors": [[]]}'),
        (trainer, TrainerRecord, '{"samples": 5, "predecessors": [[0, NaN]]}'),
    ]
    for i, (key, kind, text) in enumerate(bad):
        assert b.store(key, _Raw(text), ttl=30 + i)  # signed by its owner: only what it says is wrong
        assert a.get(key, kind) == {}, text
    assert b.store(trainer, _Raw('{"samples": 5, "train_loss": NaN}'), ttl=60)
    assert a.get(trainer, TrainerRecord)[b.peer_id].samples == 5  # a loss may be NaN: a run that diverged


def test_a_node_reads_the_records_it_holds_without_the_network(two_nodes):
    """local_get: what the node itself stores, with get's checks, and no DHT operation counted."""
    a, b = two_nodes
    key = keys.revocations_key("run")
    assert a.local_get(key, RevocationList) == {}
    assert b.store(key, RevocationList(peers=["x"], updated=1.0), ttl=30)
    # b's store is back at its first replica: a (the other of 2 nodes) holds it once the rest are written
    deadline = time.monotonic() + 10
    while not (held := a.local_get(key, RevocationList)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(held) == [b.peer_id] and held[b.peer_id].peers == ["x"]
    gets = a.operations["get"]
    a.local_get(key, RevocationList)
    assert a.operations["get"] == gets
    # a node's own storage is read with the same gate: a record of another type does not validate
    assert a.local_get(key, ServerRecord) == {}
    # and a newer store replaces what it holds
    assert b.store(key, RevocationList(peers=["x", "y"], updated=2.0), ttl=30)
    deadline = time.monotonic() + 10
    while a.local_get(key, RevocationList)[b.peer_id].peers != ["x", "y"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.local_get(key, RevocationList)[b.peer_id].peers == ["x", "y"]


def test_a_node_hears_of_a_signed_store_under_a_key_it_watches():
    """SwarmDHT(watched=...): the node's validator, in its DHT process, sets the key's event when another peer's
    signed record under it arrives (what wakes the coordinator's authority); a store under another key, or a
    forged one under it, does not."""
    key, other = keys.credential_requests_key("run"), keys.servers_key("run", 0)
    a = SwarmDHT(Identity.generate(), host_maddrs=LOOPBACK, watched=[key])
    b = None
    try:
        b = SwarmDHT(Identity.generate(), initial_peers=a.visible_maddrs(), host_maddrs=LOOPBACK)
        touched = a.touched(key)
        assert a.touched(other) is None and not touched.is_set()
        assert b.store(other, ServerRecord(stage=0, endpoint="127.0.0.1:1", throughput=1.0), ttl=30)
        deadline = time.monotonic() + 10  # until a holds it: then its validator has seen it
        while not a.local_get(other, ServerRecord) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.local_get(other, ServerRecord) and not touched.is_set()
        forged = msgpack.packb({"v": 1, "p": b"{}", "s": b"\x00" * 64}, use_bin_type=True)
        b.store_raw(key, keys.signed_subkey(b.peer_id), forged, ttl=30)
        assert not touched.wait(1.0), "a forged record woke the watcher"
        assert b.store(key, RevocationList(peers=[], updated=1.0), ttl=30)
        assert touched.wait(10), "a signed store under a watched key did not reach the watcher"
    finally:
        if b is not None:
            b.shutdown()
        a.shutdown()


def test_a_node_hears_of_an_owner_new_to_a_group_of_keys_and_not_of_its_refreshes():
    """SwarmDHT(arrivals=...): one event for a group of keys, set when a signed record arrives under one of them
    from an owner the node has not seen under that key before (a peer joined: what wakes a resting coordinator) or
    in another state (leaving); the same owner's refreshes do not set it, another owner's first record does."""
    stage0, stage1 = keys.servers_key("run", 0), keys.servers_key("run", 1)
    a = SwarmDHT(Identity.generate(), host_maddrs=LOOPBACK, arrivals={"members": [stage0, stage1]})
    b = c = None
    try:
        b = SwarmDHT(Identity.generate(), initial_peers=a.visible_maddrs(), host_maddrs=LOOPBACK)
        c = SwarmDHT(Identity.generate(), initial_peers=a.visible_maddrs(), host_maddrs=LOOPBACK)
        joined = a.touched("members")
        assert a.touched(stage0) is None and not joined.is_set()

        def held(key: str, owner: str, updated: float) -> None:  # until a holds it: its validator has seen it
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                record = a.local_get(key, ServerRecord).get(owner)
                if record is not None and record.updated == updated:
                    return
                time.sleep(0.05)
            raise AssertionError(f"{owner}'s record of {updated} did not reach the node")

        assert b.store(stage0, ServerRecord(stage=0, endpoint="127.0.0.1:1", throughput=1.0, updated=1.0), ttl=30)
        assert joined.wait(10), "a new owner's record under a watched key did not set the event"
        held(stage0, b.peer_id, 1.0)
        joined.clear()
        for updated in (2.0, 3.0):  # its refreshes
            assert b.store(stage0, ServerRecord(stage=0, endpoint="127.0.0.1:1", throughput=1.0, updated=updated), 30)
            held(stage0, b.peer_id, updated)
        assert not joined.is_set(), "a known owner's refresh set the event"
        leaving = ServerRecord(stage=0, endpoint="127.0.0.1:1", throughput=1.0, updated=3.5, state="leaving")
        assert b.store(stage0, leaving, 30)
        assert joined.wait(10), "a known owner's record in another state did not set the event"
        joined.clear()
        assert c.store(stage1, ServerRecord(stage=1, endpoint="127.0.0.1:2", throughput=1.0, updated=4.0), ttl=30)
        assert joined.wait(10), "another owner's first record did not set the event"
    finally:
        for node in (c, b):
            if node is not None:
                node.shutdown()
        a.shutdown()


def test_a_client_nodes_store_is_done_once_a_full_node_holds_the_record():
    """A trainer's DHT node is a hivemind client (asked by nobody): its store is done only once a full node holds
    the record, never by its own storage, which nobody reads."""
    key = keys.trainers_key("run")
    full = SwarmDHT(Identity.generate(), host_maddrs=LOOPBACK)
    client = None
    try:
        client = SwarmDHT(
            Identity.generate(), initial_peers=full.visible_maddrs(), host_maddrs=LOOPBACK, client_mode=True
        )
        assert client.store(key, ServerRecord(stage=0, endpoint="127.0.0.1:1", throughput=1.0), ttl=30)
        assert client.peer_id in full.local_get(key, ServerRecord), "the store returned before a full node held it"
        assert not client.local_get(key, ServerRecord), "a client kept the record in its own storage"
        assert client.peer_id in client.get(key, ServerRecord)
    finally:
        if client is not None:
            client.shutdown()
        full.shutdown()


def test_records_from_a_node_without_validators_are_ignored(two_nodes):
    a, _ = two_nodes
    rogue = hivemind.DHT(initial_peers=a.visible_maddrs(), host_maddrs=LOOPBACK, start=True)
    try:
        key = keys.servers_key("run", 1)
        victim = Identity.generate().peer_id
        record = ServerRecord(stage=1, endpoint="evil:1", throughput=1e9).model_dump_json().encode()
        fake_envelope = msgpack.packb({"v": 1, "p": record, "s": b"\x00" * 64}, use_bin_type=True)
        # the rogue node keeps these in its own storage whatever our validator says
        rogue.store(key, fake_envelope, get_dht_time() + 30, subkey=keys.signed_subkey(victim))
        rogue.store(key, record, get_dht_time() + 30, subkey="plain-subkey")
        time.sleep(0.5)
        assert a.get(key, ServerRecord) == {}
    finally:
        rogue.shutdown()


def test_spec_is_read_only_from_the_coordinator_key(two_nodes):
    coordinator, impostor = two_nodes
    spec = RunSpec.from_dict({"name": "real"})
    fake = RunSpec.from_dict({"name": "fake"})
    # the impostor publishes a valid record of its own under the coordinator's spec key
    assert impostor.store(keys.spec_key(coordinator.peer_id), RunSpecRecord(spec=fake.to_dict()), ttl=30)
    with pytest.raises(RunNotFound, match="no run spec signed by coordinator"):
        fetch_spec(impostor, coordinator.peer_id, timeout=1.0)
    assert coordinator.store(keys.spec_key(coordinator.peer_id), RunSpecRecord(spec=spec.to_dict()), ttl=30)
    assert fetch_spec(impostor, coordinator.peer_id, timeout=5.0).name == "real"


def test_join_where_nothing_answers_fails_quickly_and_clearly(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free now: nothing listens there
    maddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{Identity.generate().peer_id}"
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "peer.cli.main",
            "join",
            maddr,
            "--identity",
            str(tmp_path / "id.pem"),
            "--host",
            "127.0.0.1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    assert f"cannot reach 127.0.0.1:{port} (Connection refused)" in result.stderr
    assert maddr in result.stderr and "Traceback" not in result.stderr
    assert elapsed < 5  # one refused TCP connect, before any DHT node starts


def test_identity_is_created_once_and_locked(tmp_path):
    path = tmp_path / "id.pem"
    first = Identity.load_or_create(path)
    assert Identity.load_or_create(path).peer_id == first.peer_id
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    first.lock()
    second = Identity.load(path)
    with pytest.raises(Exception, match="in use by another running peer"):
        second.lock()
