"""Real data: tokenizers trained on the run's data, files of every format streamed through `datasets`,
trainers whose streams differ and go on after a restart, validation worth the name, tracking."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from peer.config import ConfigError, RunSpec
from peer.data import sources, validation
from peer.data.corpus import CorpusError
from peer.data.stream import Position, TokenStream
from peer.data.tokenizer import EOT, bytes_tokenizer, load_tokenizer, pin_tokenizer, train_tokenizer

WORDS = [
    "the",
    "a",
    "swarm",
    "trains",
    "one",
    "model",
    "on",
    "many",
    "machines",
    "peers",
    "average",
    "gradients",
    "and",
    "send",
    "activations",
]


def sentences(count: int, seed: int) -> list[str]:
    """Documents of a small language: learnable, so a loss falls within a few steps."""
    rng = random.Random(seed)
    return [
        " ".join(f"{n}: {' '.join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))}." for _ in range(3))
        for n in range(count)
    ]


def write_corpus(root: Path, docs: list[str]) -> Path:
    """Half the documents as JSON lines, half as parquet, beside a .git/ and a binary file left out."""
    root.mkdir(parents=True)
    half = len(docs) // 2
    with open(root / "part.jsonl", "w") as f:
        for doc in docs[:half]:
            f.write(json.dumps({"text": doc, "id": len(doc)}) + "\n")
    pq.write_table(pa.table({"text": docs[half:], "n": list(range(len(docs) - half))}), root / "part.parquet")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n" * 100)
    (root / "image.bin").write_bytes(bytes(range(256)) * 8)
    return root


def test_data_files_by_format_leave_out_hidden_and_binary_and_bad_input_names_the_file(tmp_path):
    root = write_corpus(tmp_path / "c", sentences(40, 0))
    (root / "notes.txt").write_text("plain text\n" * 10)
    files = sources.find_files(str(root))
    assert [p.name for p in files.json] == ["part.jsonl"] and [p.name for p in files.parquet] == ["part.parquet"]
    assert [p.name for p in files.text] == ["notes.txt"] and files.binary == 1  # .git/ is not even looked at
    sources.check_files(files, "text")

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(CorpusError, match=r"a\.jsonl:1: no string field 'text' \(found: content\); see --text-field"):
        sources.check_files(sources.find_files(str(bad)), "text")
    sources.check_files(sources.find_files(str(bad)), "content")
    (bad / "a.jsonl").write_text("\n{not json\n")
    with pytest.raises(CorpusError, match=r"a\.jsonl:2: not JSON"):
        sources.check_files(sources.find_files(str(bad)), "text")
    (bad / "a.jsonl").unlink()
    pq.write_table(pa.table({"n": [1, 2], "title": ["a", "b"]}), bad / "t.parquet")
    with pytest.raises(CorpusError, match=r"t\.parquet: no string column 'text' \(string columns: title\)"):
        sources.check_files(sources.find_files(str(bad)), "text")
    (bad / "t.parquet").write_bytes(b"PAR1 this is no parquet")
    with pytest.raises(CorpusError, match=r"t\.parquet: cannot be read"):
        sources.check_files(sources.find_files(str(bad)), "text")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CorpusError, match="no text, JSON lines, parquet, arrow or saved dataset files"):
        sources.find_files(str(empty))


def test_a_tokenizer_trained_on_the_data_loads_in_transformers_and_the_spec_pins_it(tmp_path):
    import transformers

    docs = sentences(200, 1)
    tokenizer = train_tokenizer(docs, 300, tmp_path / "tok")
    assert tokenizer.vocab_size == 300 and tokenizer.eot is not None
    assert load_tokenizer(str(tmp_path / "tok")).fingerprint == tokenizer.fingerprint
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert hf.eos_token == EOT and hf.decode(hf(docs[0])["input_ids"]) == docs[0]
    assert list(tokenizer.encode_batch([docs[0]])[0]) == hf(docs[0])["input_ids"]

    spec = RunSpec.from_dict({"model": {"vocab_size": 256}, "data": {"tokenizer": str(tmp_path / "tok")}})
    with pytest.raises(ConfigError, match="has 300 tokens, more than model.vocab_size 256"):
        pin_tokenizer(spec)
    spec.model.vocab_size = 320
    assert pin_tokenizer(spec).data.tokenizer_fingerprint == tokenizer.fingerprint
    spec.data.tokenizer_fingerprint = "0123456789abcdef"
    with pytest.raises(ConfigError, match="but the spec pins 0123456789abcdef"):
        pin_tokenizer(spec)


def test_a_stream_packs_documents_skips_bad_ones_differs_by_seed_and_goes_on_from_its_position(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    with open(root / "d.jsonl", "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": f"<{i}>" + "x" * 20}) + "\n")
            if i % 20 == 5:
                f.write('{"text": broken\n' if i < 20 else json.dumps({"text": 7}) + "\n")
    documents = sources.documents(sources.find_files(str(root)), "text")

    def stream(seed: int, start: Position | None = None) -> TokenStream:
        return TokenStream(documents, bytes_tokenizer(), 16, 2, seed, start=start, shuffle_buffer=8, prefetch=4)

    first = stream(1)
    inputs, targets = first.next()
    assert inputs.shape == (2, 16) and torch.equal(inputs[0, 1:], targets[0, :-1])
    for _ in range(60):  # past the first pass over the data: into the second
        first.next()
    assert first.skipped >= 3  # the broken line and the number were passed over, not the trainer's end
    position = first.position
    first.close()
    assert position.epoch == 1 and position.documents > 0, position
    again, fresh, other = stream(1, position), stream(1), stream(2)
    (resumed, _), (start, _), (seeded, _) = again.next(), fresh.next(), other.next()
    for s in (again, fresh, other):
        s.close()
    # it goes on with the next document of the second pass's order (each pass is shuffled anew)
    order = documents.shuffle(seed=1, buffer_size=8)
    order.set_epoch(1)
    rows = [row["text"] for row in order][position.documents :]
    following = next(text for text in rows if isinstance(text, str))
    assert bytes(resumed[0].tolist()).decode().startswith(following[:16]), (following, resumed[0])
    assert not torch.equal(resumed, start)
    assert not torch.equal(seeded, start)  # another trainer, another order
    path = tmp_path / "pos.json"
    position.save(path, "data-a", 1)
    assert Position.load(path, "data-a") == position and Position.load(path, "data-b") == Position()


def test_validation_is_the_same_sequences_every_time_and_measures_bits_per_byte(tmp_path):
    data = torch.arange(100_000, dtype=torch.int64).remainder(251).to(torch.uint8).numpy()
    a = validation.from_bytes(data, 32, 4, 10_000, "held out")
    b = validation.from_bytes(data, 32, 4, 10_000, "held out")
    assert a.digest == b.digest and a.nbytes >= 10_000 - 32 * 4 and a.tokens == a.nbytes
    scores = validation.Scores.of([2.0] * len(a.batches), a)
    assert scores.loss == pytest.approx(2.0) and scores.perplexity == pytest.approx(math.exp(2.0))
    assert scores.bits_per_byte == pytest.approx(2.0 / math.log(2))  # a token a byte

    root = write_corpus(tmp_path / "c", sentences(400, 2))
    tokenizer = train_tokenizer(sentences(400, 2), 400, tmp_path / "tok")
    files = sources.find_files(str(root))
    built = [
        validation.from_documents(sources.documents(files, "text"), tokenizer, 32, 4, 2000, 0.25, "held out")
        for _ in range(2)
    ]
    assert built[0].digest == built[1].digest and built[0].nbytes >= 2000 * 0.9
    assert built[0].tokens < built[0].nbytes / 2  # a BPE token stands for several bytes here


def _spec(tokenizer: Path) -> dict:
    return {
        "name": "data",
        "seed": 3,
        "model": {
            "vocab_size": 512,
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "intermediate_size": 128,
            "max_seq_len": 32,
        },
        "stages": {"num_stages": 2},
        "training": {"micro_batch_size": 4, "seq_len": 32, "target_batch_size": 16, "total_steps": 1000, "lr": 0.01},
        "data": {"tokenizer": str(tokenizer), "validation_fraction": 0.05, "validation_bytes": 4096},
    }


def _digests(swarm, name: str) -> list[str]:
    return [e["data"] for e in swarm.log(name) if e["type"] == "micro_batch"]


def test_a_swarm_trains_on_jsonl_and_parquet_with_its_own_tokenizer(swarm):
    """`peer tokenizer train` on the run's data; a coordinator, 2 stages and 2 trainers on .jsonl + .parquet.
    The trainers' streams differ, the loss falls, every validation is the same sequences (the same for both,
    held out of their data), reported with perplexity and bits per byte, and as TensorBoard and W&B curves
    (W&B offline). A trainer started again with its key goes on with its stream; one whose tokenizer is not
    the run's is refused; bad data is named before joining."""
    corpus = write_corpus(swarm.workdir / "corpus", sentences(3000, 4))
    tok = swarm.workdir / "tok"
    trained = swarm.start("tokenizer", ["tokenizer", "train", str(corpus), "--vocab-size", "512", "--out", str(tok)])
    assert trained.wait(120) == 0, trained.output()[-3000:]
    assert "Wrote a byte-level BPE tokenizer of 512 tokens" in trained.output()
    swarm.coordinator(_spec(tok))
    for stage in range(2):
        swarm.endpoint(swarm.server(f"s{stage}", stage))
    common = ["--data", str(corpus), "--tokenizer", str(tok), "--eval-every", "3", "--max-micro-batches", "40"]
    tracked = ["--tensorboard", str(swarm.workdir / "tb"), "--wandb", "swarmtrain-test"]
    offline = {"WANDB_MODE": "offline", "WANDB_DIR": str(swarm.workdir), "WANDB_SILENT": "true"}
    trainers = [swarm.trainer("t0", common), swarm.trainer("t1", [*common, *tracked], env=offline)]
    for trainer in trainers:
        assert trainer.wait(240) == 0, trainer.output()[-3000:]
    assert "(1 JSON lines, 1 parquet; 1 binary left out)" in trainers[0].output()

    first, second = _digests(swarm, "t0"), _digests(swarm, "t1")
    assert len(first) == len(second) == 40 and not set(first) & set(second)  # streams seeded by peer id
    losses = [e["loss"] for e in swarm.log("t0") if e["type"] == "micro_batch"]
    assert sum(losses[-8:]) / 8 < sum(losses[:8]) / 8 - 1.0, losses
    evals = [e for name in ("t0", "t1") for e in swarm.log(name) if e["type"] == "eval"]
    assert len(evals) >= 4 and len({(e["sequences"], e["tokens"]) for e in evals}) == 1
    assert evals[0]["bytes"] >= 4096 * 0.9 and all(0 < e["bits_per_byte"] < 8 for e in evals)
    assert all(e["perplexity"] == pytest.approx(math.exp(e["loss"])) for e in evals)
    assert "bits per byte" in trainers[1].output()
    _check_tracking(swarm.workdir)

    # started again with its key: from where its stream stopped, not from the start
    again = swarm.trainer("t0", [*common[:4], "--max-micro-batches", "4"])
    assert again.wait(120) == 0, again.output()[-3000:]
    assert "from document" in again.output()
    resumed = _digests(swarm, "t0")[40:]
    assert len(resumed) == 4 and not set(resumed) & set(first)

    other = swarm.workdir / "other"
    assert (
        swarm.start("tok2", ["tokenizer", "train", str(corpus), "--vocab-size", "300", "--out", str(other)]).wait(120)
        == 0
    )
    refused = swarm.trainer("t2", ["--data", str(corpus), "--tokenizer", str(other)])
    assert refused.wait(60) == 2 and "is not the tokenizer of run 'data'" in refused.output()
    bad = swarm.workdir / "bad.jsonl"
    bad.write_text(json.dumps({"body": "no text field"}) + "\n")
    named = swarm.trainer("t3", ["--data", str(bad), "--tokenizer", str(tok)])
    assert named.wait(60) == 2 and "bad.jsonl:1: no string field 'text' (found: body)" in named.output()


