"""The model families Swarmtrain trains, and their Hugging Face `config.json` in our terms and back.

Every family is a Llama-layout decoder (RMSNorm, rotary attention with grouped-query heads, SwiGLU
MLP); a family is the handful of switches that set it apart, read from its config.json:

- LlamaForCausalLM (Llama 2, 3, 3.1+ with llama3 rope scaling): `attention_bias` on q, k, v and o;
- MistralForCausalLM: Llama's layout; a sliding window is taken only when it covers the run's
  whole sequence (then it changes nothing), else refused;
- Qwen2ForCausalLM: biases on q, k and v (not o); sliding-window layers refused;
- Qwen3ForCausalLM: RMSNorm over each head of q and k before the rotary embedding;
  `attention_bias` on q, k, v and o; sliding-window layers refused;
- MixtralForCausalLM: Mistral's attention, a mixture of experts in every block (`[moe]` from
  num_local_experts, num_experts_per_tok, intermediate_size, router_aux_loss_coef; the router on
  the stage server, the experts on expert hosts); router jitter refused.

Anything else (another architecture, a rope type other than default, linear or llama3, an
activation other than silu, MLP biases) is refused with the name of the file and the field.
Nothing here imports torch or transformers.
"""

from __future__ import annotations

from typing import Any

from peer.config.loading import ConfigError

# architecture -> transformers' model_type
SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
}
ROPE_KINDS = ("default", "linear", "llama3")


def supported_list() -> str:
    return ", ".join(SUPPORTED)


def check_architecture(name: str, where: str) -> None:
    if name not in SUPPORTED:
        raise ConfigError(f"{where}: {name!r} is not a supported architecture (supported: {supported_list()})")


def _rope(config: dict[str, Any], where: str) -> tuple[float, dict[str, Any]]:
    """(rope_theta, RopeScaling fields) from transformers 5's rope_parameters or the older rope_theta/rope_scaling."""
    params = config.get("rope_parameters") or {}
    legacy = config.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(legacy, dict):
        raise ConfigError(f"{where}: rope_parameters / rope_scaling must be tables")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = {**legacy, **params}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise ConfigError(f"{where}: rope type {kind!r} is not supported (supported: {', '.join(ROPE_KINDS)})")
    fields: dict[str, Any] = {"kind": kind}
    if kind != "default":
        fields["factor"] = float(scaling.get("factor", 1.0))
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in scaling:
                raise ConfigError(f"{where}: llama3 rope scaling needs {key}")
            fields[key] = scaling[key]
        fields["low_freq_factor"] = float(fields["low_freq_factor"])
        fields["high_freq_factor"] = float(fields["high_freq_factor"])
    return float(theta), fields


def _refusals(config: dict[str, Any], family: str, where: str) -> None:
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {config['hidden_act']!r} is not supported (only silu, as in SwiGLU)")
    if config.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias = true is not supported (the MLP's projections have no biases)")
    if family == "mixtral" and config.get("router_jitter_noise"):
        raise ConfigError(f"{where}: router_jitter_noise is not supported (the router is deterministic)")
    if family in ("qwen2", "qwen3") and config.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window = true is not supported (every layer attends to all tokens)")


def from_hf(config: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig's fields (and `sliding_window`, `max_position_embeddings`) from a config.json's contents."""
    archs = config.get("architectures") or []
    by_type = {family: arch for arch, family in SUPPORTED.items()}
    if not archs and config.get("model_type") in by_type:  # a config saved without a model names only its type
        archs = [by_type[config["model_type"]]]
    if not isinstance(archs, list) or len(archs) != 1:
        raise ConfigError(f"{where}: architectures must name one class, one of: {supported_list()}")
    check_architecture(archs[0], f"{where}: architectures")
    family = SUPPORTED[archs[0]]
    _refusals(config, family, where)
    theta, scaling = _rope(config, where)
    try:
        heads = int(config["num_attention_heads"])
        bias = bool(config.get("attention_bias", False))
        fields = {
            "architecture": archs[0],
            "vocab_size": int(config["vocab_size"]),
            "hidden_size": int(config["hidden_size"]),
            "num_layers": int(config["num_hidden_layers"]),
            "num_heads": heads,
            "num_kv_heads": int(config.get("num_key_value_heads") or heads),
            "head_dim": int(config.get("head_dim") or 0),
            "intermediate_size": int(config["intermediate_size"]),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
            "qkv_bias": family == "qwen2" or (bias and family != "mistral"),
            "o_bias": bias and family in ("llama", "qwen3"),
            "qk_norm": family == "qwen3",
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        }
    except KeyError as e:
        raise ConfigError(f"{where}: the field {e.args[0]} is missing") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: a field has the wrong type ({e})") from None
    window = config.get("sliding_window") if family in ("mistral", "mixtral") else None
    return {
        "fields": fields,
        "moe": _moe(config, where) if family == "mixtral" else {},
        "sliding_window": window,
        "max_position_embeddings": config.get("max_position_embeddings"),
    }


def _moe(config: dict[str, Any], where: str) -> dict[str, Any]:
    """MoEConfig's fields of a Mixtral config.json: experts in every block."""
    try:
        return {
            "num_experts": int(config["num_local_experts"]),
            "top_k": int(config["num_experts_per_tok"]),
            "layers": [],
            "expert_size": int(config["intermediate_size"]),
            "aux_loss_weight": float(config.get("router_aux_loss_coef", 0.001)),
        }
    except KeyError as e:
        raise ConfigError(f"{where}: the field {e.args[0]} is missing") from None


def to_hf(model, moe=None) -> dict[str, Any]:
    """config.json for a model of these fields (peer.config.run.ModelConfig; `moe`, a MoEConfig, for
    Mixtral), over the one it came from."""
    family = SUPPORTED[model.architecture]
    out = {k: v for k, v in model.source_config.items() if k not in ("rope_scaling", "rope_theta", "torch_dtype")}
    rope: dict[str, Any] = {"rope_type": model.rope_scaling.kind, "rope_theta": model.rope_theta}
    if model.rope_scaling.kind != "default":
        rope["factor"] = model.rope_scaling.factor
    if model.rope_scaling.kind == "llama3":
        s = model.rope_scaling
        rope.update(
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        )
    out.update(
        architectures=[model.architecture],
        model_type=family,
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        num_key_value_heads=model.kv_heads,
        head_dim=model.head_size,
        hidden_act="silu",
        rms_norm_eps=model.norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=model.tie_embeddings,
        dtype="float32",
    )
    out.setdefault("max_position_embeddings", model.max_seq_len)
    if family in ("llama", "qwen3"):
        out["attention_bias"] = model.o_bias
    if family == "mixtral":
        out.update(
            num_local_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            intermediate_size=moe.expert_size or model.intermediate_size,
            router_aux_loss_coef=moe.aux_loss_weight,
            router_jitter_noise=0.0,
        )
    if not model.source_config:  # our own model (the byte-level demo): no special tokens to stop at
        out.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return out
