"""One member of an all-reduce group as a process of its own (tests/test_allreduce_faults.py kills some).

`python allreduce_member.py WORKDIR INDEX MEMBERS MB READ_TIMEOUT [SIGNAL PIECES]` serves the Averaging service on loopback
(plaintext; only the all-reduce of peer.server.allreduce, not a whole peer), writes its endpoint to
WORKDIR/endpoint<INDEX>, waits for every member's, then averages MB megabytes of float32 holding INDEX + 1
everywhere with `samples` INDEX + 1, at epoch 0, and prints one line:
`RESULT members=<ids> samples=<total> value=<the average's first element> exact=<every element equal> t=<unix time>`.
It prints `STARTED t=<unix time>` just before its round, then waits to be killed. With SIGNAL (KILL or STOP)
it sends itself that signal mid-round, once its codec has encoded PIECES pieces (printing `DYING t=...` first).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import grpc
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dht.identity import Identity
from peer.config import RunSpec
from peer.net.client import StageClient
from peer.server.averaging import GradientAverager
from protocols import averaging_pb2
from protocols.averaging_frames import first_header


def member_identities(members: int) -> list[Identity]:
    """The members' identities, the same in every member's process (keys from their index), sorted by peer id: member
    i owns slice i."""
    keys = [Ed25519PrivateKey.from_private_bytes(bytes([i + 1]) * 32) for i in range(members)]
    return sorted((Identity(k) for k in keys), key=lambda identity: identity.peer_id)


def _dies_after(averager: GradientAverager, sig: signal.Signals, pieces: int) -> None:
    """Send ourselves `sig` once the codec has encoded `pieces` pieces (our sends and our results alike)."""
    codec, encode, count = averager.allreduce.codec, averager.allreduce.codec.encode, [0]

    def counted(flat):
        count[0] += 1
        if count[0] == pieces:
            print(f"DYING t={time.time():.3f}", flush=True)
            os.kill(os.getpid(), sig)
        return encode(flat)

    codec.encode = counted


async def main(work: Path, index: int, members: int, mb: float, read_timeout: float, fault: list[str]) -> None:
    spec = RunSpec.from_dict(
        {"averaging": {"read_timeout": read_timeout, "group_timeout": 20.0, "averaging_timeout": 60.0}}
    )
    averager = GradientAverager(spec)
    if fault:
        _dies_after(averager, signal.Signals[f"SIG{fault[0]}"], int(fault[1]))
    identities = member_identities(members)
    ids = [identity.peer_id for identity in identities]

    async def average(frames, context):
        header = await first_header(frames, 10.0)
        async for frame in averager.allreduce.serve(header, frames, ""):
            yield frame

    endpoints: dict[str, str] = {}  # filled once every member has written its own
    loop = asyncio.get_running_loop()
    header = averaging_pb2.AverageHeader(run_id="faults")
    averager.allreduce.bind(
        loop, StageClient(1 << 20, 1 << 30), identities[index], endpoints.get, header, lambda: 0, bool
    )
    averager.loop = loop  # bound before we serve: a partner's call may come the moment our endpoint is known
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(average)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("swarmtrain.Averaging", {"Average": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    (work / f"endpoint{index}.tmp").write_text(f"127.0.0.1:{port}")
    (work / f"endpoint{index}.tmp").rename(work / f"endpoint{index}")
    while not all((work / f"endpoint{i}").exists() for i in range(members)):
        await asyncio.sleep(0.05)
    endpoints.update({ids[i]: (work / f"endpoint{i}").read_text() for i in range(members)})
    tensors = [torch.full((int(mb * 1e6 / 4),), float(index + 1))]
    print(f"STARTED t={time.time():.3f}", flush=True)
    result = await loop.run_in_executor(None, averager.average, tensors, index + 1, 0, ids)
    if result is None:
        print(f"RESULT members=none t={time.time():.3f}", flush=True)
    else:
        flat = result.gradients[0]
        exact = bool((flat == flat[0]).all())
        print(
            f"RESULT members={','.join(result.members)} samples={result.group_samples} value={float(flat[0]):.6f} "
            f"exact={exact} t={time.time():.3f}",
            flush=True,
        )
    await asyncio.sleep(3600)  # serve the others until killed: a member that left would cut their calls


if __name__ == "__main__":
    work_dir, index, count, mb, read_timeout = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6]
    asyncio.run(main(work_dir, index, count, float(mb), float(read_timeout), sys.argv[6:8]))