def _check_tracking(workdir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = list((workdir / "tb").glob("events.out.tfevents.*"))
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert {"train/loss", "train/learning_rate", "train/samples_per_second", "swarm/servers"} <= tags, tags
    assert {"val/loss", "val/perplexity", "val/bits_per_byte"} <= tags, tags
    assert list((workdir / "wandb").glob("offline-run-*/run-*.wandb")), list((workdir / "wandb").iterdir())


def test_arrow_files_and_saved_datasets_stream_with_the_rest(tmp_path):
    import datasets

    root = tmp_path / "c"
    root.mkdir()
    datasets.Dataset.from_dict({"body": [f"saved {i}" for i in range(30)]}).save_to_disk(str(root / "saved"))
    table = pa.table({"body": pa.array([f"arrow {i}" for i in range(20)], type=pa.large_string())})
    with pa.OSFile(str(root / "part.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (root / "notes.jsonl").write_text("".join(json.dumps({"body": f"json {i}"}) + "\n" for i in range(10)))
    files = sources.find_files(str(root))
    assert [p.name for p in files.saved] == ["saved"] and [p.name for p in files.arrow] == ["part.arrow"]
    assert not files.text  # the saved dataset's own files are not read as text
    sources.check_files(files, "body")
    texts = [row["text"] for row in sources.documents(files, "body")]
    assert sorted(t.split()[0] for t in texts) == ["arrow"] * 20 + ["json"] * 10 + ["saved"] * 30
    with pytest.raises(CorpusError, match=r"saved: no string column 'text' \(columns: body\)"):
        sources.check_files(sources.DataFiles(root, saved=files.saved), "text")
