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
the local baseline does (into .grad), so both ratios are the cost of the path. Then, throughput
with `--callers` concurrent callers of `--concurrent-tokens` tokens each, against our host with
dynamic batching on and off (a second host whose batches hold one request).

Last line: `hivemind=<remote/local at the first hidden size> ... ours=<same> ...`.

    python benchmarks/expert_overhead.py [--hidden 1024,4096] [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import Figures, add_quick, run  # noqa: E402
from peer.cli.demo import Processes, dict_to_toml, loopback_join  # noqa: E402
from peer.model.moe import SwiGLU  # noqa: E402
from peer.process.lifetime import die_with_parent, start_reaper  # noqa: E402

BATCH = 256
# the sizes of a run, and of a --quick one; a flag given on the command line overrides both
FULL = {"hidden": "1024,4096", "repeats": 5, "callers": 8, "seconds": 8.0}
QUICK = {"hidden": "256", "repeats": 3, "callers": 4, "seconds": 2.0}


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


def _hivemind_child(conn, preexec, hiddens: list[int], repeats: int) -> None:
    preexec()  # we die with the benchmark
    start_reaper()  # and hivemind's DHT processes and p2p daemons with us
    # the fork kept report.run's handlers (SIGTERM raises KeyboardInterrupt): hivemind ends its task
    # pools with SIGTERM, and a pool that catches it waits for its output thread forever
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    torch.set_num_threads(1)
    conn.send({h: time_hivemind(h, repeats) for h in hiddens})
    conn.close()


def run_hivemind(hiddens: list[int], repeats: int) -> dict[int, tuple[float, float]]:
    """hivemind's (remote, local) seconds per hidden size, measured in a child process.

    The child is gone (with its server, DHT and daemons) before ours start: hivemind forks, gRPC
    must not exist in a process before that, and its leftovers would load the CPU.
    """
    parent, child = mp.Pipe(duplex=False)
    # made here: die_with_parent records this process as the parent the child must not outlive
    proc = mp.Process(target=_hivemind_child, args=(child, die_with_parent(), hiddens, repeats))
    proc.start()
    child.close()  # the child holds the only write end now: if it dies, recv fails at once
    try:
        try:
            found = parent.recv()
        except EOFError:
            proc.join(5)
            raise RuntimeError(f"hivemind's side ended (exit code {proc.exitcode}) without its figures") from None
        proc.join(60)  # it shuts hivemind's server and DHT down
        return found
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()


# ---- ours ---------------------------------------------------------------------------------
def spec(hidden: int) -> dict:
    return {
        "name": "bench",
        "model": {"hidden_size": hidden, "num_layers": 1, "num_heads": hidden // 64, "intermediate_size": 64},
        "stages": {"num_stages": 1},
        "training": {"micro_batch_size": 1, "seq_len": 8, "target_batch_size": 10**9},
        "moe": {"num_experts": 1, "top_k": 1, "expert_size": inner(hidden)},
        # plaintext, as our StageClient below speaks: this measures the data path, not TLS (benchmarks/security.py does)
        "admission": {"mode": "off"},
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


async def call_expert(client, endpoint: str, uid: str, x: torch.Tensor, g: torch.Tensor) -> int:
    """A training forward of `uid`, then its backward, as a stage server calls them; 1 if the inputs were resent.

    The backward leaves the inputs out (the host kept them); a host that no longer holds them (its
    batch's graph was dropped) answers "send the inputs", and the caller resends them, as
    peer/server/dispatch.py does.
    """
    import grpc

    from protocols import codec, expert_pb2

    header, payload = codec.encode_payload(x)
    request = expert_pb2.ExpertForwardRequest(run_id="bench", expert="0.0", uid=uid, train=True)
    request.inputs.CopyFrom(header)
    response, returned = await client.expert_forward(endpoint, request, {"inputs": payload}, timeout=120)
    codec.decode(response.outputs, payload=returned.get("outputs"))
    request = expert_pb2.ExpertBackwardRequest(run_id="bench", expert="0.0", uid=uid, samples=1)
    grad_header, grad_payload = codec.encode_payload(g)
    request.grad_outputs.CopyFrom(grad_header)
    payloads = {"grad_outputs": grad_payload}
    resent = 0
    try:
        response, returned = await client.expert_backward(endpoint, request, payloads, timeout=120)
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.FAILED_PRECONDITION or "send the inputs" not in (e.details() or ""):
            raise
        request.inputs.CopyFrom(header)
        payloads["inputs"] = payload
        response, returned = await client.expert_backward(endpoint, request, payloads, timeout=120)
        resent = 1
    codec.decode(response.grad_inputs, payload=returned.get("grad_inputs"))
    return resent


async def time_ours(endpoint: str, hidden: int, repeats: int) -> tuple[float, float]:
    """(remote, local) median seconds, a remote and a local forward+backward alternating, so both see the same load."""
    from peer.net.client import StageClient

    client = StageClient(2 * 2**20, 2**30, stream_bytes=2 * 2**20)
    x, g = torch.randn(BATCH, hidden), torch.randn(BATCH, hidden)
    module = SwiGLU(hidden, inner(hidden))
    times, local = [], []
    try:
        for i in range(repeats + 1):
            local.append(time_local(module, hidden, 1))
            started = time.perf_counter()
            await call_expert(client, endpoint, f"u{i}", x, g)
            times.append(time.perf_counter() - started)
    finally:
        await client.close()
    return statistics.median(times[1:]), statistics.median(local[1:])


async def concurrent_throughput(
    endpoint: str, hidden: int, tokens: int, callers: int, seconds: float
) -> tuple[float, int]:
    """(tokens/s of forward+backward with `callers` callers each sending `tokens` tokens at a time, inputs resent)."""
    from peer.net.client import StageClient

    client = StageClient(2 * 2**20, 2**30, stream_bytes=2 * 2**20)
    done = resent = 0
    stop = time.monotonic() + seconds

    async def caller(c: int) -> None:
        nonlocal done, resent
        x, g = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
        i = 0
        while time.monotonic() < stop:
            resent += await call_expert(client, endpoint, f"c{c}-{i}", x, g)
            done += tokens
            i += 1

    started = time.monotonic()
    try:
        await asyncio.gather(*(caller(c) for c in range(callers)))
    finally:
        await client.close()
    return done / (time.monotonic() - started), resent


def measure_ours(h: int, args) -> tuple[float, float, dict[str, tuple[float, int]]]:
    """(remote, local) seconds of our expert host at hidden size `h`, and its (tokens/s, resent) batched and single."""
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
    return ours, local, tput


def body(args: argparse.Namespace, figures: Figures) -> None:
    for key, full in FULL.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else full)
    mp.set_start_method("fork", force=True)
    torch.set_num_threads(1)
    hiddens = [int(h) for h in args.hidden.split(",")]
    hivemind = run_hivemind(hiddens, args.repeats)  # first: see run_hivemind
    figures["hivemind"] = hivemind[hiddens[0]][0] / hivemind[hiddens[0]][1]
    for h in hiddens:
        figures[f"hivemind_{h}"] = hivemind[h][0] / hivemind[h][1]
    for h in hiddens:
        ours, local, tput = measure_ours(h, args)
        hm_remote, hm_local = hivemind[h]
        batched, single = tput["batching"][0], tput["single"][0]
        print(
            f"hidden {h}, batch {BATCH}: local {local * 1e3:.1f} ms, ours {ours * 1e3:.1f} ms "
            f"({ours / local:.3f}x); hivemind local {hm_local * 1e3:.1f} ms, remote {hm_remote * 1e3:.1f} ms "
            f"({hm_remote / hm_local:.3f}x); {args.callers} callers x {args.concurrent_tokens} tokens: "
            f"{batched:.0f} tokens/s batched, {single:.0f} unbatched ({batched / single:.2f}x; "
            f"backwards that resent their inputs: {tput['batching'][1]} batched, {tput['single'][1]} unbatched)",
            flush=True,
        )
        if h == hiddens[0]:
            figures["ours"] = ours / local
        figures[f"ours_{h}"] = ours / local
        figures[f"batching_gain_{h}"] = batched / single


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def sized(name: str, what: str, **kw) -> None:
        key = name.lstrip("-")
        parser.add_argument(name, default=None, help=f"{what} (default {FULL[key]}; quick {QUICK[key]})", **kw)

    sized("--hidden", "hidden sizes, comma-separated")
    sized("--repeats", "timed forward+backward calls per measurement", type=int)
    sized("--callers", "concurrent callers for the throughput figure", type=int)
    parser.add_argument("--concurrent-tokens", type=int, default=32, help="tokens per call of each concurrent caller")
    sized("--seconds", "length of each throughput measurement", type=float)
    add_quick(parser, "hidden 256, 3 timed calls, 4 callers for 2 s")
    run(parser, body)


if __name__ == "__main__":
    main()
