"""`peer export`: a checkpoint as a Hugging Face model directory, and reading such a directory back.

The directory holds config.json (peer.config.families.to_hf), generation_config.json, the weights
as safetensors (one `model.safetensors`, or shards of at most `max_shard_bytes` with
`model.safetensors.index.json`), and the tokenizer the run trained with (peer.data.tokenizer).
Parameter names are already transformers' (peer.model.llama), so export is a copy, and
`AutoModelForCausalLM.from_pretrained(DIR)` loads it with no missing or unexpected keys (a tied
head is left out, as transformers itself saves it). Everything is written into a hidden directory
beside OUT first and renamed into place: a failed export leaves nothing half-written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from peer.config import ConfigError, RunSpec
from peer.config.families import from_hf, to_hf
from peer.coordinator.checkpoint import CheckpointError, model_weights
from peer.data.tokenizer import BYTE_FINGERPRINT, TextTokenizer, bytes_tokenizer, load_tokenizer
from peer.model.llama import StageModel

MAX_SHARD_BYTES = 5 * 10**9  # the hub's usual bound on one weights file
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INDEX = "model.safetensors.index.json"


def shards(weights: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """The tensors in name order, cut into groups of at most `max_bytes` (a bigger tensor alone)."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(weights):
        t = weights[name]
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    return groups


def write_weights(directory: Path, weights: dict[str, torch.Tensor], max_bytes: int) -> list[str]:
    """The weights as safetensors in `directory` (sharded with an index when over `max_bytes`); files written."""
    groups = shards(weights, max_bytes)
    meta = {"format": "pt"}
    if len(groups) == 1:
        save_file({k: t.contiguous() for k, t in groups[0].items()}, str(directory / "model.safetensors"), meta)
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, group in enumerate(groups, start=1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: t.contiguous() for k, t in group.items()}, str(directory / name), meta)
        weight_map.update(dict.fromkeys(group, name))
        names.append(name)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX]


def export(
    path: str | Path, out: str | Path, max_shard_bytes: int = MAX_SHARD_BYTES, dtype: str = "float32"
) -> tuple[int, int, list[str]]:
    """Write the checkpoint at `path` as a Hugging Face directory `out` with weights in `dtype` (float32,
    bfloat16, float16); (tensors, parameters, files)."""
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
    spec_dict, weights = model_weights(path)
    weights = {name: t.to(DTYPES[dtype]) for name, t in weights.items()}
    spec = RunSpec.from_dict(spec_dict)
    if spec.moe_layers() and len(spec.moe_layers()) != spec.model.num_layers:
        raise CheckpointError(
            f"{path}: experts in blocks {spec.moe_layers()} only; a mixture-of-experts run exports as Mixtral, "
            "which has them in every block"
        )
    if spec.moe_layers() and spec.model.architecture != "MixtralForCausalLM":
        if spec.model.qkv_bias or spec.model.o_bias or spec.model.qk_norm:
            raise CheckpointError(f"{path}: Mixtral's attention has no biases nor q/k norms; this run's has")
        spec.model.architecture = "MixtralForCausalLM"
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: already exists and is not an empty directory; export needs a new one")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        config = {**to_hf(spec.model, spec.moe), "dtype": dtype}
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        generation = {k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        files = ["config.json", "generation_config.json", *write_weights(tmp, weights, max_shard_bytes)]
        files += run_tokenizer(spec).save(tmp, spec.model.max_seq_len)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:  # removes the partial directory, then re-raises whatever it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return len(weights), sum(t.numel() for t in weights.values()), files


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory's safetensors (one file, or the shards its index names)."""
    index = directory / INDEX
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
    else:
        files = ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        file = directory / name
        try:
            with safe_open(str(file), "pt") as f:
                weights.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open has no iterator)
        except FileNotFoundError:
            raise CheckpointError(f"{file}: missing (a Hugging Face directory keeps its weights there)") from None
        except Exception as e:  # safetensors' own error type: the file is damaged or not safetensors
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
    return weights


def load_directory(directory: str | Path) -> StageModel:
    """The whole model (peer.model.llama.StageModel) of a Hugging Face directory `peer export` wrote, or any
    directory of a supported family."""
    directory = Path(directory)
    config_file = directory / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{config_file}: no readable config.json ({e})") from None
    try:
        read = from_hf(config, str(config_file))
        fields = read["fields"]
        limit = config.get("max_position_embeddings")
        fields["max_seq_len"] = min(limit, 4096) if isinstance(limit, int) and limit > 0 else 4096
        spec = RunSpec.from_dict(
            {"model": fields, "moe": read["moe"], "stages": {"num_stages": 1}, "training": {"seq_len": 1}}
        )
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    model = StageModel(spec)
    weights = read_weights(directory)
    if spec.model.tie_embeddings:
        weights.pop("lm_head.weight", None)
        weights["lm_head.weight"] = weights.get("model.embed_tokens.weight")
    missing = sorted(set(model.state_dict()) - set(weights))
    unexpected = sorted(set(weights) - set(model.state_dict()))
    if missing or unexpected:
        raise CheckpointError(
            f"{directory}: weights do not fit config.json: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise CheckpointError(f"{directory}: weights do not fit config.json: {e}") from None
    return model


def run_tokenizer(spec) -> TextTokenizer:
    """The tokenizer the run trained with, to go with its weights: the byte default, or the spec's
    data.tokenizer directory when it is here and is the one the spec pins (CheckpointError otherwise)."""
    pinned = spec.data.tokenizer_fingerprint or BYTE_FINGERPRINT
    if pinned == BYTE_FINGERPRINT:
        return bytes_tokenizer()
    tokenizer = load_tokenizer(spec.data.tokenizer)
    if tokenizer.fingerprint != pinned:
        raise CheckpointError(
            f"{spec.data.tokenizer}: not the tokenizer this run trained with (fingerprint {tokenizer.fingerprint}, "
            f"the run's is {pinned})"
        )
    return tokenizer
