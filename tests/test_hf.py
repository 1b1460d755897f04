"""Hugging Face families: our stage-split model equals transformers' whole model, and exports load there.

For each family a tiny random config (grouped-query attention, the family's biases and norms,
llama3 rope scaling for Llama), written as a model directory the coordinator reads: transformers'
model's weights load into our stages by name alone, and the stage-split forward and backward
(3 stages) equal transformers' within 1e-5 relative in fp32, by logits, loss, every parameter's
gradient and greedy decoding.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers.calls import client as admitted_client
from helpers.swarm import ROOT, admitting_its_peers
from safetensors.torch import load_file

from peer.config import ConfigError, RunSpec
from peer.config.model_dir import resolve
from peer.coordinator import checkpoint
from peer.coordinator.export import export, load_directory
from peer.coordinator.pretrained import pin_weights
from peer.model.llama import StageModel
from peer.model.runtime import StageRuntime

TINY = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
}
FAMILIES = {
    "llama": (
        transformers.LlamaConfig,
        {
            "attention_bias": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 50000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "mistral": (transformers.MistralConfig, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, {"use_sliding_window": False}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 24, "use_sliding_window": False}),
    "mixtral": (transformers.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
}


def hf_model(family: str, tmp_path, stages: int = 3, **extra) -> tuple[transformers.PreTrainedModel, RunSpec]:
    """transformers' model of a tiny random config, and a run spec whose model.path is its config.json."""
    config_class, family_extra = FAMILIES[family]
    config = config_class(**{**TINY, **family_extra, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers starts norms at 1 and biases at 0: move them, so they count
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                p.add_(torch.randn_like(p) * 0.1)
    config.save_pretrained(tmp_path)
    spec = RunSpec.from_dict(
        {
            "model": {"path": str(tmp_path), "max_seq_len": 32},
            "stages": {"num_stages": stages},
            "training": {"seq_len": 32},
        }
    )
    return model, resolve(spec)


def on_disk(model: transformers.PreTrainedModel, directory) -> dict[str, torch.Tensor]:
    """The weights as transformers saves them (Mixtral's experts one by one, as w1/w2/w3), what a run imports."""
    model.save_pretrained(directory)
    return load_file(str(directory / "model.safetensors"))


def hf_grad(grads: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """transformers' gradient of our parameter `name` (its Mixtral holds the experts fused in memory)."""
    if ".block_sparse_moe." not in name:
        return grads[name]
    layer = name.split(".block_sparse_moe.")[0]
    if name.endswith("gate.weight"):
        return grads[f"{layer}.mlp.gate.weight"]
    expert, part = int(name.split(".experts.")[1].split(".")[0]), name.split(".")[-2]
    if part == "w2":
        return grads[f"{layer}.mlp.experts.down_proj"][expert]
    gate_up = grads[f"{layer}.mlp.experts.gate_up_proj"][expert]
    return gate_up.chunk(2, dim=0)[0 if part == "w1" else 1]


def stages_of(spec: RunSpec, weights: dict[str, torch.Tensor]) -> list[StageModel]:
    """The run's stages, each loading its part of `weights` by name, strictly."""
    stages = []
    for s in range(spec.stages.num_stages):
        stage = StageModel(spec, s)
        mine = {k: v for k, v in weights.items() if k in stage.state_dict()}
        stage.load_state_dict(mine, strict=True)
        stages.append(stage)
    assert sum(len(s.state_dict()) for s in stages) == len(weights)  # every tensor found a stage
    return stages


def close(ours: torch.Tensor, theirs: torch.Tensor, rel: float = 1e-5) -> bool:
    ours, theirs = ours.detach(), theirs.detach()
    return float((ours - theirs).abs().max()) <= rel * max(float(theirs.abs().max()), 1e-12)


def greedy(step, ids: torch.Tensor, tokens: int) -> list[int]:
    out = ids
    with torch.no_grad():
        for _ in range(tokens):
            out = torch.cat([out, step(out)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_stage_split_forward_and_backward_equal_transformers(family, tmp_path):
    hf, spec = hf_model(family, tmp_path)
    assert spec.model.architecture == type(hf).__name__ and spec.model.kv_heads == 2
    stages = stages_of(spec, on_disk(hf, tmp_path))
    gen = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(0, 300, (2, 24), generator=gen), torch.randint(0, 300, (2, 24), generator=gen)

    theirs = hf(input_ids=ids).logits
    hf_loss = F.cross_entropy(theirs.reshape(-1, 300), targets.reshape(-1))
    hf_loss.backward()
    hidden = stages[1](stages[0](ids))
    logits = stages[2](hidden)
    loss = stages[2](hidden, targets)
    loss.backward()

    assert close(logits, theirs) and close(loss, hf_loss)
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    for stage in stages:
        for name, p in stage.named_parameters():
            assert close(p.grad, hf_grad(hf_grads, name)), name
    prompt = ids[:1, :6]
    ours = greedy(lambda x: stages[2](stages[1](stages[0](x))), prompt, 8)
    assert ours == greedy(lambda x: hf(input_ids=x).logits, prompt, 8)


def test_tied_embeddings_on_one_stage_equal_transformers_and_are_refused_across_stages(tmp_path):
    hf, spec = hf_model("qwen2", tmp_path, stages=1, tie_word_embeddings=True)
    with pytest.raises(ConfigError, match="model.tie_embeddings: .*first and the last"):
        resolve(RunSpec.from_dict({"model": {"path": str(tmp_path), "max_seq_len": 32}, "training": {"seq_len": 32}}))
    (whole,) = stages_of(spec, hf.state_dict())
    assert whole.lm_head.weight is whole.model.embed_tokens.weight
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    F.cross_entropy(hf(input_ids=ids).logits.reshape(-1, 300), ids.reshape(-1)).backward()
    whole(ids, ids).backward()
    assert close(whole.model.embed_tokens.weight.grad, hf.model.embed_tokens.weight.grad)


def write_checkpoint(spec: RunSpec, root, steps: int = 1) -> list[StageRuntime]:
    """A checkpoint of the run's stages after `steps` optimizer steps on fixed micro-batches."""
    stages = [StageRuntime(spec, s) for s in range(spec.stages.num_stages)]
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        ids = torch.randint(0, 256, (2, 16), generator=gen)
        hidden = [ids]
        for s in stages[:-1]:
            hidden.append(s.forward(f"u{step}", hidden[-1], None, True))
        grad, _, _ = stages[-1].backward(f"u{step}", hidden[-1], None, ids)
        for s, inputs in zip(reversed(stages[:-1]), reversed(hidden[:-1]), strict=True):
            grad, _, _ = s.backward(f"u{step}", inputs, grad, None)
        for s in stages:
            grads, samples = s.take_gradients()
            s.apply_step(grads, samples, s.taken_seq)
    parts = [checkpoint.Part(s.name, s.state_metadata(0), s.state_tensors(), peer="p") for s in stages]
    checkpoint.write(root, spec.to_dict(), spec.fingerprint(), steps, parts)
    return stages


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_export_loads_in_transformers_with_the_runs_loss_and_generates(family, tmp_path):
    _, spec = hf_model(family, tmp_path / "src")
    stages = write_checkpoint(spec, tmp_path / "ckpt")
    out = tmp_path / "exported"
    done = subprocess.run(
        [sys.executable, "-m", "peer.cli.main", "export", str(tmp_path / "ckpt"), str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(model).__name__ == spec.model.architecture
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "Swarmtrain: bytes é"
    assert tokenizer(text)["input_ids"] == list(text.encode()) and tokenizer.decode(list(text.encode())) == text

    gen = torch.Generator().manual_seed(9)
    ids, targets = torch.randint(0, 256, (3, 16), generator=gen), torch.randint(0, 256, (3, 16), generator=gen)
    with torch.no_grad():
        hidden = ids
        for s in stages[:-1]:
            hidden = s.forward("", hidden, None, False)
        swarm = float(stages[-1].forward("", hidden, targets, False))
        theirs = float(F.cross_entropy(model(input_ids=ids).logits.reshape(-1, 300), targets.reshape(-1)))
    assert abs(theirs - swarm) <= 1e-4 * swarm
    prompt = ids[:1, :4]
    hf_greedy = model.generate(prompt, max_new_tokens=6, do_sample=False)[0, 4:].tolist()
    assert hf_greedy == greedy(lambda x: load_directory(out)(x), prompt, 6)
    done = subprocess.run(
        [sys.executable, "-m", "peer.cli.main", "generate", str(out), "--prompt", "ab", "--tokens", "5"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0 and done.stdout.startswith("ab"), done.stderr


def test_export_shards_big_models_with_an_index_and_refuses_a_used_directory(tmp_path):
    spec = RunSpec.from_dict(
        {"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "max_seq_len": 16}, "training": {"seq_len": 16}}
    )
    write_checkpoint(spec, tmp_path / "ckpt")
    count, params, files = export(tmp_path / "ckpt", tmp_path / "out", max_shard_bytes=100_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len([f for f in files if f.startswith("model-")]) >= 3 and len(index["weight_map"]) == count
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert sum(p.numel() for p in model.parameters()) == params
    with pytest.raises(checkpoint.CheckpointError, match="not an empty directory"):
        export(tmp_path / "ckpt", tmp_path / "out")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "'GPT2LMHeadModel' is not a supported architecture (supported: Llama"),
        ({"architectures": ["Qwen2MoeForCausalLM"]}, "'Qwen2MoeForCausalLM' is not a supported architecture"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 16}, "sliding_window 16 is shorter than"),
        ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, "use_sliding_window = true"),
        ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn"}}, "rope type 'yarn'"),
        ({"architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": None}, "num_hidden_layers"),
    ],
)
def test_a_model_directory_we_cannot_train_is_refused_naming_the_file_and_field(tmp_path, config, message):
    base = {**TINY, "num_hidden_layers": 2, "max_position_embeddings": 64}
    data = {**base, **config}
    if data["num_hidden_layers"] is None:
        del data["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    spec = RunSpec.from_dict({"model": {"path": str(tmp_path), "max_seq_len": 32}, "training": {"seq_len": 32}})
    with pytest.raises(ConfigError, match=str(tmp_path / "config.json")) as caught:
        resolve(spec)
    assert message in str(caught.value)


def test_the_coordinator_refuses_pickled_weights_in_one_line(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({**TINY, "architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "model" / "pytorch_model.bin").write_bytes(b"")
    (tmp_path / "run.toml").write_text(f'[model]\npath = "{tmp_path / "model"}"\n')
    done = subprocess.run(
        [sys.executable, "-m", "peer.cli.main", "coordinator", str(tmp_path / "run.toml")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "pytorch_model.bin: pickled weights are never loaded; convert them to safetensors" in done.stderr


def pretrained_run(name: str, directory, stages: int) -> dict:
    """The run spec of a small run that starts from the model directory's weights."""
    return {
        "name": name,
        "model": {"path": str(directory), "max_seq_len": 32},
        "stages": {"num_stages": stages},
        "training": {"micro_batch_size": 2, "seq_len": 32, "target_batch_size": 4},
    }


def test_a_run_from_pretrained_weights_serves_each_stage_its_tensors_and_exports_them_bit_for_bit(swarm):
    """Only the coordinator has the model directory: each server loads its own stage's tensors from it,
    equal to the file's bit for bit, and a checkpoint of them exports to the same tensors."""
    directory = swarm.workdir / "llama"
    hf, _ = hf_model("llama", directory, stages=2)
    hf.save_pretrained(directory)  # config.json and model.safetensors (float32)
    original = load_file(str(directory / "model.safetensors"))
    spec = admitting_its_peers(pretrained_run("pretrained", directory, stages=2))  # the spec the coordinator runs
    swarm.coordinator(spec)
    swarm.peers[0].wait_for(r"Serving the pretrained weights of \S+ \(F32\)", 30)
    # stage 1's state (about 1.4 MB) must come in shards under a 200 kB message limit
    small = ["--set", "server.max_message_bytes=200000", "--set", "server.chunk_bytes=65536"]
    servers = [swarm.server("s0", 0), swarm.server("s1", 1, [*small, "--set", "server.stream_bytes=65536"])]
    endpoints = [swarm.endpoint(s) for s in servers]
    for stage, server in enumerate(servers):
        server.wait_for(rf"Loaded the state of stage {stage} \(step 0\)", 30)
    pinned = pin_weights(resolve(RunSpec.from_dict(spec)))

    async def states():
        client = admitted_client(endpoints[0], 2**20, 2**30)
        try:
            return [await client.get_state(e, "pretrained", s, timeout=30) for s, e in enumerate(endpoints)]
        finally:
            await client.close()

    import asyncio

    fetched = asyncio.run(states())
    served = {k[len("param/") :]: t for _, tensors in fetched for k, t in tensors.items() if k.startswith("param/")}
    assert sorted(served) == sorted(original)
    assert all(torch.equal(served[name], original[name]) for name in original)
    assert all(metadata["spec"] == pinned.fingerprint() for metadata, _ in fetched)  # the spec the coordinator signed

    root, out = swarm.workdir / "ckpt", swarm.workdir / "exported"
    parts = [checkpoint.Part(f"stage {s}", m, t) for s, (m, t) in enumerate(fetched)]
    checkpoint.write(root, pinned.to_dict(), pinned.fingerprint(), 0, parts)
    export(root, out)
    exported = load_file(str(out / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[name], original[name]) for name in original)


def test_weights_that_do_not_fit_config_json_are_refused_naming_the_tensor(tmp_path):
    hf, spec = hf_model("qwen2", tmp_path, stages=2)
    hf.save_pretrained(tmp_path)
    assert len(pin_weights(spec).model.weights) == 32
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(
        ConfigError, match=r"model.layers.0.mlp.gate_proj.weight has shape \[96, 64\], .* needs \[128, 64\]"
    ):
        pin_weights(resolve(spec))
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(
        ConfigError, match="the weights hold model.layers.2.*, which config.json's model has no place for"
    ):
        pin_weights(resolve(spec))


def test_a_mixtral_run_from_pretrained_weights_gives_each_expert_host_its_experts(swarm):
    """Mixtral's experts live on expert hosts: each loads its experts' tensors (w1, w2, w3 as on disk) from
    the coordinator, equal to the file's bit for bit, and the stage server its router and attention."""
    from peer.cli.demo import loopback_join

    directory = swarm.workdir / "mixtral"
    hf, _ = hf_model("mixtral", directory, stages=1, num_hidden_layers=2)
    original = on_disk(hf, directory)
    spec = pretrained_run("pretrained-moe", directory, stages=1)
    swarm.coordinator(spec)
    host = swarm.start("experts", loopback_join(swarm.maddr, "experts", "--experts", "0.0,0.1,0.2,0.3,1.0,1.1,1.2,1.3"))
    endpoint = swarm.known(host.wait_for(r"Serving experts .* at (\S+:\d+)", 120).group(1), "experts")
    for uid in ("0.0", "1.3"):
        host.wait_for(rf"Loaded the state of expert {uid} \(step 0\)", 60)
    server = swarm.server("s0", 0)
    server.wait_for(r"Loaded the state of stage 0 \(step 0\)", 60)

    async def states():
        client = admitted_client(endpoint, 2**20, 2**30)
        try:
            return {
                uid: await client.get_state(endpoint, "pretrained-moe", 0, timeout=30, expert=uid)
                for uid in ("0.0", "1.3")
            }
        finally:
            await client.close()

    import asyncio

    for uid, (_, tensors) in asyncio.run(states()).items():
        layer, index = uid.split(".")
        for part in ("w1", "w2", "w3"):
            want = original[f"model.layers.{layer}.block_sparse_moe.experts.{index}.{part}.weight"]
            assert torch.equal(tensors[f"param/{part}.weight"], want), (uid, part)
