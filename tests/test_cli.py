"""The `peer` command line: fast help, --version, and one clear line (exit 2, no traceback) for bad input.

Real `peer` processes for what a user types; unit checks for the settings they build.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dht.identity import Identity
from peer.cli.options import peer_config, split_overrides
from peer.cli.parser import build_parser
from peer.config import ConfigError, PeerConfig, RunSpec, apply_override
from peer.data.corpus import load_corpus
from protocols.version import software_version

PEER = [sys.executable, "-m", "peer.cli.main"]


def peer(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*PEER, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


def refused(result: subprocess.CompletedProcess, *words: str) -> None:
    """Exit 2, one line naming the problem, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_help_answers_at_once_and_imports_no_torch_or_hivemind(tmp_path):
    started = time.monotonic()
    for command in ([], ["join"], ["coordinator"], ["status"]):
        result = peer(*command, "--help", cwd=tmp_path)
        assert result.returncode == 0 and "usage: peer" in result.stdout
    assert time.monotonic() - started < 4 * 2.0  # each well under a second on a quiet machine; 2 s under load
    probe = "import sys, peer.cli.main; print('torch' in sys.modules, 'hivemind' in sys.modules)"
    assert subprocess.check_output([sys.executable, "-c", probe], text=True).split() == ["False", "False"]
    # nor do the commands that only write the coordinator's admission files (invite, revoke)
    probe = "import sys, peer.coordinator.admission_files; print('torch' in sys.modules, 'hivemind' in sys.modules)"
    assert subprocess.check_output([sys.executable, "-c", probe], text=True).split() == ["False", "False"]


def test_version(tmp_path):
    result = peer("--version", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == f"peer (swarmtrain) {software_version()}"


def test_keygen_refuses_to_overwrite_without_force_and_checks_the_path(tmp_path):
    first = peer("keygen", "--identity", "k.pem", cwd=tmp_path)
    assert first.returncode == 0
    old_id = first.stdout.split("peer id ")[1].strip()
    again = peer("keygen", "--identity", "k.pem", cwd=tmp_path)
    refused(again, "exists already", old_id, "--force")
    assert Identity.load(tmp_path / "k.pem").peer_id == old_id
    forced = peer("keygen", "--identity", "k.pem", "--force", cwd=tmp_path)
    assert forced.returncode == 0 and old_id not in forced.stdout
    (tmp_path / "keys").mkdir()
    refused(peer("keygen", "--identity", "keys", cwd=tmp_path), "keys is a directory")


def test_an_identity_others_can_read_is_made_private(tmp_path, caplog):
    path = tmp_path / "open.pem"
    Identity.generate().save(path)
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="dht.identity"):
        Identity.load(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert "readable by others (mode 644); made it private" in caplog.text


def test_generate_and_export_name_a_file_that_is_not_ours(tmp_path):
    (tmp_path / "notes.safetensors").write_text("not a checkpoint")
    refused(peer("generate", "notes.safetensors", cwd=tmp_path), "notes.safetensors", "a file; give a checkpoint")
    refused(peer("export", str(tmp_path), "out", cwd=tmp_path), "no complete checkpoint there")


def test_join_and_status_refuse_what_cannot_work_in_one_line(tmp_path):
    good_id = Identity.generate().peer_id
    cases = [  # (arguments, words the one line must hold); run at once, each its own process
        (["join", "/ip4/127.0.0.1/tcp/1/p2p/nope", "--identity", "i.pem"], ["nope"]),
        (["join", "x", "--role", "trainer", "--device", "cpu"], ["--device", "trainer"]),
        (["join", "x", "--set", "training.lr=0.1"], ["training.lr", "run spec"]),
        (["join", "x", "--set", "relay.ports=10-5"], ["relay.ports"]),
        (["status", "/ip4/127.0.0.1/tcp/1/p2p/" + good_id], ["cannot reach 127.0.0.1:1"]),
    ]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda case: peer(*case[0], cwd=tmp_path), cases))
    for (_, words), result in zip(cases, results, strict=True):
        refused(result, *words)


def test_device_places_a_whole_stage_server():
    from peer.cli.options import place_device

    args = build_parser().parse_args(["join", "x", "--device", "cuda:1"])
    cfg = peer_config(args)
    place_device(args, cfg)
    assert cfg.parallel.devices == ["cuda:1"]
    args = build_parser().parse_args(["join", "x", "--experts", "2", "--device", "cuda:1"])
    cfg = peer_config(args)
    place_device(args, cfg)
    assert cfg.experts.device == "cuda:1" and cfg.parallel.devices == []


