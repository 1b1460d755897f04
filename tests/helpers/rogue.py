"""A peer that was not admitted tries to take part anyway (tests/test_security.py runs it).

It joins the run's DHT with its own key, announces a stage server that does not exist (its record
is signed by its identity key but carries no credential), and keeps asking to average huge values
with the replicas of stage 0 through the replicas' own all-reduce (peer.server.allreduce), at their
next step, printing what each round gave it and why it failed.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import sys
import time

import torch

from dht import keys
from dht.address import coordinator_peer_id
from dht.identity import Identity
from dht.node import SwarmDHT
from dht.records import ServerRecord
from peer.config import PeerConfig
from peer.model.llama import StageModel
from peer.net.client import StageClient
from peer.server.averaging import GradientAverager
from peer.swarm.discovery import fetch_spec
from protocols import averaging_pb2


def main(maddr: str, identity_path: str, seconds: float) -> None:
    mp.set_start_method("fork", force=True)
    identity = Identity.load_or_create(identity_path)
    dht = SwarmDHT(identity, [maddr], ["/ip4/127.0.0.1/tcp/0"], [], 20.0, 5.0)
    spec = fetch_spec(dht, coordinator_peer_id(maddr), timeout=20.0)
    # its own rounds give up fast (these settings are each averager's own): more tries in the time it has
    spec.averaging.group_timeout, spec.averaging.averaging_timeout, spec.averaging.max_attempts = 2.5, 4.0, 1
    params = [p.detach() for p in StageModel(spec, 0).parameters()]
    averager = GradientAverager(spec)
    fake = ServerRecord(stage=1, endpoint="127.0.0.1:9", throughput=1e6, updated=time.time(), started=time.time())
    print(f"ROGUE {identity.peer_id} up", flush=True)
    try:
        asyncio.run(_rounds(dht, spec, identity, averager, params, fake, seconds))
    finally:
        averager.shutdown()
        dht.shutdown()


async def _rounds(dht, spec, identity, averager, params, fake, seconds: float) -> None:
    loop = asyncio.get_running_loop()
    records: dict[str, ServerRecord] = {}
    client = StageClient.for_server(PeerConfig().server)  # no credential of this run: plaintext, or nothing
    header = averaging_pb2.AverageHeader(run_id=spec.name, stage=0)
    averager.allreduce.bind(loop, client, identity, lambda p: records[p].endpoint, header, lambda: 0, bool)
    averager.loop = loop
    huge = [torch.full_like(p, 1e6) for p in params]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        fake.updated = time.time()
        await loop.run_in_executor(None, lambda: dht.store(keys.servers_key(spec.name, 1), fake, ttl=10.0))
        for _ in range(8):
            # aim at the replicas of stage 0: their next step, a group of two (what they expect), with one
            # of them expected; their TLS and admission must keep it out
            records = await loop.run_in_executor(None, dht.get, keys.servers_key(spec.name, 0), ServerRecord)
            replicas = sorted(pid for pid, r in records.items() if r.state == "serving")
            epoch = 1 + max((r.epoch for r in records.values()), default=0)
            group = [identity.peer_id, *replicas[:1]]
            result = await loop.run_in_executor(None, averager.average, huge, 1000, epoch, group)
            members = "none" if result is None else ",".join(result.members)
            print(f"ROUND epoch={epoch} replicas={len(replicas)} members={members}", flush=True)
            if time.monotonic() > deadline:
                break


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
