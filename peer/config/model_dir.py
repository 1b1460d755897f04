"""`[model] path = "DIR"`: a Hugging Face model directory, read by the coordinator into the run spec.

Only its config.json is read (peer.config.families turns it into ModelConfig's fields, which then
travel with the signed spec). The run's own choices stay the run's: `max_seq_len` (bounded by the
model's max_position_embeddings) and the stage split. Safetensors weights in the directory are
checked and pinned by the coordinator (peer.coordinator.pretrained); pickled ones are refused.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from peer.config.families import from_hf
from peer.config.loading import ConfigError, from_dict
from peer.config.run import ModelConfig, RunSpec

PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")  # never unpickled: refused


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"model.path: {path} does not exist (a Hugging Face model directory has a config.json)"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: {path} cannot be read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model.path: {path} is not a JSON object")
    return config


def resolve(spec: RunSpec) -> RunSpec:
    """The spec with its model fields from `model.path`'s config.json (unchanged without a path)."""
    if not spec.model.path:
        return spec
    directory = Path(spec.model.path).expanduser()
    if not directory.is_dir():
        raise ConfigError(f"model.path: {directory} is not a directory")
    pickled = [name for name in PICKLED if (directory / name).exists()]
    if pickled and not (directory / "model.safetensors").exists():
        raise ConfigError(
            f"model.path: {directory / pickled[0]}: pickled weights are never loaded; convert them to safetensors "
            "(model.safetensors, or shards with model.safetensors.index.json)"
        )
    config = read_config(directory)
    where = str(directory / "config.json")
    read = from_hf(config, where)
    fields = dict(read["fields"], path=str(directory), max_seq_len=spec.model.max_seq_len, source_config=config)
    model = from_dict(ModelConfig, fields, "model.")
    limit, window = read["max_position_embeddings"], read["sliding_window"]
    if isinstance(limit, int) and model.max_seq_len > limit:
        raise ConfigError(
            f"model.max_seq_len: {model.max_seq_len} is longer than {where}'s max_position_embeddings {limit}"
        )
    if isinstance(window, int) and window < model.max_seq_len:
        raise ConfigError(
            f"{where}: sliding_window {window} is shorter than model.max_seq_len {model.max_seq_len}; sliding-window "
            "attention is not supported (set max_seq_len to at most the window)"
        )
    resolved = dataclasses.replace(spec, model=model)
    if read["moe"]:  # Mixtral: its experts, with the run's own choices (min_answers) kept
        resolved.moe = dataclasses.replace(spec.moe, **read["moe"])
    resolved.validate()
    return resolved
