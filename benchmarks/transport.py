"""Tensor transport benchmark: our gRPC round trip against raw TCP on loopback.

What is compared, for float32 tensors of 1, 4, 16 and 64 MiB:

* gRPC: the project's real wire path. The client is ``peer.client.StageClient`` (chunk_bytes 2 MiB,
  max_message_bytes 256 MiB): it encodes the tensor with ``protocols.codec.encode`` into a
  ``ForwardRequest`` and sends it unary when the serialized request fits in one chunk, else as a
  ``ForwardStream`` of ``Chunk`` messages (``protocols.chunking``). The server, a ``grpc.aio`` server
  built with ``peer.client.server_options`` in its own OS process, decodes the ``inputs`` tensor with
  ``codec.decode`` and answers it back encoded with ``codec.encode`` (an echo, chunked like the real
  servicer's answers). The client decodes the answer into a tensor.
* raw TCP: a plain socket echo server in its own OS process. The client sends an 8-byte length and
  ``tensor.numpy().tobytes()``, the server reads it fully into a preallocated buffer and sends it back,
  and the client rebuilds a tensor with ``torch.frombuffer(...).clone()``.

Each size gets 2 warm-up round trips, then N timed ones (10 up to 16 MiB, 5 at 64 MiB); the median
round trip gives the throughput, counted as payload MiB / seconds per round trip (MB below means MiB)
for both transports. The last line reads::

    ratio=<geometric mean of grpc/tcp over sizes> min_ratio=<...> grpc_64mb_MBps=<...> tcp_64mb_MBps=<...>

The goal is ratio >= 0.5. Run it from the repository root::

    python benchmarks/transport.py
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402
import torch  # noqa: E402

from peer.client import StageClient, server_options  # noqa: E402
from protocols import chunking, codec, stage_pb2, stage_pb2_grpc  # noqa: E402

MIB = 1 << 20
CHUNK_BYTES = 2 * MIB
MAX_MESSAGE_BYTES = 256 * MIB
SIZES_MIB = (1, 4, 16, 64)
WARMUP = 2
CALL_TIMEOUT_S = 60.0
START_TIMEOUT_S = 60.0
HEADER = struct.Struct("!Q")


def _repeats(size_mib: int) -> int:
    return 10 if size_mib <= 16 else 5


# ---- gRPC echo server (child process) ------------------------------------------------------


class EchoServicer(stage_pb2_grpc.StageServicer):
    """Forward / ForwardStream that decode the inputs tensor and answer it re-encoded, like a real stage."""

    @staticmethod
    def _echo(request: stage_pb2.ForwardRequest) -> stage_pb2.ForwardResponse:
        tensor = codec.decode(request.inputs)
        return stage_pb2.ForwardResponse(outputs=codec.encode(tensor, request.output_codec))

    async def Forward(self, request, context):
        return self._echo(request)

    async def ForwardStream(self, request_iterator, context):
        request = stage_pb2.ForwardRequest.FromString(await chunking.join(request_iterator, MAX_MESSAGE_BYTES))
        for chunk in chunking.split(self._echo(request).SerializeToString(), CHUNK_BYTES):
            yield chunk


async def _serve_grpc(conn) -> None:
    server = grpc.aio.server(options=server_options(MAX_MESSAGE_BYTES))
    stage_pb2_grpc.add_StageServicer_to_server(EchoServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    conn.send(port)
    conn.close()
    await server.wait_for_termination()


def grpc_server_main(conn) -> None:
    torch.set_num_threads(1)
    asyncio.run(_serve_grpc(conn))


# ---- raw TCP echo server (child process) ---------------------------------------------------


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    received = 0
    while received < len(view):
        n = sock.recv_into(view[received:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        received += n


def tcp_server_main(conn) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send(listener.getsockname()[1])
    conn.close()
    buffer = bytearray(max(SIZES_MIB) * MIB)
    header = bytearray(HEADER.size)
    while True:
        sock, _ = listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with sock:
            try:
                while True:
                    _recv_exactly(sock, memoryview(header))
                    (length,) = HEADER.unpack(header)
                    if length > len(buffer):
                        buffer = bytearray(length)
                    view = memoryview(buffer)[:length]
                    _recv_exactly(sock, view)
                    sock.sendall(header)
                    sock.sendall(view)
            except ConnectionError:
                continue


# ---- clients (parent process) --------------------------------------------------------------


class TcpClient:
    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=CALL_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.header = bytearray(HEADER.size)

    def round_trip(self, tensor: torch.Tensor) -> torch.Tensor:
        data = tensor.numpy().tobytes()
        self.sock.sendall(HEADER.pack(len(data)))
        self.sock.sendall(data)
        _recv_exactly(self.sock, memoryview(self.header))
        (length,) = HEADER.unpack(self.header)
        buffer = bytearray(length)
        _recv_exactly(self.sock, memoryview(buffer))
        return torch.frombuffer(buffer, dtype=tensor.dtype).clone().view(tensor.shape)

    def close(self) -> None:
        self.sock.close()


async def grpc_round_trip(client: StageClient, endpoint: str, tensor: torch.Tensor) -> torch.Tensor:
    request = stage_pb2.ForwardRequest(run_id="bench", stage=0, uid="x", inputs=codec.encode(tensor))
    response = await client.forward(endpoint, request, timeout=CALL_TIMEOUT_S)
    return codec.decode(response.outputs)


def _time_round_trips(call, tensor: torch.Tensor, repeats: int) -> float:
    for _ in range(WARMUP):
        out = call(tensor)
        if not torch.equal(out, tensor):
            raise AssertionError("echo returned a different tensor")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call(tensor)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _start(target, ctx) -> tuple[mp.Process, int]:
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(child_conn,), daemon=True)
    proc.start()
    child_conn.close()
    if not parent_conn.poll(START_TIMEOUT_S):
        raise TimeoutError(f"{target.__name__} did not report its port within {START_TIMEOUT_S:.0f}s")
    port = parent_conn.recv()
    parent_conn.close()
    return proc, port


def _stop(proc: mp.Process) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def run() -> list[tuple[int, float, float]]:
    # fork before any gRPC object exists in this process (as peer/cli.py does); children get their own loop.
    ctx = mp.get_context("fork")
    procs: list[mp.Process] = []
    loop = None
    try:
        grpc_proc, grpc_port = _start(grpc_server_main, ctx)
        procs.append(grpc_proc)
        tcp_proc, tcp_port = _start(tcp_server_main, ctx)
        procs.append(tcp_proc)

        loop = asyncio.new_event_loop()
        client = StageClient(chunk_bytes=CHUNK_BYTES, max_message_bytes=MAX_MESSAGE_BYTES)
        endpoint = f"127.0.0.1:{grpc_port}"
        tcp = TcpClient(tcp_port)
        results = []
        try:
            for size_mib in SIZES_MIB:
                tensor = torch.randn(size_mib * MIB // 4)
                repeats = _repeats(size_mib)
                grpc_s = _time_round_trips(
                    lambda t: loop.run_until_complete(grpc_round_trip(client, endpoint, t)), tensor, repeats
                )
                tcp_s = _time_round_trips(tcp.round_trip, tensor, repeats)
                results.append((size_mib, grpc_s, tcp_s))
                print(
                    f"{size_mib:>5} MB  grpc {grpc_s * 1e3:8.1f} ms {size_mib / grpc_s:8.0f} MB/s   "
                    f"tcp {tcp_s * 1e3:8.1f} ms {size_mib / tcp_s:8.0f} MB/s   ratio {tcp_s / grpc_s:.3f}",
                    flush=True,
                )
        finally:
            tcp.close()
            loop.run_until_complete(asyncio.wait_for(client.close(), 10))
        return results
    finally:
        if loop is not None:
            loop.close()
        for proc in procs:
            _stop(proc)


def main() -> None:
    print(
        f"round trips on 127.0.0.1, float32, MB = MiB, MB/s = payload / median round trip; torch threads {torch.get_num_threads()}"
    )
    print(f"{'size':>8}  {'grpc':>25}   {'tcp':>25}")
    results = run()
    ratios = [tcp_s / grpc_s for _, grpc_s, tcp_s in results]
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    size, grpc_s, tcp_s = results[-1]
    print(
        f"ratio={geomean:.3f} min_ratio={min(ratios):.3f} "
        f"grpc_{size}mb_MBps={size / grpc_s:.0f} tcp_{size}mb_MBps={size / tcp_s:.0f}"
    )


if __name__ == "__main__":
    main()
