"""On a GPU: a stage server's and an expert host's forward+backward MFU at the ~125M and ~1B Llama shapes, and
the activation path between two processes on one machine against plain copies through host memory.

For each shape (125m: hidden 768, 12 heads, MLP 2048, seq 1024, batch 8; 1b: TinyLlama-1.1B's block, hidden
2048, 32 heads, MLP 5632, seq 2048, batch 4):

1. stage: the runtime a stage server runs (peer.model.runtime.StageRuntime, measured as benchmarks/mfu.py
   does: a training forward with the graph kept, the backward into the accumulator, an optimizer step every
   `--accumulate` micro-batches), a middle stage of `--blocks` blocks, in `--dtype`. MFU = model FLOPs per
   second (6 x parameters x tokens plus the causal attention) over the device's dense peak (`--peak-tflops`,
   else by name: H100/H200 989 TFLOP/s bf16).
2. expert: the runtime an expert host runs (peer.model.expert.ExpertRuntime: a SwiGLU expert of the shape's
   hidden and MLP width): a training forward, then its backward, of `--expert-tokens` tokens arriving on the
   host's CPU, as requests do. It computes in float32 whatever the run's dtype (docs/architecture.md, known
   limits); its MFU is against the same bf16 peak.
3. path: a micro-batch's activations (batch x seq x hidden, in `--dtype`) from a tensor on this process's
   device to another process's device and back over the project's gRPC path (the real stage servicer
   plumbing of benchmarks/transport.py; device to host, encode, gRPC on loopback, decode, host to device
   there, and the same way back), against the four copies that round trip needs at the least (device to
   host and back, twice) in this process. path_ratio = copies / path: 1 means the path costs only its copies.

    python benchmarks/gpu.py [--device cuda] [--blocks 4] [--quick]

Last line: mfu=<the stage at the 1b shape> mfu_125m= mfu_1b= expert_mfu_125m= expert_mfu_1b=
path_ratio_125m= path_ratio_1b= ... status=ok. Goal (the data path issue): MFU >= 0.40. Without a GPU it
runs on the CPU at shapes scaled down (the same keys; MFU is nan without `--peak-tflops`), so it stays runnable.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.mfu import PEAKS, matmul_tflops, run_stage, sync  # noqa: E402
from benchmarks.report import Figures, add_quick, run  # noqa: E402
from benchmarks.transport import CHUNK_BYTES, MAX_MESSAGE_BYTES, _start, grpc_round_trip, grpc_server_main  # noqa: E402
from peer.config import PeerConfig, RunSpec  # noqa: E402
from peer.model.expert import ExpertRuntime  # noqa: E402
from peer.net.client import StageClient  # noqa: E402

SHAPES = {
    "125m": dict(hidden=768, heads=12, inter=2048, seq=1024, batch=8),
    "1b": dict(hidden=2048, heads=32, inter=5632, seq=2048, batch=4),
}
CPU_SHAPES = {  # the same keys on a CPU, scaled down so that the benchmark runs anywhere
    "125m": dict(hidden=128, heads=2, inter=384, seq=64, batch=2),
    "1b": dict(hidden=256, heads=4, inter=768, seq=64, batch=2),
}
RUN = {  # (cuda, quick): stage depth, timed micro-batches, accumulation, expert tokens, path round trips
    (True, False): dict(blocks=4, steps=8, accumulate=4, expert_tokens=8192, trips=10),
    (True, True): dict(blocks=2, steps=4, accumulate=2, expert_tokens=4096, trips=4),
    (False, False): dict(blocks=1, steps=4, accumulate=2, expert_tokens=512, trips=5),
    (False, True): dict(blocks=1, steps=2, accumulate=2, expert_tokens=256, trips=3),
}


def stage_mfu(args, shape: dict, peak: float) -> tuple[float, float]:
    """(MFU, TFLOP/s) of a stage server's forward+backward at `shape`."""
    stage_args = SimpleNamespace(**shape, device=args.device, dtype=args.dtype, accumulate=args.accumulate)
    stage_args.no_stash = False
    rate, flops, _ = run_stage(stage_args, args.blocks, args.steps)
    achieved = rate * flops / 1e12
    return (achieved / peak if peak else float("nan")), achieved


def expert_mfu(args, shape: dict, peak: float) -> tuple[float, float]:
    """(MFU, TFLOP/s) of an expert host's forward+backward of `args.expert_tokens` tokens at `shape`."""
    spec = RunSpec.from_dict(
        {
            "name": "gpu",
            "model": {"hidden_size": shape["hidden"], "num_layers": 1, "num_heads": shape["heads"]},
            "stages": {"num_stages": 1},
            "moe": {"num_experts": 1, "top_k": 1, "expert_size": shape["inter"]},
        }
    )
    rt = ExpertRuntime(spec, "0.0", args.device)
    params = sum(p.numel() for p in rt.params)
    x = torch.randn(args.expert_tokens, shape["hidden"])
    g = torch.randn(args.expert_tokens, shape["hidden"]) * 1e-3
    times = []
    for i in range(args.steps + 1):  # the first warms up
        started = time.perf_counter()
        rt.forward([f"u{i}"], [x], True)
        rt.backward([f"u{i}"], [x], [g], args.expert_tokens)
        sync(args.device)
        times.append(time.perf_counter() - started)
    achieved = 6.0 * params * args.expert_tokens / statistics.median(times[1:]) / 1e12
    return (achieved / peak if peak else float("nan")), achieved


