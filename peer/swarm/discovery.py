"""Finding a run in the DHT: the coordinator's signed spec, and which stage needs a server most."""

from __future__ import annotations

import time

from dht import keys
from dht.errors import UserError
from dht.node import SwarmDHT
from dht.records import RunSpecRecord, ServerRecord
from peer.config import ConfigError, RunSpec
from peer.swarm.balance import stage_totals, weakest_stage


class RunNotFound(UserError, RuntimeError):
    """No valid run spec could be read; the message says what was tried."""


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


def choose_stage(dht: SwarmDHT, spec: RunSpec, allowed: set[int] | None = None, claim_cap: float = 4.0) -> int:
    """The stage with the least total announced throughput (joining servers count, each at most `claim_cap` x the
    run's median claim), the lowest index on ties.

    Only stages in `allowed` (None: all) are candidates.
    """
    n = spec.stages.num_stages
    totals, _ = stage_totals([stage_servers(dht, spec, stage) for stage in range(n)], n, claim_cap=claim_cap)
    return weakest_stage(totals, allowed)