def test_announce_host_without_dht_port_announces_a_real_port():
    args = build_parser().parse_args(["join", "x", "--port", "40000", "--announce-host", "203.0.113.7"])
    cfg = peer_config(args)
    assert cfg.network.dht_announce_maddrs == ["/ip4/203.0.113.7/tcp/40001"]
    assert cfg.network.dht_host_maddrs == ["/ip4/0.0.0.0/tcp/40001"]
    args = build_parser().parse_args(["coordinator", "run.toml", "--announce-host", "203.0.113.7"])
    port = int(peer_config(args).network.dht_announce_maddrs[0].rsplit("/", 1)[1])
    assert port > 0


def test_set_on_the_coordinator_reaches_every_run_spec_field():
    spec_items, peer_items = split_overrides(
        ["training.lr=1e-3", "averaging.mode=local", "name=other", "network.record_ttl=20", "seed=7"]
    )
    assert peer_items == ["network.record_ttl=20"]
    spec = RunSpec()
    for item in spec_items:
        apply_override(spec, item)
    spec.validate()
    assert (spec.training.lr, spec.averaging.mode, spec.name, spec.seed) == (1e-3, "local", "other", 7)
    apply_override(PeerConfig(), peer_items[0])


def test_coordinator_set_is_validated_with_the_spec(tmp_path):
    spec = tmp_path / "run.toml"
    spec.write_text('name = "x"\n')
    result = peer("coordinator", str(spec), "--identity", "c.pem", "--set", "training.lr=-1", cwd=tmp_path)
    refused(result, "training.lr: must be positive")


def test_a_vocab_that_cannot_hold_the_bytes_is_refused():
    with pytest.raises(ConfigError, match="model.vocab_size: 100 cannot hold the byte-level tokenizer's 256 tokens"):
        RunSpec.from_dict({"model": {"vocab_size": 100}})


def test_data_dir_skips_hidden_directories_and_binary_files(tmp_path):
    data = tmp_path / "texts"
    (data / ".git" / "objects").mkdir(parents=True)
    (data / ".git" / "objects" / "pack").write_bytes(b"PACK" + b"x" * 50_000)
    (data / ".hidden.txt").write_text("secret " * 10_000)
    (data / "weights.bin").write_bytes(bytes(range(256)) * 400)
    (data / "sub").mkdir()
    for i in range(40):
        (data / "sub" / f"doc{i}.txt").write_text(f"document {i}: " + "plain words " * 300)
    corpus = load_corpus(str(data))
    assert corpus.num_files == 40
    text = bytes(corpus.train) + bytes(corpus.validation)
    assert b"PACK" not in text and b"secret" not in text and b"\x00\x01\x02" not in text


def test_relative_demo_workdir_is_made_absolute(tmp_path, monkeypatch):
    """`peer demo --workdir rel` passes paths to peers that run in that directory: they must be absolute."""
    import peer.cli.demo as demo

    monkeypatch.chdir(tmp_path)
    seen = {}

    class Stop(Exception):
        pass

    def fake_start(self, name, args):
        seen["workdir"], seen["args"] = self.workdir, args
        raise Stop

    monkeypatch.setattr(demo.Processes, "start", fake_start)
    monkeypatch.setattr(demo, "interrupt_on_signals", lambda: None)  # not in the test process
    monkeypatch.setattr(demo, "load_corpus", lambda: load_corpus(str(_tiny_corpus(tmp_path))))
    with pytest.raises(Stop):
        demo.run_demo(workdir="rel")
    assert seen["workdir"] == tmp_path / "rel" and seen["workdir"].is_absolute()
    assert seen["args"][1] == str(tmp_path / "rel" / "run.toml")


def _tiny_corpus(tmp_path: Path) -> Path:
    data = tmp_path / "tiny"
    data.mkdir()
    for i in range(40):
        (data / f"d{i}.txt").write_text("some text " * 200)
    return data


def test_the_demo_summary_shows_each_step_validated_once():
    """The trainer validates again at the end, often at the step of its last validation: one row, the last."""
    from rich.console import Console

    import peer.cli.demo as demo
    from peer.config import RunSpec

    evals = [
        {"epoch": 30, "loss": 3.0, "time": 1.0},
        {"epoch": 60, "loss": 2.5, "time": 2.0},
        {"epoch": 60, "loss": 2.4, "time": 3.0},  # the one at the end, a few samples later
    ]
    progress = {"step": 60, "samples": 100, "elapsed": 10.0, "evals": evals, "val": 2.4}
    console = Console(record=True, width=200)
    demo._summary(console, progress, 4.0, RunSpec.from_toml(demo.DEMO_SPEC), 2.35)
    text = console.export_text()
    rows = [line for line in text.splitlines() if "validation loss at step" in line]
    assert len(rows) == 2 and "step 30" in rows[0] and "3.000" in rows[0], rows
    assert "step 60" in rows[1] and "2.400" in rows[1], rows
    # the last word is the whole held-out set's, not the trainer's quick look
    assert "Final validation loss 2.350 nats/byte" in text, text
