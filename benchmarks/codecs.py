"""Compression codecs: ours (torch, protocols/codec.py) against hivemind 1.1.12's, in one run.

For each codec: the time to encode and decode a tensor, the bytes it puts on the wire relative
to float32, and its error (relative RMS, and worst element relative to the tensor's absmax).
Two tensors: hidden states (a micro-batch of activations, normal-ish with outliers) and a
gradient-like tensor (heavy-tailed, values spanning several orders of magnitude).

hivemind's BLOCKWISE_8BIT needs bitsandbytes, which is not installed here, so it is skipped;
its UNIFORM_8BIT and QUANTILE_8BIT work with numpy < 2.4 (pinned in pyproject.toml).

    python benchmarks/codecs.py [--elements N] [--repeats R]

Last line: key=value pairs (times in ms for the activations tensor).
"""

from __future__ import annotations

import argparse
import time

import torch
from hivemind.compression import (
    CompressionInfo,
    Float16Compression,
    Quantile8BitQuantization,
    ScaledFloat16Compression,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
)

from peer.averaging_codec import averaging_codec
from protocols import codec, tensor_pb2


def _time(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - started)
    return best * 1e3, out


def ours(kind: int, block_size: int):
    def run(t, repeats):
        enc_ms, message = _time(lambda: codec.encode(t, kind, block_size), repeats)
        dec_ms, out = _time(lambda: codec.decode(message), repeats)
        return enc_ms, dec_ms, len(message.data), out

    return run


def hivemind(compression):
    def run(t, repeats):
        info = CompressionInfo.from_tensor(t)
        enc_ms, message = _time(lambda: compression.compress(t, info), repeats)
        dec_ms, out = _time(lambda: deserialize_torch_tensor(message), repeats)
        return enc_ms, dec_ms, len(message.buffer), out

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=4 * 1024 * 1024, help="elements per tensor")
    parser.add_argument("--repeats", type=int, default=5, help="best of this many runs")
    parser.add_argument("--block-size", type=int, default=codec.DEFAULT_BLOCK_SIZE, help="our int8 block size")
    args = parser.parse_args()
    torch.manual_seed(0)
    n, hidden = args.elements, 768
    activations = torch.randn(n // hidden, hidden) * (1 + 4 * (torch.rand(hidden) < 0.01))  # a few outlier channels
    gradients = torch.randn(n) * torch.exp(torch.randn(n) * 2) * 1e-3
    codecs = {
        "ours none": ours(tensor_pb2.NONE, args.block_size),
        "ours fp16": ours(tensor_pb2.FP16, args.block_size),
        "ours bf16": ours(tensor_pb2.BF16, args.block_size),
        "ours int8": ours(tensor_pb2.INT8, args.block_size),
        "ours fp16 (hivemind API)": hivemind(averaging_codec("fp16", args.block_size)),
        "ours int8 (hivemind API)": hivemind(averaging_codec("int8", args.block_size)),
        "hivemind FLOAT16": hivemind(Float16Compression()),
        "hivemind MEANSTD_16BIT": hivemind(ScaledFloat16Compression()),
        "hivemind UNIFORM_8BIT": hivemind(Uniform8BitQuantization()),
        "hivemind QUANTILE_8BIT": hivemind(Quantile8BitQuantization()),
    }
    print(f"{n} float32 elements ({n * 4 / 2**20:.0f} MiB), best of {args.repeats}, {torch.get_num_threads()} threads")
    print(
        f"{'codec':<26} {'tensor':<12} {'encode ms':>10} {'decode ms':>10} {'bytes/fp32':>11} {'rel rms':>9} {'max/absmax':>11}"
    )
    results = {}
    for name, run in codecs.items():
        for label, t in (("activations", activations), ("gradients", gradients)):
            enc, dec, size, out = run(t, args.repeats)
            out = out.reshape(t.shape).float()
            rms = ((out - t).norm() / t.norm()).item()
            worst = ((out - t).abs().max() / t.abs().max()).item()
            results[(name, label)] = (enc, dec, size / (t.numel() * 4), rms, worst)
            print(
                f"{name:<26} {label:<12} {enc:>10.1f} {dec:>10.1f} {size / (t.numel() * 4):>11.4f} {rms:>9.2e} {worst:>11.2e}"
            )
    print("hivemind BLOCKWISE_8BIT: skipped (needs bitsandbytes, not installed)")

    def key(name):
        return results[(name, "activations")]

    def grad_rms(name):
        return results[(name, "gradients")][3]

    fields = {
        "int8_ours_ms": key("ours int8 (hivemind API)")[0] + key("ours int8 (hivemind API)")[1],
        "int8_hivemind_uniform_ms": key("hivemind UNIFORM_8BIT")[0] + key("hivemind UNIFORM_8BIT")[1],
        "int8_hivemind_quantile_ms": key("hivemind QUANTILE_8BIT")[0] + key("hivemind QUANTILE_8BIT")[1],
        "fp16_ours_ms": key("ours fp16 (hivemind API)")[0] + key("ours fp16 (hivemind API)")[1],
        "fp16_hivemind_ms": key("hivemind FLOAT16")[0] + key("hivemind FLOAT16")[1],
        "int8_bytes_ratio": key("ours int8")[2],
        "int8_ours_rel_rms": key("ours int8")[3],
        "int8_hivemind_uniform_rel_rms": key("hivemind UNIFORM_8BIT")[3],
        "int8_ours_grad_rel_rms": grad_rms("ours int8"),
        "int8_hivemind_uniform_grad_rel_rms": grad_rms("hivemind UNIFORM_8BIT"),
    }
    print(" ".join(f"{k}={v:.4g}" for k, v in fields.items()))


if __name__ == "__main__":
    main()