async def _round_trip(client: StageClient, endpoint: str, tensor: torch.Tensor, device: str) -> torch.Tensor:
    """transport.py's round trip, from this process's device and back to it."""
    back = (await grpc_round_trip(client, endpoint, tensor.cpu())).to(device)
    sync(device)
    return back


def _copies(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """Device to host and back, twice: what a round trip through host memory needs at the least."""
    for _ in range(2):
        tensor = tensor.to("cpu", copy=True).to(device, copy=True)
    sync(device)
    return tensor


def path_ratio(args, port: int, shape: dict) -> tuple[float, float, float]:
    """(copies / path, path s, copies s): medians of round trips of one micro-batch's activations at `shape`."""
    dtype = getattr(torch, args.dtype)
    tensor = torch.randn(shape["batch"], shape["seq"], shape["hidden"]).to(args.device, dtype)
    loop = asyncio.new_event_loop()
    client = StageClient(CHUNK_BYTES, MAX_MESSAGE_BYTES, stream_bytes=PeerConfig().server.stream_bytes)
    endpoint = f"127.0.0.1:{port}"
    try:
        for _ in range(2):  # warm up, and check the echo is exact
            assert torch.equal(loop.run_until_complete(_round_trip(client, endpoint, tensor, args.device)), tensor)
            _copies(tensor, args.device)
        path, copies = [], []
        for _ in range(args.trips):  # alternating, so both see the same load
            started = time.perf_counter()
            loop.run_until_complete(_round_trip(client, endpoint, tensor, args.device))
            path.append(time.perf_counter() - started)
            started = time.perf_counter()
            _copies(tensor, args.device)
            copies.append(time.perf_counter() - started)
    finally:
        loop.run_until_complete(client.close())
        loop.close()
    p, c = statistics.median(path), statistics.median(copies)
    return c / p, p, c


def body(args: argparse.Namespace, figures: Figures) -> None:
    # the echo server first: it forks, and neither CUDA nor gRPC may have started in this process before that
    # (not even CUDA's device count: so the server decides on "auto" itself, and this process after it)
    server, port = _start(grpc_server_main, mp.get_context("fork"), args.device or "auto")
    try:
        measure(args, port, figures)
    finally:
        server.kill()
        server.join(5)


def measure(args: argparse.Namespace, port: int, figures: Figures) -> None:
    args.device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    cuda = args.device.startswith("cuda")
    for key, value in RUN[(cuda, args.quick)].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    if not cuda:
        print("on the CPU, not a GPU: shapes scaled down, MFU only with --peak-tflops")
    peak = args.peak_tflops or next((v for k, v in PEAKS.items() if k in name), 0.0)
    figures.update(device=name, dtype=args.dtype, blocks=args.blocks, peak_tflops=peak)
    figures["matmul_tflops"] = matmul_tflops(args.device, getattr(torch, args.dtype), 8192 if cuda else 512)
    for label, shape in (SHAPES if cuda else CPU_SHAPES).items():
        measure_shape(args, port, label, shape, peak, figures)
    figures["mfu"] = figures["mfu_1b"]


def measure_shape(args, port: int, label: str, shape: dict, peak: float, figures: Figures) -> None:
    """The three figures at one shape, into `figures` as each comes."""
    mfu, stage_tflops = stage_mfu(args, shape, peak)
    figures[f"mfu_{label}"], figures[f"stage_tflops_{label}"] = mfu, stage_tflops
    expert, expert_tflops = expert_mfu(args, shape, peak)
    figures[f"expert_mfu_{label}"], figures[f"expert_tflops_{label}"] = expert, expert_tflops
    ratio, path, copies = path_ratio(args, port, shape)
    figures[f"path_ratio_{label}"] = ratio
    mb = shape["batch"] * shape["seq"] * shape["hidden"] * torch.finfo(getattr(torch, args.dtype)).bits / 8e6
    print(
        f"{label} ({shape}): stage MFU {mfu:.3f} ({stage_tflops:.2f} TFLOP/s, {args.blocks} blocks), expert MFU "
        f"{expert:.3f} ({expert_tflops:.2f} TFLOP/s, {args.expert_tokens} tokens); a {mb:.1f} MB activation's "
        f"round trip: {path * 1e3:.1f} ms over gRPC between processes, {copies * 1e3:.1f} ms as four copies "
        f"({ratio:.3f})",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="", help="cuda:N or cpu (default: cuda:0 where there is a GPU, else cpu)")
    p.add_argument("--dtype", default="", help="stage dtype and activations' (default bfloat16 on a GPU, else float32)")
    p.add_argument("--blocks", type=int, help="blocks of the measured stage (default 4 on a GPU; quick 2)")
    p.add_argument("--steps", type=int, help="timed micro-batches of the stage and the expert (default 8)")
    p.add_argument("--accumulate", type=int, help="micro-batches per optimizer step (default 4)")
    p.add_argument("--expert-tokens", type=int, help="tokens of one expert call (default 8192 on a GPU)")
    p.add_argument("--trips", type=int, help="timed round trips of each path (default 10)")
    p.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (default: torch's choice)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="device peak (default: by GPU name)")
    add_quick(p, "a shallower stage and fewer timed micro-batches and round trips")
    run(p, body)


if __name__ == "__main__":
    main()
