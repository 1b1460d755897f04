"""The data path never starves the swarm: tokens/s of a trainer's data pipeline alone (read through
`datasets`, tokenize with a trained byte-level BPE, pack) against the tokens/s one stage consumes
(forward and backward of a micro-batch), at the demo's scale and at the ~125M scale, on this machine.

The corpus is real text with no download: Python's standard library, written as JSON lines and
parquet (half each). The tokenizer is trained on it with `peer tokenizer train`'s code. The pipeline
is timed as a trainer uses it (peer.data.stream.TokenStream, micro-batches taken as fast as it
gives them, after its first); each stage is timed on its own (peer.model.runtime.StageRuntime, the
same calls a server makes). Goal: headroom = pipeline / stage >= 10 at both scales. Last line:
`pipeline_tps=... demo_stage_tps=... demo_headroom=... big_stage_tps=... big_headroom=...`.

    python benchmarks/data.py [--mb 64] [--seconds 20] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import Figures, add_quick, add_workdir, run, workdir  # noqa: E402
from peer.config import RunSpec  # noqa: E402
from peer.data import sources  # noqa: E402
from peer.data.corpus import stdlib_files  # noqa: E402
from peer.data.stream import TokenStream  # noqa: E402
from peer.data.tokenizer import train_tokenizer  # noqa: E402
from peer.data.training_text import texts_of  # noqa: E402
from peer.model.runtime import StageRuntime  # noqa: E402

GOAL = 10.0
# (hidden, layers, heads, kv heads, stages, micro-batch, seq): the demo's run and a ~125M Llama in 3 stages
DEMO = {"hidden": 192, "layers": 4, "heads": 6, "kv": 6, "stages": 2, "micro": 16, "seq": 128}
BIG = {"hidden": 768, "layers": 12, "heads": 12, "kv": 4, "stages": 3, "micro": 4, "seq": 512}


def write_corpus(root: Path, megabytes: float) -> int:
    """The standard library's files as documents, half in JSON lines, half in parquet; bytes written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    texts, size = [], 0
    for path in stdlib_files()[1]:
        text = path.read_text(errors="replace")
        texts.append(text)
        size += len(text)
        if size >= megabytes * 1e6:
            break
    half = len(texts) // 2
    with open(root / "docs.jsonl", "w") as f:
        for text in texts[:half]:
            f.write(json.dumps({"text": text}) + "\n")
    pq.write_table(pa.table({"text": texts[half:]}), root / "docs.parquet")
    return size


def pipeline_rate(corpus: Path, tokenizer, seq: int, micro: int, seconds: float) -> tuple[float, int]:
    """Tokens/s a trainer's stream hands out, timed after its first micro-batch; and the tokens timed."""
    files = sources.find_files(str(corpus))
    stream = TokenStream(sources.documents(files, "text"), tokenizer, seq, micro, seed=0, held_out_fraction=0.01)
    try:
        stream.next()
        started, tokens = time.perf_counter(), 0
        while time.perf_counter() - started < seconds:
            inputs, _ = stream.next()
            tokens += inputs.numel()
        return tokens / (time.perf_counter() - started), tokens
    finally:
        stream.close()


def stage_rate(size: dict, vocab: int, seconds: float) -> float:
    """Tokens/s one stage (the first: embedding and its blocks) trains: forward and backward of micro-batches."""
    spec = RunSpec.from_dict(
        {
            "model": {
                "vocab_size": vocab,
                "hidden_size": size["hidden"],
                "num_layers": size["layers"],
                "num_heads": size["heads"],
                "num_kv_heads": size["kv"],
                "intermediate_size": size["hidden"] * 8 // 3 // 64 * 64,
                "max_seq_len": size["seq"],
            },
            "stages": {"num_stages": size["stages"]},
            "training": {"micro_batch_size": size["micro"], "seq_len": size["seq"], "target_batch_size": 1 << 20},
        }
    )
    runtime = StageRuntime(spec, 0)
    ids = torch.randint(0, vocab, (size["micro"], size["seq"]))
    grad = torch.randn(size["micro"], size["seq"], size["hidden"])
    step = 0

    def once() -> None:
        nonlocal step
        step += 1
        runtime.forward(f"u{step}", ids, None, True)
        runtime.backward(f"u{step}", ids, grad, None)

    once()  # warm up
    started, tokens = time.perf_counter(), 0
    while time.perf_counter() - started < seconds or tokens == 0:
        once()
        tokens += ids.numel()
    return tokens / (time.perf_counter() - started)


def body(args: argparse.Namespace, figures: Figures) -> None:
    megabytes, seconds = (4.0, 5.0) if args.quick else (args.mb, args.seconds)
    vocab = 2048 if args.quick else 8192
    figures.update(machine=f"{torch.get_num_threads()}_threads", vocab=vocab)
    with workdir(args.workdir, "swarmtrain-data-") as work:
        size = write_corpus(work / "corpus", megabytes)
        figures["corpus_mb"] = size / 1e6  # at most the standard library's
        started = time.perf_counter()
        tokenizer = train_tokenizer(texts_of([str(work / "corpus")], "text", 4_000_000), vocab, work / "tok")
        print(
            f"corpus: {size / 1e6:.1f} MB; tokenizer of {tokenizer.vocab_size} trained in {time.perf_counter() - started:.1f} s"
        )
        for name, shape in (("demo", DEMO), ("big", BIG)):
            rate, tokens = pipeline_rate(work / "corpus", tokenizer, shape["seq"], shape["micro"], seconds)
            figures[f"{name}_pipeline_tps"] = rate
            print(f"{name}: pipeline {rate:,.0f} tokens/s ({tokens:,} tokens in {seconds:g} s)", flush=True)
            stage = stage_rate(shape, vocab, seconds)
            figures[f"{name}_stage_tps"] = stage
            figures[f"{name}_headroom"] = rate / stage
            print(f"{name}: one stage trains {stage:,.0f} tokens/s: headroom {rate / stage:.1f}x (goal >= {GOAL:g})")
    figures["goal_met"] = all(figures[f"{n}_headroom"] >= GOAL for n in ("demo", "big"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mb",
        type=float,
        default=64.0,
        help="megabytes of corpus, at most the standard library's (default 64; quick 4)",
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds each rate is timed (default 20; quick 5)")
    add_workdir(parser, "the corpus and tokenizer")
    add_quick(parser, "4 MB of corpus, a 2048-token tokenizer, 5 s per rate")
    run(parser, body)


if __name__ == "__main__":
    main()
