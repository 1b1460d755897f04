"""Checkpoints: atomic writes (a killed writer leaves nothing that loads), checksums, export to a model directory."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from helpers.calls import info
from helpers.processes import descendants
from helpers.swarm import ROOT
from prometheus_client.parser import text_string_to_metric_families

from peer.config import RunSpec
from peer.coordinator import checkpoint
from peer.coordinator.export import export, load_directory
from peer.model.runtime import StageRuntime
from protocols.version import software_version

SPEC = RunSpec.from_dict(
    {
        "name": "ckpt",
        "seed": 4,
        "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64, "max_seq_len": 16},
        "stages": {"num_stages": 2},
        "training": {"micro_batch_size": 2, "seq_len": 16, "lr": 0.01, "warmup_steps": 0},
    }
)


def trained_stages() -> list[StageRuntime]:
    """Two stages after one optimizer step on a fixed micro-batch."""
    gen = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(0, 256, (2, 16), generator=gen), torch.randint(0, 256, (2, 16), generator=gen)
    first, last = StageRuntime(SPEC, 0), StageRuntime(SPEC, 1)
    hidden = first.forward("a", ids, None, True)
    grad_hidden, _, _ = last.backward("a", hidden, None, targets)
    first.backward("a", ids, grad_hidden, None)
    for rt in (first, last):
        grads, samples = rt.take_gradients()
        rt.apply_step(grads, samples, rt.taken_seq)
    return [first, last]


def parts_of(stages) -> list[checkpoint.Part]:
    return [
        checkpoint.Part(rt.name, rt.state_metadata(0), rt.state_tensors(), peer=f"peer{i}")
        for i, rt in enumerate(stages)
    ]


def test_checkpoint_round_trip_and_export_to_a_model_directory(tmp_path):
    stages = trained_stages()
    path = checkpoint.write(tmp_path, SPEC.to_dict(), SPEC.fingerprint(), 1, parts_of(stages))
    assert checkpoint.latest(tmp_path) == path
    manifest = checkpoint.read_manifest(path)
    assert manifest["step"] == 1 and manifest["parts"]["stage 1"]["peer"] == "peer1"
    # a replica loads the checkpoint's state as it would a donor's
    fresh = StageRuntime(SPEC, 1)
    fresh.load_state(*checkpoint.load_part(path, manifest, "stage 1"))
    for a, b in zip(fresh.params, stages[1].params, strict=True):
        assert torch.equal(a, b)
    assert fresh.epoch == 1
    # exported weights in the plain model give the swarm's loss on a fixed batch
    out = tmp_path / "exported"
    done = subprocess.run(
        [sys.executable, "-m", "peer.cli.main", "export", str(tmp_path), str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    model = load_directory(out)
    gen = torch.Generator().manual_seed(9)
    ids, targets = torch.randint(0, 256, (3, 16), generator=gen), torch.randint(0, 256, (3, 16), generator=gen)
    with torch.no_grad():
        plain = float(model(ids, targets))
    swarm = float(stages[1].forward("", stages[0].forward("", ids, None, False), targets, False))
    assert abs(plain - swarm) < 1e-6


def test_generate_samples_from_a_checkpoint_and_an_export(tmp_path):
    from peer.cli.generate import load_model, sample

    checkpoint.write(tmp_path, SPEC.to_dict(), SPEC.fingerprint(), 1, parts_of(trained_stages()))
    model = load_model(tmp_path)
    prompt = list(b"def ")
    a, b = sample(model, prompt, 20, seed=1), sample(model, prompt, 20, seed=1)
    assert len(a) == 20 and a == b  # the same seed, the same text
    assert sample(model, prompt, 20, temperature=0) == sample(model, prompt, 20, temperature=0, seed=2)
    export(tmp_path, tmp_path / "m")
    assert sample(load_model(tmp_path / "m"), prompt, 20, seed=1) == a
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "peer.cli.main",
            "generate",
            str(tmp_path),
            "--prompt",
            "def ",
            "--tokens",
            "20",
            "--seed",
            "1",
        ],
        capture_output=True,
        cwd=ROOT,
    )
    assert done.returncode == 0 and done.stdout.startswith(b"def "), done.stderr


def test_a_checkpoint_cut_off_mid_write_is_never_taken_for_whole(tmp_path):
    stages = trained_stages()
    good = checkpoint.write(tmp_path, SPEC.to_dict(), SPEC.fingerprint(), 1, parts_of(stages))
    # a writer of a big checkpoint, SIGKILLed while it writes
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, torch; from peer.coordinator import checkpoint; "
            "big = {f'param/w{i}': torch.randn(1024, 1024) for i in range(64)}; "
            "checkpoint.write(sys.argv[1], {'name': 'ckpt'}, 'x', 2, [checkpoint.Part('stage 0', {}, big)])",
            str(tmp_path),
        ],
        cwd=ROOT,
    )
    deadline = time.monotonic() + 60
    while not any(p.name.endswith(".safetensors") for t in tmp_path.glob(".tmp-*") for p in t.iterdir()):
        assert writer.poll() is None and time.monotonic() < deadline, "the writer finished before it could be killed"
        time.sleep(0.01)
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    assert checkpoint.latest(tmp_path) == good
    assert checkpoint.complete(tmp_path) == [good]
    # a checkpoint damaged after it was written is refused too, naming the file
    damaged = checkpoint.write(tmp_path, SPEC.to_dict(), SPEC.fingerprint(), 3, parts_of(stages))
    with open(damaged / "stage-0.safetensors", "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\0\0\0")
    assert checkpoint.latest(tmp_path) == good
    with pytest.raises(checkpoint.CheckpointError, match="stage-0.safetensors does not match its checksum"):
        checkpoint.read_manifest(damaged)
    manifest = json.loads((good / "manifest.json").read_text())
    assert manifest["spec_fingerprint"] == SPEC.fingerprint()


def test_the_runs_last_checkpoint_waits_for_every_stage_to_reach_the_last_step(tmp_path):
    """Periodic checkpoints come every checkpoint_every_steps of the furthest stage; the one at training.total_steps
    only once every stage is there (or coordinator.end_checkpoint_wait after the first got there), and only once."""
    from peer.config import PeerConfig
    from peer.coordinator.checkpointer import Checkpointer

    spec = RunSpec.from_dict({**SPEC.to_dict(), "training": {**SPEC.to_dict()["training"], "total_steps": 10}})
    settings = {"checkpoint_dir": str(tmp_path), "checkpoint_every_steps": 4, "end_checkpoint_wait": 0.5}
    ckpt = Checkpointer(spec, PeerConfig.from_dict({"coordinator": settings}), dht=None)
    assert ckpt.due(4, 3) and not ckpt.due(3, 3)
    ckpt.last_step = 8
    assert not ckpt.due(10, 9)  # stage 0 is a step short: not yet
    assert ckpt.due(10, 10)  # every stage at the last step
    ckpt.last_step = 10
    assert not ckpt.due(10, 10) and not ckpt.due(11, 10)  # once
    late = Checkpointer(spec, PeerConfig.from_dict({"coordinator": settings}), dht=None)
    assert not late.due(10, 9)
    deadline = time.monotonic() + 5
    while not late.due(10, 9):  # a stage that never gets there holds the last one back only so long
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    parts = parts_of(trained_stages())
    for step in range(1, 6):
        checkpoint.write(tmp_path, SPEC.to_dict(), SPEC.fingerprint(), step, parts, keep=2)
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step-00000004", "step-00000005"]


SWARM_SPEC = {
    "name": "ckpt-swarm",
    "seed": 5,
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64, "max_seq_len": 32},
    "stages": {"num_stages": 2},
    "training": {"micro_batch_size": 4, "seq_len": 32, "target_batch_size": 8, "total_steps": 100, "lr": 0.01},
}


def scrape(peer) -> dict[str, float]:
    """A peer's Prometheus metrics, parsed with prometheus-client's own parser: {sample name{labels}: value}."""
    address = peer.wait_for(r"Prometheus metrics at (http://\S+/metrics)", 60).group(1)
    text = urllib.request.urlopen(address, timeout=10).read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


# a Qwen3-family model directory (grouped-query heads, per-head q/k norms): only the coordinator reads it
QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def test_the_coordinator_checkpoints_a_running_swarm_and_a_killed_swarm_resumes_from_it(swarm):
    """A run of a model directory's config (Qwen3). Every 2 steps the coordinator pulls each stage's
    state from its server and writes a checkpoint; every peer serves Prometheus metrics whose counters
    move with the training; the checkpoint exports to a directory transformers loads. Then the whole
    swarm is killed; a coordinator started with --resume serves the checkpoint, and the run goes on."""
    root = swarm.workdir / "checkpoints"
    (swarm.workdir / "qwen3").mkdir()
    (swarm.workdir / "qwen3" / "config.json").write_text(json.dumps(QWEN3))
    spec = {**SWARM_SPEC, "model": {"path": str(swarm.workdir / "qwen3"), "max_seq_len": 32}}
    every = ["--set", "coordinator.checkpoint_every_steps=2", "--set", "coordinator.checkpoint_every_minutes=0"]
    # a stage's state (about 400 kB) comes to the coordinator in shards under a 200 kB message limit
    small = ["--set", "server.max_message_bytes=200000", "--set", "server.chunk_bytes=65536"]
    swarm.coordinator(
        spec, extra=["--checkpoints", str(root), "--set", "coordinator.report_period=0.5", *every, *small]
    )
    servers = [swarm.server(f"s{stage}", stage) for stage in range(2)]
    endpoints = [swarm.endpoint(s) for s in servers]
    idle = scrape(servers[1])
    trainer = swarm.trainer("t0", ["--seed", "3", "--max-inflight", "1", "--max-micro-batches", "16"])
    assert trainer.wait(240) == 0, trainer.output()[-3000:]
    _check_metrics(swarm, idle, scrape(servers[1]))
    deadline = time.monotonic() + 30
    while not any(checkpoint.read_manifest(p)["step"] >= 6 for p in checkpoint.complete(root)):
        assert time.monotonic() < deadline, swarm.peers[0].output()[-3000:]
        time.sleep(0.5)
    _check_checkpoint(root, endpoints)
    assert "Wrote checkpoint" in swarm.peers[0].output()
    _check_export(root, swarm.workdir / "exported")
    _resume(swarm, root, spec)


def _check_metrics(swarm, idle: dict, busy: dict) -> None:
    backward_ok = "swarm_requests_total{method=backward,outcome=ok}"
    assert idle.get(backward_ok, 0) == 0 and busy[backward_ok] == 16
    assert busy["swarm_request_seconds_count{method=backward}"] == 16
    assert busy["swarm_bytes_total{direction=received,kind=activations}"] > 16 * 4 * 32 * 32 * 4
    assert busy["swarm_rounds_total{outcome=alone}"] >= 7 and busy["swarm_step{}"] >= 8
    deadline = time.monotonic() + 30
    while scrape(swarm.peers[0]).get("swarm_total_samples_total{}", 0) < 16 * 4:  # the coordinator's view
        assert time.monotonic() < deadline, scrape(swarm.peers[0])
        time.sleep(0.5)


def _check_checkpoint(root, endpoints: list[str]) -> None:
    kept = checkpoint.complete(root)
    assert 1 <= len(kept) <= 3  # checkpoint_keep
    path = kept[-1]
    manifest = checkpoint.read_manifest(path)
    assert sorted(manifest["parts"]) == ["stage 0", "stage 1"]
    assert manifest["software"] == software_version()
    spec = RunSpec.from_dict(manifest["spec"])
    assert spec.model.architecture == "Qwen3ForCausalLM" and spec.model.qk_norm and spec.model.kv_heads == 1
    for stage, endpoint in enumerate(endpoints):
        entry = manifest["parts"][f"stage {stage}"]
        _, tensors = checkpoint.load_part(path, manifest, f"stage {stage}")
        state = info(endpoint)
        assert entry["peer"] == state.peer_id
        # the checkpoint holds the weights the server had after that step (its fingerprint of them)
        fingerprint = {f.epoch: f.values for f in state.history}[entry["epoch"]]
        names = [n for n, _ in StageRuntime(spec, stage).model.named_parameters()]
        sums = [v for n in names for v in (tensors[f"param/{n}"].double().sum().item(),)]
        assert sums == pytest.approx(fingerprint[0 : 2 * len(names) : 2], rel=1e-9, abs=1e-9)


def _check_export(root, out) -> None:
    """The newest checkpoint as a Hugging Face directory: transformers loads it, with our model's logits."""
    import transformers

    export(root, out)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        theirs, ours = model(input_ids=ids).logits, load_directory(out)(ids)
    assert float((theirs - ours).abs().max()) <= 1e-5 * float(theirs.abs().max())


