"""Run specs and peer settings: mistakes are refused with the field's name and the reason."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from peer.cli.options import peer_config
from peer.cli.parser import build_parser
from peer.config import ConfigError, RunSpec
from peer.model.llama import StageModel

BAD = [
    ({"training": {"micro_batch_size": 0}}, "training.micro_batch_size: must be positive"),
    ({"training": {"micro_batch_size": "16"}}, "training.micro_batch_size: expected an integer"),
    ({"model": {"hidden_size": 100, "num_heads": 3}}, "model.num_heads: 3 does not divide"),
    ({"stages": {"num_stages": 9}}, "stages.num_stages: 9 stages cannot split 4 blocks"),
    ({"stages": {"num_stages": 2, "boundaries": [5]}}, "stages.boundaries"),
    ({"training": {"target_batch_size": 4}}, "training.target_batch_size: 4 is smaller than one micro-batch"),
    ({"compression": {"activations": "int3"}}, "compression.activations: must be one of"),
    # int4 rounds too coarsely for activations; only what replicas average takes it (with error feedback)
    ({"compression": {"activations": "int4"}}, "compression.activations: must be one of none, fp16, bf16, int8,"),
    ({"compression": {"averaging": "int2"}}, "compression.averaging: must be one of none, fp16, bf16, int8, int4,"),
    ({"compression": {"averaging": "int4"}}, 'compression.averaging: int4 is for averaging.mode = "local"'),
    ({"trainig": {}}, "trainig: unknown field"),
    ({"name": "bad name!"}, "name: must be letters"),
    ({"admission": {"mode": "closed"}}, "admission.mode: must be one of open, allowlist, invite, off"),
    ({"admission": {"mode": "allowlist"}}, "admission.allowlist: allowlist mode needs at least one peer id"),
    ({"admission": {"allowlist": ["12D3KooWnot-a-key"]}}, "admission.allowlist.0.: peer id"),
    ({"admission": {"credential_ttl": 1}}, "admission.credential_ttl: must be at least 10 s"),
    ({"training": {"sync_trainers": 3}}, "training.sync_trainers: 3 trainers cannot share a step of 64 samples"),
    (
        {"training": {"sync_trainers": 2}, "averaging": {"mode": "local"}},
        "training.sync_trainers: synchronous mode averages gradients",
    ),
    ({"training": {"sync_wait": 0}}, "training.sync_wait: must be positive"),
    (
        {"training": {"sync_trainers": 1}, "moe": {"num_experts": 4}},
        "synchronous mode does not cover mixture-of-experts",
    ),
]


@pytest.mark.parametrize(("spec", "message"), BAD)
def test_bad_spec_names_the_field(spec, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        RunSpec.from_dict(spec)


def test_coordinator_refuses_a_bad_spec_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('name = "x"\n[training]\nlr = -1.0\n')
    result = subprocess.run(
        [sys.executable, "-m", "peer.cli.main", "coordinator", str(path), "--identity", str(tmp_path / "id.pem")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "training.lr: must be positive, got -1.0" in result.stderr


def test_flags_and_set_override_peer_settings(tmp_path):
    args = build_parser().parse_args(
        [
            "join",
            "/ip4/1.2.3.4/tcp/1/p2p/x",
            "--port",
            "5000",
            "--set",
            "network.record_ttl=30",
            "--set",
            "trainer.eval_batches=2",
        ]
    )
    cfg = peer_config(args)
    assert cfg.network.port == 5000 and cfg.network.record_ttl == 30.0 and cfg.trainer.eval_batches == 2
    with pytest.raises(ConfigError, match="network.nope: unknown field"):
        peer_config(build_parser().parse_args(["join", "x", "--set", "network.nope=1"]))
    with pytest.raises(ConfigError, match="network.port: expected an integer"):
        peer_config(build_parser().parse_args(["join", "x", "--set", "network.port='a'"]))
    # a record must outlive one announcement held up by a frozen DHT node (2 x 3 s + 2 s here)
    with pytest.raises(ConfigError, match=r"network.record_ttl: must be at least .* \(8 s\), got 5"):
        peer_config(build_parser().parse_args(["join", "x", "--set", "network.record_ttl=5"]))


def test_stages_compose_to_the_whole_model():
    spec = RunSpec.from_dict({"stages": {"num_stages": 2}})
    whole, parts = StageModel(spec), [StageModel(spec, s) for s in range(2)]
    inputs = torch.randint(0, 256, (2, 16))
    targets = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.allclose(whole(inputs, targets), parts[1](parts[0](inputs), targets), atol=1e-6)
    merged = {**parts[0].state_dict(), **parts[1].state_dict()}
    assert set(merged) == set(whole.state_dict())
