"""The workers of benchmarks/averaging.py: one peer each, on loopback or inside one lab host, averaging the same
tensors through our all-reduce (`--path ours`: peer.server.allreduce over gRPC with mutual TLS, in this process)
or hivemind's DecentralizedAverager (`--path hivemind`: its averager and DHT processes, p2pd). Each round starts at
the parent's shared clock; its wall time, its CPU (all processes of the peer, from /proc) and whether the average
came out right go to result<i>.json."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

# worst expected error of the mean, as a fraction of the inputs' largest magnitude (two roundings per value)
TOLERANCE = {"none": 1e-5, "fp16": 1e-3, "bf16": 8e-3, "int8": 1.2e-2}
COLUMNS = 1024  # width of the template's matrices


def write_json(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # readers never see half a file


def wait_json(path: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {path.name}")
        time.sleep(0.05)
    return json.loads(path.read_text())


def template_shapes(size_mb: float) -> list[tuple[int, ...]]:
    """Shapes of about `size_mb` MB (1e6 bytes) of float32: four large matrices, two smaller ones and a vector."""
    elements = max(8, int(size_mb * 1e6 / 4))
    shapes: list[tuple[int, ...]] = []
    for fraction in (0.24, 0.24, 0.2, 0.2, 0.05, 0.05):
        rows = int(elements * fraction) // COLUMNS
        if rows:
            shapes.append((rows, COLUMNS))
    rest = elements - sum(r * c for r, c in shapes)
    return [*shapes, (rest,)] if rest else shapes


def _base(size_mb: float):
    import torch

    generator = torch.Generator().manual_seed(0)  # every worker makes the same base
    return [0.1 * torch.randn(shape, generator=generator) for shape in template_shapes(size_mb)]


def _spec(args: argparse.Namespace):
    from peer.config import RunSpec

    timeout = args.averaging_timeout
    averaging = {"averaging_timeout": timeout, "group_timeout": timeout, "read_timeout": 10.0, "max_attempts": 1}
    averaging["piece_bytes"] = int(os.environ.get("SWARMTRAIN_BENCH_PIECE_BYTES", 1 << 20))  # to try other sizes
    return RunSpec.from_dict({"name": "bench", "compression": {"averaging": args.compression}, "averaging": averaging})


def _cpu() -> float:
    from benchmarks.cputime import cpu_seconds

    return cpu_seconds([os.getpid()]) or 0.0


def _rss(field: str = "VmHWM") -> int:
    """Bytes of `field` (VmHWM: the largest resident set so far; VmRSS: now) of every process of this peer, added up."""
    from benchmarks.cputime import descendants_of

    total = 0
    for pid in [os.getpid(), *descendants_of(os.getpid())]:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))
        except (OSError, StopIteration):
            continue
    return total


def _timed_round(average, base: list, r: int, go: dict, args: argparse.Namespace) -> dict:
    """Round `r` at its agreed start, through `average(inputs, r) -> (group size, averaged tensors) or None`."""
    me, n = args.worker, args.peers
    inputs = [b + (me + r) for b in base]  # made before the start, so its time is not counted
    start = go["start"] + r * go["period"]
    late = time.time() - start
    if late < 0:
        time.sleep(-late)
    cpu = _cpu()
    result = average(inputs, r)
    finished, cpu = time.time(), _cpu() - cpu
    entry = {"round": r, "seconds": finished - start, "late": max(0.0, late), "cpu_s": cpu, "peak_rss": _rss()}
    if result is None:
        entry.update(ok=False, error="the round failed")
        return entry
    group, averaged = result
    if averaged is None:  # raw TCP: nothing averaged, only moved
        entry.update(group=group, ok=group == n)
        return entry
    mean = (n - 1) / 2 + r
    err = max(float((a - b - mean).abs().max()) for a, b in zip(averaged, base, strict=True))
    tol = TOLERANCE[args.compression] * (0.6 + n - 1 + r)  # 0.6 bounds |base| (0.1 * randn, 12M draws)
    entry.update(group=group, max_err=err, ok=group == n and err <= tol)
    if not entry["ok"]:
        entry["error"] = f"group of {group}, max error {err:.3g} (tolerance {tol:.3g})"
    return entry


def _rounds(average, args: argparse.Namespace, work: Path, base: list, go: dict) -> None:
    rounds, before = [], _rss("VmRSS")  # what the peer holds before its rounds: its code, the base tensors
    for r in range(args.rounds):
        rounds.append(_timed_round(average, base, r, go, args))
        rounds[-1]["rss_before"] = before
        print(json.dumps(rounds[-1]), flush=True)
        write_json(work / f"result{args.worker}.json", rounds)
    # stay until the parent has every result: a peer that leaves at once cuts the calls of slower peers
    wait_json(work / "done.json", args.averaging_timeout + 60)


def ours_worker(args: argparse.Namespace, work: Path) -> int:
    import asyncio

    import torch

    torch.set_num_threads(1)
    asyncio.run(_ours(args, work))
    return 0


async def _ours(args: argparse.Namespace, work: Path) -> None:
    import asyncio

    import grpc

    from benchmarks.credential import BenchCredential
    from dht.identity import Identity
    from peer.net.client import StageClient, server_options
    from peer.server.averaging import GradientAverager
    from protocols import averaging_pb2
    from protocols.averaging_frames import first_header

    identity = Identity.generate()
    credential = BenchCredential(work.parent, identity)
    averager = GradientAverager(_spec(args))

    async def average_call(frames, context):
        header = await first_header(frames, 30.0)
        async for frame in averager.allreduce.serve(header, frames, ""):
            yield frame

    server = grpc.aio.server(options=server_options(1 << 30))
    handler = grpc.stream_stream_rpc_method_handler(average_call)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("swarmtrain.Averaging", {"Average": handler}),)
    )
    port = server.add_secure_port(f"{args.ip}:0", credential.server_credentials())
    await server.start()
    base = _base(args.size_mb)
    me = {"peer": identity.peer_id, "endpoint": f"{args.ip}:{port}"}
    write_json(work / f"ready{args.worker}.json", me)
    loop = asyncio.get_running_loop()
    go = await loop.run_in_executor(None, wait_json, work / "go.json", args.start_timeout)
    endpoints = dict(zip(go["peers"], go["endpoints"], strict=True))
    client = StageClient(1 << 20, 1 << 30, security=credential)
    header = averaging_pb2.AverageHeader(run_id="bench")
    averager.allreduce.bind(loop, client, identity, endpoints.get, header, lambda: _EPOCH[0], bool)
    averager.loop = loop

    def average(inputs, r):
        _EPOCH[0] = r
        result = averager.average(inputs, 1, r, go["peers"])
        return None if result is None else (result.group_size, result.gradients)

    try:
        await loop.run_in_executor(None, _rounds, average, args, work, base, go)
    finally:
        await server.stop(1.0)
        averager.shutdown()


_EPOCH = [0]  # the round our worker is at (a replica's runtime epoch)


def hivemind_worker(args: argparse.Namespace, work: Path) -> int:
    import multiprocessing as mp

    mp.set_start_method("fork", force=True)  # hivemind forks
    import torch
    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import Float16Compression, NoCompression

    from dht.identity import Identity
    from dht.node import SwarmDHT
    from peer.process.lifetime import start_reaper

    start_reaper()  # before hivemind's processes: they, their p2p daemons and sockets end with this worker
    torch.set_num_threads(1)
    me = args.worker
    initial = [] if me == 0 else [wait_json(work / "dht0.json", args.start_timeout)["maddr"]]
    dht = SwarmDHT(Identity.generate(), initial, [f"/ip4/{args.ip}/tcp/0"], [], 60.0, 10.0)
    averager = None
    try:
        if me == 0:
            maddrs = [m for m in dht.visible_maddrs() if f"/ip4/{args.ip}/" in m]
            write_json(work / "dht0.json", {"maddr": maddrs[0]})
        base = _base(args.size_mb)
        compression = NoCompression() if args.compression == "none" else Float16Compression()
        averager = DecentralizedAverager(
            [torch.zeros_like(b) for b in base],
            dht=dht.dht,
            prefix="bench",
            start=True,
            target_group_size=args.peers,
            min_group_size=args.peers,
            min_matchmaking_time=2.0,
            request_timeout=1.5,
            allreduce_timeout=args.averaging_timeout,
            compression=compression,
        )
        write_json(work / f"ready{me}.json", {"peer": dht.peer_id, "endpoint": ""})
        go = wait_json(work / "go.json", args.start_timeout)

        def average(inputs, r):
            with averager.get_tensors() as tensors:
                for dst, src in zip(tensors, inputs, strict=True):
                    dst.copy_(src)
            try:
                gathered = averager.step(weight=1.0, timeout=args.averaging_timeout, allow_retries=False)
            except Exception as e:  # a failed round is a figure (not ok), not the end of the benchmark
                print(f"round {r} failed: {e}", flush=True)
                return None
            with averager.get_tensors() as tensors:
                return len(gathered or {}), [t.clone() for t in tensors]

        _rounds(average, args, work, base, go)
        return 0
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()


def tcp_worker(args: argparse.Namespace, work: Path) -> int:
    """Raw TCP, for the lab's own ceiling: each round, 2 x size / n bytes to every other peer and as much from each,
    all at once (a butterfly's bytes, with no reduction and nothing waiting on anything), over connections kept
    from round to round. A round is ok when every byte arrived."""
    import socket
    import threading

    n, share = args.peers, 2 * sum(4 * _numel(s) for s in template_shapes(args.size_mb)) // args.peers
    listener = socket.create_server((args.ip, 0))
    write_json(
        work / f"ready{args.worker}.json",
        {"peer": str(args.worker), "endpoint": f"{args.ip}:{listener.getsockname()[1]}"},
    )
    go = wait_json(work / "go.json", args.start_timeout)
    others = [e for i, e in enumerate(go["endpoints"]) if i != args.worker]
    incoming = []
    accepting = threading.Thread(target=lambda: incoming.extend(listener.accept()[0] for _ in others))
    accepting.start()
    outgoing = [socket.create_connection((e.rsplit(":", 1)[0], int(e.rsplit(":", 1)[1]))) for e in others]
    accepting.join()
    data, buffers = memoryview(bytearray(share)), [bytearray(1 << 20) for _ in incoming]

    def receive(sock, buffer) -> None:
        got = 0
        while got < share:
            got += sock.recv_into(buffer, min(len(buffer), share - got)) or share  # a closed peer ends the round
        received.append(got)

    def average(inputs, r):
        received.clear()
        threads = [threading.Thread(target=receive, args=(c, b)) for c, b in zip(incoming, buffers, strict=True)]
        threads += [threading.Thread(target=c.sendall, args=(data,)) for c in outgoing]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return (n if len(received) == n - 1 else 0), None

    received: list[int] = []
    rounds = []
    for r in range(args.rounds):
        entry = _timed_round(average, [], r, go, args)
        rounds.append(entry)
        write_json(work / f"result{args.worker}.json", rounds)
    wait_json(work / "done.json", args.averaging_timeout + 60)
    return 0


def _numel(shape) -> int:
    total = 1
    for d in shape:
        total *= d
    return total


def worker(args: argparse.Namespace) -> int:
    import logging

    from peer.process.lifetime import start_reaper

    if os.environ.get("SWARMTRAIN_BENCH_DEBUG"):  # a timeline of each round in the workers' logs
        logging.basicConfig(level=logging.DEBUG, format="%(created).3f %(name)s %(message)s")
        logging.getLogger("asyncio").setLevel(logging.WARNING)

    work = Path(args.workdir)
    if args.path == "tcp":
        return tcp_worker(args, work)
    if args.path == "ours":
        start_reaper()
        return ours_worker(args, work)
    return hivemind_worker(args, work)