def _resume(swarm, root, spec: dict) -> None:
    """Kill the whole swarm; a coordinator started with --resume serves the checkpoint, and the run goes on."""
    for peer in swarm.peers:  # the whole swarm goes down
        peer.kill(grace=0)
    manifest = checkpoint.read_manifest(checkpoint.latest(root))
    before = [e["loss"] for e in swarm.log("t0") if e["type"] == "micro_batch"]

    (swarm.workdir / "coordinator.json").unlink()
    swarm.coordinator(spec, extra=["--resume", str(root)])
    # (its remembered peers are all dead: it sees that at once and starts the DHT afresh)
    assert f"step {manifest['step']}" in swarm.peers[-1].wait_for(r"Resuming from .*", 60).group(0)
    for stage in range(2):
        server = swarm.server(f"b{stage}", stage)
        step = int(server.wait_for(r"Serving stage \d+ at \S+ from step (\d+)", 120).group(1))
        assert step == manifest["parts"][f"stage {stage}"]["epoch"] > 0
    resumed = swarm.trainer("tb", ["--seed", "4", "--max-inflight", "1", "--max-micro-batches", "4"])
    assert resumed.wait(240) == 0, resumed.output()[-3000:]
    after = [e["loss"] for e in swarm.log("tb") if e["type"] == "micro_batch"]
    # the resumed run's first losses continue where the old run was, not from scratch
    assert after[0] < before[0] - 0.5, (before, after)
    assert abs(after[0] - sum(before[-4:]) / 4) < 0.5, (before, after)


