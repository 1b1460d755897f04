"""Finding a run in the DHT: the coordinator's signed spec, and which stage needs a server most."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

from dht import keys
from dht.errors import UserError
from dht.identity import IdentityError, public_key_from_peer_id
from dht.node import DHTStartError, SwarmDHT
from dht.records import RunSpecRecord, ServerRecord
from peer.balance import stage_totals, weakest_stage
from peer.config import ConfigError, RunSpec


class RunNotFound(UserError, RuntimeError):
    """No valid run spec could be read; the message says what was tried."""


def coordinator_peer_id(maddr: str, coordinator: str | None = None) -> str:
    """The run's trust anchor: `coordinator` when given, else the `/p2p/...` part of `maddr`.

    Without `coordinator`, `maddr` must be the coordinator's own address; with it, `maddr` may be
    any peer of the run or a plain DHT bootstrap node.
    """
    if coordinator:
        try:
            public_key_from_peer_id(coordinator)
        except IdentityError as e:
            raise RunNotFound(f"--coordinator: {e}") from None
        return coordinator
    parts = maddr.strip().split("/")
    if "p2p" not in parts or parts.index("p2p") + 1 >= len(parts):
        raise RunNotFound(f"{maddr!r} has no /p2p/<peer id> part; copy the whole address the coordinator printed")
    peer_id = parts[parts.index("p2p") + 1]
    try:
        public_key_from_peer_id(peer_id)
    except IdentityError as e:
        raise RunNotFound(f"{maddr!r}: {e}") from None
    return peer_id


def dial_address(maddr: str) -> tuple[str, int]:
    """(host, TCP port) of a multiaddr like /ip4/HOST/tcp/PORT/p2p/ID; RunNotFound if it names none."""
    parts = maddr.strip().split("/")
    try:
        host = parts[parts.index(next(p for p in parts if p in ("ip4", "ip6", "dns", "dns4", "dns6"))) + 1]
        port = int(parts[parts.index("tcp") + 1])
    except (StopIteration, ValueError, IndexError):
        raise RunNotFound(f"{maddr!r} is not a multiaddr like /ip4/HOST/tcp/PORT/p2p/PEER_ID") from None
    return host, port


def answering(maddrs: list[str], timeout: float) -> list[str]:
    """The multiaddrs at which something accepts a TCP connection within `timeout` (all tried at once)."""
    if not maddrs:
        return []

    def answers(maddr: str) -> bool:
        try:
            check_reachable(maddr, timeout)
            return True
        except (DHTStartError, RunNotFound):
            return False

    with ThreadPoolExecutor(max_workers=min(16, len(maddrs))) as pool:
        return [m for m, ok in zip(maddrs, pool.map(answers, maddrs), strict=True) if ok]


def check_reachable(maddr: str, timeout: float) -> None:
    """Say at once (DHTStartError) when nothing answers at the address a user gave, instead of a long wait."""
    host, port = dial_address(maddr)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except TimeoutError:
        raise DHTStartError(
            f"no answer from {host}:{port} within {timeout:g} s ({maddr}); check the address and that the peer "
            "runs and its DHT port is reachable from here"
        ) from None
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise DHTStartError(
            f"cannot reach {host}:{port} ({reason}); check the address ({maddr}) and that the peer runs"
        ) from None


def publish_spec(dht: SwarmDHT, spec: RunSpec, ttl: float) -> bool:
    record = RunSpecRecord(spec=spec.to_dict(), coordinator_maddrs=dht.visible_maddrs(), published=time.time())
    return dht.store(keys.spec_key(dht.peer_id), record, ttl)


def fetch_spec(dht: SwarmDHT, coordinator: str, timeout: float) -> RunSpec:
    """Read the spec signed by `coordinator`; records signed by anyone else are never used."""
    deadline = time.monotonic() + timeout
    while True:
        records = dht.get(keys.spec_key(coordinator), RunSpecRecord)
        record = records.get(coordinator)  # only the coordinator's own signed subkey counts
        if record is not None:
            try:
                return RunSpec.from_dict(record.spec)
            except ConfigError as e:
                raise RunNotFound(f"the coordinator's run spec is invalid: {e}") from None
        if time.monotonic() > deadline:
            raise RunNotFound(
                f"no run spec signed by coordinator {coordinator} was found in the DHT within {timeout:g} s; "
                "check that this is the peer id the coordinator printed and that its run is up"
            )
        time.sleep(0.5)


def stage_servers(dht: SwarmDHT, spec: RunSpec, stage: int) -> dict[str, ServerRecord]:
    return {pid: r for pid, r in dht.get(keys.servers_key(spec.name, stage), ServerRecord).items() if r.stage == stage}


def choose_stage(dht: SwarmDHT, spec: RunSpec, allowed: set[int] | None = None) -> int:
    """The stage with the least total announced throughput (joining servers count), the lowest index on ties.

    Only stages in `allowed` (None: all) are candidates.
    """
    n = spec.stages.num_stages
    totals, _ = stage_totals([stage_servers(dht, spec, stage) for stage in range(n)], n)
    return weakest_stage(totals, allowed)
