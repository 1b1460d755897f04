"""Our gRPC tensor round trip (encode and decode included) against raw TCP on loopback, 256 KB-64 MB.

gRPC side: the project's own wire path. The server is the real stage servicer plumbing
(`peer.server.servicer.add_to_server`, `protocols.framing`, `protocols.codec`) whose forward echoes the
decoded input tensor back; the client is `peer.net.client.StageClient` called as the trainer calls it
(unary up to the chunk size, framed streams above). Raw TCP side: an echo server that reads an
8-byte length and the tensor's bytes and sends them back; the client rebuilds a tensor. Each
server runs in its own process; round trips of the two transports alternate so both see the same
machine load. The last line is `ratio=<geometric mean of tcp_time/grpc_time> ...`.

Beside them, grpcio alone (`raw_<size>`): the same server process and channel options, a stream of
`CHUNK_BYTES` bytes messages read whole and sent back, no framing, no tensors, no limits, and the client
joining what comes back. It is the most any path through grpcio can reach here: where it is below a goal,
the goal is out of reach of gRPC in Python on this machine, whatever our own code does.

Also measured: `floor_ms`, our round trip of a 16-element tensor (a gRPC call's fixed cost: the
channel, HTTP/2 and the event loop), and per size `ceiling_<size>` = tcp / (tcp + floor), the most
any path that makes one gRPC call per round trip could reach even if its bytes cost nothing.

    python benchmarks/transport.py [--sizes 0.25,1,4,16,64] [--repeats N] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import socket
import statistics
import struct
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.process.grpc_env import tune_grpc  # noqa: E402

tune_grpc()  # gRPC as a peer process runs it: set before grpc is imported

import grpc  # noqa: E402

from benchmarks.report import Figures, add_quick, run  # noqa: E402
from peer.config import PeerConfig, RunSpec  # noqa: E402
from peer.net.client import StageClient, channel_options, server_options  # noqa: E402
from peer.process.lifetime import die_with_parent  # noqa: E402
from peer.server.servicer import StageServicer, add_to_server  # noqa: E402
from protocols import codec, stage_pb2  # noqa: E402

MIB = 1024 * 1024
RAW_SERVICE, RAW_METHOD = "bench.Raw", "/bench.Raw/Echo"  # grpcio alone, beside the stage service
CHUNK_BYTES = 2 * MIB
MAX_MESSAGE_BYTES = 512 * MIB


class EchoServicer(StageServicer):
    """The stage service's real request/response path, with an echo in place of the model."""

    device = "cpu"  # where the echo takes the tensor before it sends it back (benchmarks/gpu.py: the GPU)

    async def _forward(self, request: stage_pb2.ForwardRequest, payloads: dict, deadline: float | None = None):
        tensor = self._decode(request.inputs, "inputs", True, payloads)
        if self.device != "cpu":  # as a server on a GPU: its inputs go there, its outputs come back from there
            tensor = tensor.to(self.device).cpu()  # (.cpu() waits for the device)
        header, payload = codec.encode_payload(tensor)
        return stage_pb2.ForwardResponse(outputs=header), {"outputs": payload}


async def raw_echo(request_iterator, context):
    """Every bytes message of the stream read, then all sent back: grpcio's own cost of a round trip."""
    messages = [message async for message in request_iterator]
    for message in messages:
        yield message