def test_resume_refuses_a_checkpoint_of_another_spec(tmp_path):
    from peer.config import PeerConfig
    from peer.coordinator.archive import Archive

    path = checkpoint.write(tmp_path, SPEC.to_dict(), SPEC.fingerprint(), 1, parts_of(trained_stages()))
    other = RunSpec.from_dict({**SPEC.to_dict(), "seed": 99})
    with pytest.raises(checkpoint.CheckpointError, match="another run spec"):
        Archive(path, other, PeerConfig(), dht=None)


def _points(timeline) -> int:
    """Points of the curves a coordinator saved in `timeline` (0 while it has saved none)."""
    try:
        return len(json.loads(timeline.read_text())["points"])
    except (OSError, ValueError, KeyError):
        return 0


def test_a_restarted_coordinator_rejoins_and_sees_the_run(swarm):
    """Training goes on while the coordinator is dead; restarted with its key, it rejoins and reports the step."""
    swarm.coordinator(SWARM_SPEC, extra=["--set", "coordinator.report_period=0.5"])
    endpoints = [swarm.endpoint(swarm.server(f"s{stage}", stage)) for stage in range(2)]
    trainer = swarm.trainer("t0", ["--seed", "3", "--max-inflight", "1", "--max-micro-batches", "24"])
    first = swarm.peers[0]
    deadline = time.monotonic() + 120
    timeline = swarm.workdir / "ckpt-swarm.timeline.json"
    # killed once it remembered its peers and its curves hold a point (a restart then has a past to show)
    while (
        info(endpoints[1]).epoch < 2 or not (swarm.workdir / "ckpt-swarm.peers.json").exists() or not _points(timeline)
    ):
        assert time.monotonic() < deadline and trainer.proc.poll() is None, trainer.output()[-3000:]
        time.sleep(0.3)
    first.known_pids.update(descendants(first.proc.pid))
    os.killpg(first.proc.pid, signal.SIGKILL)  # the coordinator's machine is gone: its process and its DHT
    assert trainer.wait(240) == 0, trainer.output()[-3000:]  # the run went on without its coordinator
    steps = [info(e).epoch for e in endpoints]
    assert steps[1] >= 12

    (swarm.workdir / "coordinator.json").unlink()
    restarted_at = time.time()
    swarm.coordinator(SWARM_SPEC, extra=["--set", "coordinator.report_period=0.5"])
    again = swarm.peers[-1]
    again.wait_for(r"Rejoined the swarm of run 'ckpt-swarm'", 60)
    line = again.wait_for(r"stage 0: 1 server\(s\) at step \d+, stage 1: 1 server\(s\) at step (\d+)", 60)
    assert int(line.group(1)) == steps[1]
    # its dashboard goes on from the curves and events the first one kept
    url = again.wait_for(r"Dashboard at (http://\S+/)", 10).group(1)
    state = json.loads(urllib.request.urlopen(url + "api/state", timeout=10).read())
    texts = [e["text"] for e in state["events"]]
    assert any(f"{endpoints[1]} " in t and "joined stage 1" in t for t in texts), texts
    assert any("restarted" in t for t in texts), texts
    assert state["history"][0]["time"] < restarted_at and max(p["step"] for p in state["history"]) >= 2


