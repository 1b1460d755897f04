"""Compression codecs: ours (torch, protocols/codec.py) against hivemind 1.1.12's, in one run.

For each codec: the time to encode and decode a tensor, the bytes it puts on the wire relative
to float32, and its error (relative RMS, and worst element relative to the tensor's absmax).
Two tensors: hidden states (a micro-batch of activations, normal-ish with outliers) and a
gradient-like tensor (heavy-tailed, values spanning several orders of magnitude).

hivemind's BLOCKWISE_8BIT needs bitsandbytes, which is not installed here, so it is skipped;
its UNIFORM_8BIT and QUANTILE_8BIT work with numpy < 2.4 (pinned in pyproject.toml).

    python benchmarks/codecs.py [--elements N] [--repeats R] [--quick]

Last line: key=value pairs (times in ms for the activations tensor).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from hivemind.compression import (
    CompressionInfo,
    Float16Compression,
    Quantile8BitQuantization,
    ScaledFloat16Compression,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import Figures, add_quick, run  # noqa: E402
from peer.server.piece_codec import PieceCodec  # noqa: E402
from protocols import codec, tensor_pb2  # noqa: E402

# the last line: key -> (codec, tensor, figure); ms is encode + decode
FIGURES = {
    "int8_ours_ms": ("ours int8 (averaging pieces)", "activations", "ms"),
    "int8_hivemind_uniform_ms": ("hivemind UNIFORM_8BIT", "activations", "ms"),
    "int8_hivemind_quantile_ms": ("hivemind QUANTILE_8BIT", "activations", "ms"),
    "fp16_ours_ms": ("ours fp16 (averaging pieces)", "activations", "ms"),
    "fp16_hivemind_ms": ("hivemind FLOAT16", "activations", "ms"),
    "int8_bytes_ratio": ("ours int8", "activations", "bytes_ratio"),
    "int8_ours_rel_rms": ("ours int8", "activations", "rel_rms"),
    "int8_hivemind_uniform_rel_rms": ("hivemind UNIFORM_8BIT", "activations", "rel_rms"),
    "int8_ours_grad_rel_rms": ("ours int8", "gradients", "rel_rms"),
    "int8_hivemind_uniform_grad_rel_rms": ("hivemind UNIFORM_8BIT", "gradients", "rel_rms"),
}


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


def pieces(chosen: PieceCodec):
    """The averaging path's codec (peer.server.piece_codec), on the flat tensor."""

    def run(t, repeats):
        flat = t.reshape(-1)
        enc_ms, data = _time(lambda: chosen.encode(flat), repeats)
        dec_ms, out = _time(lambda: chosen.decode(data, flat.numel()), repeats)
        return enc_ms, dec_ms, len(data), out

    return run


def hivemind(compression):
    def run(t, repeats):
        info = CompressionInfo.from_tensor(t)
        enc_ms, message = _time(lambda: compression.compress(t, info), repeats)
        dec_ms, out = _time(lambda: deserialize_torch_tensor(message), repeats)
        return enc_ms, dec_ms, len(message.buffer), out

    return run


def body(args: argparse.Namespace, figures: Figures) -> None:
    n = args.elements or (256 * 1024 if args.quick else 4 * 1024 * 1024)
    repeats = args.repeats or (2 if args.quick else 5)
    torch.manual_seed(0)
    hidden = 768
    activations = torch.randn(n // hidden, hidden) * (1 + 4 * (torch.rand(hidden) < 0.01))  # a few outlier channels
    gradients = torch.randn(n) * torch.exp(torch.randn(n) * 2) * 1e-3
    codecs = {
        "ours none": ours(tensor_pb2.NONE, args.block_size),
        "ours fp16": ours(tensor_pb2.FP16, args.block_size),
        "ours bf16": ours(tensor_pb2.BF16, args.block_size),
        "ours int8": ours(tensor_pb2.INT8, args.block_size),
        "ours fp16 (averaging pieces)": pieces(PieceCodec("fp16", args.block_size)),
        "ours int8 (averaging pieces)": pieces(PieceCodec("int8", args.block_size)),
        "hivemind FLOAT16": hivemind(Float16Compression()),
        "hivemind MEANSTD_16BIT": hivemind(ScaledFloat16Compression()),
        "hivemind UNIFORM_8BIT": hivemind(Uniform8BitQuantization()),
        "hivemind QUANTILE_8BIT": hivemind(Quantile8BitQuantization()),
    }
    print(f"{n} float32 elements ({n * 4 / 2**20:.0f} MiB), best of {repeats}, {torch.get_num_threads()} threads")
    print(
        f"{'codec':<26} {'tensor':<12} {'encode ms':>10} {'decode ms':>10} {'bytes/fp32':>11} {'rel rms':>9} {'max/absmax':>11}"
    )
    for name, measure in codecs.items():
        for label, t in (("activations", activations), ("gradients", gradients)):
            enc, dec, size, out = measure(t, repeats)
            out = out.reshape(t.shape).float()
            rms = ((out - t).norm() / t.norm()).item()
            worst = ((out - t).abs().max() / t.abs().max()).item()
            ratio = size / (t.numel() * 4)
            print(f"{name:<26} {label:<12} {enc:>10.1f} {dec:>10.1f} {ratio:>11.4f} {rms:>9.2e} {worst:>11.2e}")
            measured = {"ms": enc + dec, "bytes_ratio": ratio, "rel_rms": rms}
            for key, (codec_name, tensor, figure) in FIGURES.items():
                if (codec_name, tensor) == (name, label):
                    figures[key] = measured[figure]
    print("hivemind BLOCKWISE_8BIT: skipped (needs bitsandbytes, not installed)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=0, help="elements per tensor (default 4Mi; quick 256Ki)")
    parser.add_argument("--repeats", type=int, default=0, help="best of this many runs (default 5; quick 2)")
    parser.add_argument("--block-size", type=int, default=codec.DEFAULT_BLOCK_SIZE, help="our int8 block size")
    add_quick(parser, "tensors of 256Ki elements, best of 2")
    run(parser, body)


if __name__ == "__main__":
    main()
