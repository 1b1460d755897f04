"""An admitted peer (a trainer's credential) that tries to exhaust a stage server's memory
(tests/test_security.py runs it):

- `claim`: many ForwardStream calls whose header claims the largest tensor the server accepts, and
  none of its bytes sent;
- `tokens`: one forward to stage 0 of as many real token ids as a message may carry (all stage 0's
  activations for them would be built and cached);
- `shards`: GetState of stage 0 split into 2^32 - 1 shards (the split alone would allocate that many sets),
  as a server (a trainer may not ask for a state at all: `shards-trainer`).

It prints each call's outcome:

    BOMB up PEER_ID
    BOMB codes RESOURCE_EXHAUSTED=12 DEADLINE_EXCEEDED=4 seconds=5.1
    BOMB said INVALID_ARGUMENT: ...
"""

from __future__ import annotations

import asyncio
import collections
import multiprocessing as mp
import sys
import time

import grpc
import torch

from dht import keys
from dht.identity import Identity
from dht.records import ServerRecord
from peer.cli.join import connect
from peer.config import PeerConfig
from peer.net.client import SERVICE, StageClient
from protocols import codec, framing, stage_pb2, tensor_pb2


async def one_call(client: StageClient, endpoint: str, peer: str, run: str, elements: int, hold: float) -> str:
    header = stage_pb2.ForwardRequest(run_id=run, stage=0)
    header.inputs.CopyFrom(tensor_pb2.Tensor(dtype=tensor_pb2.INT32, shape=[1, elements]))

    async def frames():
        yield framing.chunk_frame(header.SerializeToString())
        await asyncio.sleep(hold)  # and never a byte of the tensor it claimed

    channel, _ = client._channel(endpoint, peer)
    call = channel.stream_stream(f"/{SERVICE}/ForwardStream")(frames(), timeout=hold)
    try:
        async for _ in call:
            pass
        return "OK"
    except grpc.aio.AioRpcError as e:
        return e.code().name


async def bomb(client: StageClient, endpoint: str, peer: str, run: str, calls: int, elements: int, hold: float) -> None:
    started = time.monotonic()
    codes = await asyncio.gather(*(one_call(client, endpoint, peer, run, elements, hold) for _ in range(calls)))
    counted = " ".join(f"{code}={n}" for code, n in sorted(collections.Counter(codes).items()))
    print(f"BOMB codes {counted} seconds={time.monotonic() - started:.1f}", flush=True)
    await client.close()


async def tokens(client: StageClient, endpoint: str, peer: str, run: str, seq: int, elements: int) -> None:
    ids = torch.zeros(elements // seq, seq, dtype=torch.int32)
    request = stage_pb2.ForwardRequest(run_id=run, stage=0)
    request.inputs.CopyFrom(codec.encode(ids))
    try:
        await client.forward(endpoint, request, timeout=60.0, peer=peer)
        print("BOMB said OK", flush=True)
    except grpc.aio.AioRpcError as e:
        print(f"BOMB said {e.code().name}: {e.details()}", flush=True)
    await client.close()


async def shards(client: StageClient, endpoint: str, peer: str, run: str, num_shards: int) -> None:
    try:
        await client.get_state(endpoint, run, 0, 30.0, shard=0, num_shards=num_shards, peer=peer)
        print("BOMB said OK", flush=True)
    except grpc.aio.AioRpcError as e:
        print(f"BOMB said {e.code().name}: {e.details()}", flush=True)
    await client.close()


def main(mode: str, maddr: str, identity_path: str, endpoint: str, calls: int, elements: int, hold: float) -> None:
    mp.set_start_method("fork", force=True)
    cfg = PeerConfig()
    cfg.network.host, cfg.network.dht_host_maddrs = "127.0.0.1", ["/ip4/127.0.0.1/tcp/0"]
    identity = Identity.load_or_create(identity_path)
    dht, spec = connect(maddr, cfg, identity, "server" if mode == "shards" else "trainer")
    try:
        deadline = time.monotonic() + 30
        # the server's record, as a trainer reads it: its TLS name (its owner's) is what the channel then pins
        while not (
            peers := [
                p for p, r in dht.get(keys.servers_key(spec.name, 0), ServerRecord).items() if r.endpoint == endpoint
            ]
        ):
            if time.monotonic() > deadline:
                raise SystemExit(f"no record names {endpoint}")
            time.sleep(0.5)
        peer = peers[0]
        print(f"BOMB up {identity.peer_id}", flush=True)
        client = StageClient.for_server(cfg.server, dht.security)
        if mode == "claim":
            asyncio.run(bomb(client, endpoint, peer, spec.name, calls, elements, hold))
        elif mode.startswith("shards"):
            asyncio.run(shards(client, endpoint, peer, spec.name, elements))
        else:
            asyncio.run(tokens(client, endpoint, peer, spec.name, spec.model.max_seq_len, elements))
    finally:
        dht.shutdown()


if __name__ == "__main__":
    mode, maddr, identity_path, endpoint, calls, elements, hold = sys.argv[1:8]
    main(mode, maddr, identity_path, endpoint, int(calls), int(elements), float(hold))