def test_the_demo_continues_a_held_out_snippet_with_its_last_checkpoint(tmp_path):
    """The demo's last words: its byte-level model, loaded from the checkpoint, continues a held-out snippet."""
    from io import StringIO
    from types import SimpleNamespace

    import numpy as np
    from rich.console import Console

    from peer.cli.demo import _final_validation, _last_checkpoint, _sample
    from peer.data.validation import from_bytes
    from peer.trainer.local import evaluate

    checkpoint.write(tmp_path, SPEC.to_dict(), SPEC.fingerprint(), 1, parts_of(trained_stages()))
    out = StringIO()
    held_out = SimpleNamespace(validation=np.frombuffer(b"x = 1\ndef main():\n    return 0\n" * 20, np.uint8))
    console = Console(file=out, width=200)
    model = _last_checkpoint(console, tmp_path, wait=1.0)
    _sample(console, model, held_out)
    said = out.getvalue()
    assert "continued by the trained model" in said and "def main():" in said and "[...]" in said, said
    # its final validation covers the whole held-out set (38 sequences here: one batch), whatever the batching
    final = _final_validation(console, model, held_out, SPEC)
    t = SPEC.training
    whole = from_bytes(held_out.validation, t.seq_len, 2, len(held_out.validation), "held out").batches
    assert math.isclose(final, evaluate(model, whole), rel_tol=1e-5), (final, evaluate(model, whole))
    assert "Final validation on the whole held-out set" in out.getvalue()
