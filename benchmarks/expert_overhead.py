"""What calling an expert over the network costs: ours and hivemind's, against the same module run locally.

For each hidden size (default 1024 and 4096), with batch 256 and one torch thread everywhere:

- local: forward + backward of the expert module in this process;
- ours: an expert host started as `peer join --experts 0.0` (a real process, with a coordinator),
  called over gRPC as a stage server calls it (Forward with the graph kept, then Backward with the
  output gradients only: the host kept the inputs);
- hivemind: hivemind's own MoE `Server` with the same module registered as a custom expert,
  called through its `RemoteExpert` over libp2p.

The module is the run's expert (SwiGLU, inner width 8/3 x hidden, the parameter count of
hivemind's 4x ffn). Neither side takes an optimizer step during the timing (hivemind's backend
gets no optimizer; our host's target batch is never reached), and both accumulate gradients as
the local baseline does (into .grad), so both ratios are the cost of the path. Then, throughput with 8 concurrent callers of `--concurrent-tokens` tokens each, against
our host with dynamic batching on and off (a second host whose batches hold one request).

Last line: `ours=<remote/local at the first hidden size> hivemind=<same> ...`.

    python benchmarks/expert_overhead.py [--hidden 1024,4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import torch

from peer.demo import Processes, dict_to_toml, loopback_join
from peer.moe import SwiGLU

BATCH = 256


def inner(hidden: int) -> int:
    return (8 * hidden // 3 + 63) // 64 * 64


def time_local(module, hidden: int, repeats: int) -> float:
    """Median seconds of forward + backward through `module` (a local module, or hivemind's RemoteExpert).

    Locally the gradients accumulate in .grad, as in training.
    """
    x = torch.randn(BATCH, hidden)
    g = torch.randn(BATCH, hidden)
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        xr = x.clone().requires_grad_(True)
        module(xr).backward(g)
        times.append(time.perf_counter() - started)
    if isinstance(module, torch.nn.Module):
        module.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


# ---- hivemind -------------------------------------------------------------------------------
def time_hivemind(hidden: int, repeats: int) -> tuple[float, float]:
    """(remote, local) seconds per forward+backward through hivemind's Server and RemoteExpert."""
    from hivemind import DHT
    from hivemind.moe.client.expert import create_remote_experts
    from hivemind.moe.expert_uid import ExpertInfo
    from hivemind.moe.server import Server
    from hivemind.moe.server.layers import name_to_block, name_to_input

    name = f"swt_swiglu_{hidden}"
    if name not in name_to_block:
        name_to_block[name] = lambda h: SwiGLU(h, inner(h))
        name_to_input[name] = lambda batch, h: torch.empty((batch, h))
    server = Server.create(
        expert_uids=["bench.0"],
        expert_cls=name,
        hidden_dim=hidden,
        optim_cls=None,  # the path alone, as our host during the timing
        max_batch_size=4096,
        device="cpu",
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        start=True,
    )
    dht = DHT(initial_peers=[str(a) for a in server.dht.get_visible_maddrs()], start=True)
    try:
        info = ExpertInfo("bench.0", server.dht.peer_id)
        (expert,) = create_remote_experts([info], dht)
        module = server.module_backends["bench.0"].module
        remote, local = [], []
        for _ in range(repeats):  # alternating, so both see the same load
            local.append(time_local(module, hidden, 1))
            remote.append(time_local(expert, hidden, 1))
        remote, local = statistics.median(remote), statistics.median(local)
    finally:
        dht.shutdown()
        server.shutdown()
    return remote, local


def _hivemind_child(conn, hiddens: list[int], repeats: int) -> None:
    torch.set_num_threads(1)
    conn.send({h: time_hivemind(h, repeats) for h in hiddens})
    conn.close()


# ---- ours ---------------------------------------------------------------------------------
def spec(hidden: int) -> dict:
    return {
        "name": "bench",
        "model": {"hidden_size": hidden, "num_layers": 1, "num_heads": hidden // 64, "intermediate_size": 64},
        "stages": {"num_stages": 1},
        "training": {"micro_batch_size": 1, "seq_len": 8, "target_batch_size": 10**9},
        "moe": {"num_experts": 1, "top_k": 1, "expert_size": inner(hidden)},
    }


def start_coordinator(procs: Processes, workdir: Path, hidden: int) -> str:
    (workdir / "run.toml").write_text(dict_to_toml(spec(hidden)))
    info = workdir / "coordinator.json"
    procs.start(
        "c", ["coordinator", "run.toml", "--identity", "c.pem", "--host", "127.0.0.1", "--info-file", str(info)]
    )
    Processes.wait_until(info.exists, 60, "the coordinator")
    return json.loads(info.read_text())["join"].split()[-1]


def start_host(procs: Processes, maddr: str, name: str, extra: list[str]) -> str:
    """An expert host of expert 0.0, alone on the machine besides the coordinator; its endpoint."""
    procs.start(name, loopback_join(maddr, name, "--experts", "0.0", *extra))
    Processes.wait_until(lambda: "Serving experts" in procs.log(name), 180, name)
    return procs.log(name).split("Serving experts 0.0 at ")[1].split()[0].rstrip(".;")


async def time_ours(endpoint: str, hidden: int, repeats: int) -> tuple[float, float]:
    """(remote, local) median seconds, a remote and a local forward+backward alternating, so both see the same load."""
    from peer.client import StageClient
    from protocols import codec, expert_pb2

    client = StageClient(2 * 2**20, 2**30, stream_bytes=2 * 2**20)
    x, g = torch.randn(BATCH, hidden), torch.randn(BATCH, hidden)
    module = SwiGLU(hidden, inner(hidden))
    times, local = [], []
    try:
        for i in range(repeats + 1):
            local.append(time_local(module, hidden, 1))
            started = time.perf_counter()
            header, payload = codec.encode_payload(x)
            request = expert_pb2.ExpertForwardRequest(run_id="bench", expert="0.0", uid=f"u{i}", train=True)
            request.inputs.CopyFrom(header)
            response, returned = await client.expert_forward(endpoint, request, {"inputs": payload}, timeout=120)
            codec.decode(response.outputs, payload=returned.get("outputs"))
            # as a stage server calls it: the host that did the forward kept the inputs
            request = expert_pb2.ExpertBackwardRequest(run_id="bench", expert="0.0", uid=f"u{i}", samples=1)
            header, payload = codec.encode_payload(g)
            request.grad_outputs.CopyFrom(header)
            payloads = {"grad_outputs": payload}
            response, returned = await client.expert_backward(endpoint, request, payloads, timeout=120)
            codec.decode(response.grad_inputs, payload=returned.get("grad_inputs"))
            times.append(time.perf_counter() - started)
    finally:
        await client.close()
    return statistics.median(times[1:]), statistics.median(local[1:])


async def concurrent_throughput(endpoint: str, hidden: int, tokens: int, callers: int, seconds: float) -> float:
    """Tokens/s of forward+backward with `callers` callers each sending `tokens` tokens at a time."""
    from peer.client import StageClient
    from protocols import codec, expert_pb2

    client = StageClient(2 * 2**20, 2**30, stream_bytes=2 * 2**20)
    done = 0
    stop = time.monotonic() + seconds

    async def caller(c: int) -> None:
        nonlocal done
        x, g = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
        i = 0
        while time.monotonic() < stop:
            uid = f"c{c}-{i}"
            header, payload = codec.encode_payload(x)
            request = expert_pb2.ExpertForwardRequest(run_id="bench", expert="0.0", uid=uid, train=True)
            request.inputs.CopyFrom(header)
            await client.expert_forward(endpoint, request, {"inputs": payload}, timeout=120)
            request = expert_pb2.ExpertBackwardRequest(run_id="bench", expert="0.0", uid=uid, samples=1)
            header, payload = codec.encode_payload(g)
            request.grad_outputs.CopyFrom(header)
            payloads = {"grad_outputs": payload}
            await client.expert_backward(endpoint, request, payloads, timeout=120)
            done += tokens
            i += 1

    started = time.monotonic()
    try:
        await asyncio.gather(*(caller(c) for c in range(callers)))
    finally:
        await client.close()
    return done / (time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", default="1024,4096", help="hidden sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=9, help="timed forward+backward calls per measurement")
    parser.add_argument("--callers", type=int, default=8, help="concurrent callers for the throughput figure")
    parser.add_argument("--concurrent-tokens", type=int, default=32, help="tokens per call of each concurrent caller")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each throughput measurement")
    args = parser.parse_args()
    mp.set_start_method("fork", force=True)
    torch.set_num_threads(1)
    hiddens = [int(h) for h in args.hidden.split(",")]
    # hivemind first, in a child process that is gone (with its server, DHT and daemons) before ours
    # starts: it forks, gRPC must not exist in a process before that, and its leftovers would load the CPU
    parent, child = mp.Pipe()
    proc = mp.Process(target=_hivemind_child, args=(child, hiddens, args.repeats))
    proc.start()
    hivemind = parent.recv()
    proc.join(60)
    results = {}
    for h in hiddens:
        with tempfile.TemporaryDirectory(prefix="swt-expert-bench-") as tmp:
            procs = Processes(Path(tmp))
            try:
                maddr = start_coordinator(procs, Path(tmp), h)
                endpoint = start_host(procs, maddr, "batching", [])
                ours, local = asyncio.run(time_ours(endpoint, h, args.repeats))
                tput = {
                    "batching": asyncio.run(
                        concurrent_throughput(endpoint, h, args.concurrent_tokens, args.callers, args.seconds)
                    )
                }
                procs.stop(["batching"])
                # the same host with batches of one request: what dynamic batching gives
                endpoint = start_host(
                    procs, maddr, "single", ["--set", f"experts.max_batch_tokens={args.concurrent_tokens}"]
                )
                tput["single"] = asyncio.run(
                    concurrent_throughput(endpoint, h, args.concurrent_tokens, args.callers, args.seconds)
                )
            finally:
                procs.stop()
        hm_remote, hm_local = hivemind[h]
        results[h] = dict(local=local, ours=ours, hm_remote=hm_remote, hm_local=hm_local, tput=tput)
        print(
            f"hidden {h}, batch {BATCH}: local {local * 1e3:.1f} ms, ours {ours * 1e3:.1f} ms "
            f"({ours / local:.3f}x); hivemind local {hm_local * 1e3:.1f} ms, remote {hm_remote * 1e3:.1f} ms "
            f"({hm_remote / hm_local:.3f}x); {args.callers} callers x {args.concurrent_tokens} tokens: "
            f"{tput['batching']:.0f} tokens/s batched, {tput['single']:.0f} unbatched "
            f"({tput['batching'] / tput['single']:.2f}x)",
            flush=True,
        )
    first = hiddens[0]
    parts = [
        f"ours={results[first]['ours'] / results[first]['local']:.3f}",
        f"hivemind={results[first]['hm_remote'] / results[first]['hm_local']:.3f}",
    ]
    for h in hiddens:
        r = results[h]
        parts += [
            f"ours_{h}={r['ours'] / r['local']:.3f}",
            f"hivemind_{h}={r['hm_remote'] / r['hm_local']:.3f}",
            f"batching_gain_{h}={r['tput']['batching'] / r['tput']['single']:.2f}",
        ]
    print(" ".join(parts))


if __name__ == "__main__":
    main()