def grpc_server_main(conn, preexec, device: str = "cpu") -> None:
    preexec()
    torch.set_num_threads(1)
    if device == "auto":  # decided here: a parent that asked CUDA before it forked could leave us none
        device = "cuda:0" if torch.cuda.is_available() else "cpu"

    async def serve():
        cfg = PeerConfig()
        cfg.server.max_message_bytes, cfg.server.chunk_bytes = MAX_MESSAGE_BYTES, CHUNK_BYTES
        cfg.server.max_tensor_elements = MAX_MESSAGE_BYTES // 4
        # what the servicer reads of its server; RunSpec's defaults stand for a run (its admission plays no part here)
        shim = SimpleNamespace(
            runtime=None,
            cfg=cfg,
            spec=RunSpec(),
            inflight=0,
            inflight_bytes=0,
            run_id="bench",
            stage=0,
            leaving=False,
            stir=lambda: None,  # no progress loop to wake
        )
        server = grpc.aio.server(options=server_options(MAX_MESSAGE_BYTES))
        servicer = EchoServicer(shim)
        servicer.device = device
        add_to_server(servicer, server)
        raw = {"Echo": grpc.stream_stream_rpc_method_handler(raw_echo)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(RAW_SERVICE, raw),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await server.wait_for_termination()

    asyncio.run(serve())


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed")
        view = view[n:]


def tcp_server_main(conn, preexec) -> None:
    preexec()
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send(listener.getsockname()[1])
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    header = bytearray(8)
    while True:
        try:
            _recv_exactly(sock, memoryview(header))
        except ConnectionError:
            return
        (length,) = struct.unpack("<Q", header)
        buffer = bytearray(length)
        _recv_exactly(sock, memoryview(buffer))
        sock.sendall(header)
        sock.sendall(buffer)


class TcpClient:
    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def round_trip(self, tensor: torch.Tensor) -> torch.Tensor:
        payload = memoryview(tensor.numpy()).cast("B")
        self.sock.sendall(struct.pack("<Q", len(payload)))
        self.sock.sendall(payload)
        header = bytearray(8)
        _recv_exactly(self.sock, memoryview(header))
        buffer = bytearray(struct.unpack("<Q", header)[0])
        _recv_exactly(self.sock, memoryview(buffer))
        return torch.frombuffer(buffer, dtype=tensor.dtype).view(tensor.shape)


async def grpc_round_trip(client: StageClient, endpoint: str, tensor: torch.Tensor) -> torch.Tensor:
    header, payload = codec.encode_payload(tensor)  # as the trainer sends a stage's inputs
    request = stage_pb2.ForwardRequest(run_id="bench", stage=0, uid="x", inputs=header)
    response, payloads = await client.forward(endpoint, request, {"inputs": payload}, timeout=120)
    return codec.decode(response.outputs, payload=payloads.get("outputs"))


class RawClient:
    """grpcio alone: a tensor's bytes as a stream of `CHUNK_BYTES` messages (cut once per tensor, outside the
    timing), echoed whole, joined into one buffer again."""

    def __init__(self, loop: asyncio.AbstractEventLoop, endpoint: str):
        self.loop = loop

        async def open_channel():  # on `loop`: an aio channel belongs to the loop it was made on
            return grpc.aio.insecure_channel(endpoint, options=channel_options(MAX_MESSAGE_BYTES))

        self.channel = loop.run_until_complete(open_channel())
        self.echo = self.channel.stream_stream(RAW_METHOD)
        self._cut: tuple[torch.Tensor | None, list[bytes]] = (None, [])

    def _chunks(self, tensor: torch.Tensor) -> list[bytes]:
        if self._cut[0] is not tensor:
            data = memoryview(tensor.numpy()).cast("B")
            self._cut = (tensor, [bytes(data[i : i + CHUNK_BYTES]) for i in range(0, len(data), CHUNK_BYTES)])
        return self._cut[1]

    async def _round_trip(self, tensor: torch.Tensor) -> torch.Tensor:
        call = self.echo(iter(self._chunks(tensor)), timeout=120)
        buffer = bytearray().join([message async for message in call])
        return torch.frombuffer(buffer, dtype=tensor.dtype).view(tensor.shape)

    def round_trip(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.loop.run_until_complete(self._round_trip(tensor))

    def close(self) -> None:
        self.loop.run_until_complete(self.channel.close())


def _start(target, ctx, *extra) -> tuple[mp.Process, int]:
    """A server process that dies with this one (`target(conn, preexec, *extra)`), and the port it listens on."""
    parent, child = ctx.Pipe(duplex=False)
    # made here: die_with_parent records this process as the parent the child must not outlive
    proc = ctx.Process(target=target, args=(child, die_with_parent(), *extra), daemon=True)
    proc.start()
    child.close()  # the child holds the only write end now: if it dies, poll and recv fail at once
    if not parent.poll(60):
        proc.kill()
        raise TimeoutError(f"{target.__name__} did not start")
    try:
        return proc, parent.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"{target.__name__} died (exit code {proc.exitcode}) before it listened") from None


def time_size(size: float, repeats: int, *calls) -> list[float]:
    """Median seconds of a round trip of `size` MiB through each of `calls`, alternating (`repeats` 0: by size)."""
    tensor = torch.randn(int(size * MIB) // 4)
    for call in calls:  # warm up, and check the echo is exact
        for _ in range(2):
            assert torch.equal(call(tensor), tensor)
    timings = {call: [] for call in calls}
    for _ in range(repeats or (30 if size < 1 else 10 if size <= 16 else 5)):
        for call in calls:
            started = time.perf_counter()
            call(tensor)
            timings[call].append(time.perf_counter() - started)
    return [statistics.median(timings[call]) for call in calls]


def floor_seconds(via_grpc, repeats: int) -> float:
    """Median seconds of our round trip of a 16-element tensor: what every gRPC call costs whatever it carries."""
    tensor = torch.randn(16)
    for _ in range(3):
        assert torch.equal(via_grpc(tensor), tensor)
    timings = []
    for _ in range(max(repeats, 30)):
        started = time.perf_counter()
        via_grpc(tensor)
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def size_name(size: float) -> str:
    return f"{size:g}mb" if size >= 1 else f"{round(size * 1024)}kb"


def compare(sizes: list[float], repeats: int, grpc_port: int, tcp_port: int, figures: Figures) -> None:
    """Time both transports at each size; figures over the sizes so far (an interrupted run still reports them)."""
    loop = asyncio.new_event_loop()
    client = StageClient(CHUNK_BYTES, MAX_MESSAGE_BYTES, stream_bytes=PeerConfig().server.stream_bytes)
    tcp = TcpClient(tcp_port)
    endpoint = f"127.0.0.1:{grpc_port}"
    raw = RawClient(loop, endpoint)

    def via_grpc(t):
        return loop.run_until_complete(grpc_round_trip(client, endpoint, t))

    ratios = []
    try:
        floor = floor_seconds(via_grpc, repeats)
        figures["floor_ms"] = floor * 1e3
        print(f"a 16-element tensor's round trip (the per-call floor): {floor * 1e3:.2f} ms")
        print(
            f"{'size':>6} {'gRPC ms':>9} {'gRPC MB/s':>10} {'TCP ms':>9} {'TCP MB/s':>10} {'ratio':>7} {'ceiling':>8}"
            f" {'grpcio ms':>10} {'grpcio ratio':>13}"
        )
        for size in sizes:
            g, t, r = time_size(size, repeats, via_grpc, tcp.round_trip, raw.round_trip)
            ratios.append(t / g)
            ceiling = t / (t + floor)
            print(
                f"{size_name(size):>6} {g * 1e3:9.2f} {size / g:10.0f} {t * 1e3:9.2f} {size / t:10.0f} {t / g:7.3f} "
                f"{ceiling:8.3f} {r * 1e3:10.2f} {t / r:13.3f}",
                flush=True,
            )
            figures["ratio"] = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
            figures["min_ratio"] = min(ratios)
            figures[f"ratio_{size_name(size)}"] = t / g
            figures[f"ceiling_{size_name(size)}"] = ceiling
            figures[f"raw_{size_name(size)}"] = t / r
    finally:
        raw.close()
        loop.run_until_complete(client.close())
        loop.close()


def body(args: argparse.Namespace, figures: Figures) -> None:
    sizes = [float(s) for s in (args.sizes or ("0.25,1,4" if args.quick else "0.25,1,4,16,64")).split(",")]
    repeats = args.repeats or (3 if args.quick else 0)
    torch.set_num_threads(1)
    ctx = mp.get_context("fork")
    procs = []
    try:
        # the servers first: gRPC must not have started in this process when it forks
        grpc_proc, grpc_port = _start(grpc_server_main, ctx)
        procs.append(grpc_proc)
        tcp_proc, tcp_port = _start(tcp_server_main, ctx)
        procs.append(tcp_proc)
        compare(sizes, repeats, grpc_port, tcp_port, figures)
    finally:
        for proc in procs:
            proc.kill()
            proc.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="", help="tensor sizes in MiB (default 0.25,1,4,16,64; quick 0.25,1,4)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=0,
        help="timed round trips per size (default 30 below 1 MiB, 10 up to 16 MiB, 5 above; quick 3)",
    )
    add_quick(parser, "256 KiB, 1 and 4 MiB tensors, 3 timed round trips each")
    run(parser, body)


if __name__ == "__main__":
    main()
