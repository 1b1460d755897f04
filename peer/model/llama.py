"""The Llama-layout decoder every supported family shares, and its split into pipeline stages.

RMSNorm, rotary attention (grouped-query, through scaled_dot_product_attention; optional q/k/v
biases and per-head q/k norms), SwiGLU MLP: the same math and the same parameter names as
transformers' Llama, Mistral, Qwen2 and Qwen3 (peer.config.families), so a stage's state is a slice
of a Hugging Face checkpoint. We write these few layers rather than import transformers' own:
importing its modeling code costs a peer ~2.4 s of CPU at every start (it pulls torch._dynamo,
torch.distributed.tensor and scipy), and tests/test_hf.py holds us equal to transformers.
Stage 0 holds the embedding, the last stage the final norm, head and loss. Every component is
initialised from its own seed, so any partition starts equal to the whole.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from peer.config import ModelConfig, RunSpec
from peer.model import allocation
from peer.model.moe import ExpertBackend, LocalExperts, MoE, SwiGLU, make_expert
from peer.model.tp import TPGroup, full_shape, shard, shard_dim


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: normalised in float32, scaled in the input's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`weight`: this norm's weight as the caller passes it on (under tensor parallelism, see Attention)."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight if weight is None else weight) * x.to(dtype)


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """The rotary inverse frequencies of one head, with the config's scaling (default, linear or llama3)."""
    dim = cfg.head_size
    # on the CPU even inside a meta-device context (StageModel.unallocated): arange on meta costs a join 1-2 s
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    s = cfg.rope_scaling
    if s.kind == "linear":
        return inv_freq / s.factor
    if s.kind != "llama3":
        return inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_seq_len, head_dim], each frequency twice (transformers' half-rotation layout)."""
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32, device="cpu"), inverse_frequencies(cfg))
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; rotates the first half of each head against the second."""
    seq = x.shape[-2]
    cos, sin = cos[:seq].to(x.dtype), sin[:seq].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention, named as transformers names it (q_proj, k_proj, v_proj, o_proj).

    Under tensor parallelism (`tp`) this rank holds num_heads / tp.world query heads and
    num_kv_heads / tp.world key/value heads; o_proj's bias is added once, after the sum over ranks.
    """

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp
        world = tp.world if tp else 1
        self.head_dim = cfg.head_size
        heads, kv_heads = cfg.num_heads // world, cfg.kv_heads // world  # on this rank
        self.q_proj = nn.Linear(cfg.hidden_size, heads * self.head_dim, bias=cfg.qkv_bias)  # column-parallel
        self.k_proj = nn.Linear(cfg.hidden_size, kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)  # row-parallel
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if self.tp is not None:
            x = self.tp.copy_in(x)
        shape = (b, t, -1, self.head_dim)
        q, k = self.q_proj(x).view(shape), self.k_proj(x).view(shape)
        if self.qk_norm:
            q, k = self._head_norm(self.q_norm, q), self._head_norm(self.k_norm, k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim**-0.5, enable_gqa=True)
        out = out.transpose(1, 2).reshape(b, t, -1)
        if self.tp is None:
            return self.o_proj(out)
        out = self.tp.reduce_out(F.linear(out, self.o_proj.weight))
        return out if self.o_proj.bias is None else out + self.o_proj.bias

    def _head_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """A per-head norm; under tp each rank norms its own heads, so the weight's gradient is summed over ranks."""
        return norm(x) if self.tp is None else norm(x, self.tp.copy_in(norm.weight))


class DecoderLayer(nn.Module):
    """One transformer block, named as transformers' LlamaDecoderLayer (a mixture of experts as Mixtral's
    `block_sparse_moe`)."""

    def __init__(self, cfg: ModelConfig, mlp: nn.Module, tp: TPGroup | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.ffn_name = "block_sparse_moe" if isinstance(mlp, MoE) else "mlp"
        setattr(self, self.ffn_name, mlp)

    @property
    def ffn(self) -> nn.Module:
        """The block's MLP, dense or a mixture of experts."""
        return getattr(self, self.ffn_name)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.ffn(self.post_attention_layernorm(x))


def stage_of_parameter(spec: RunSpec, name: str) -> int:
    """The stage that holds whole-model parameter `name` (stages name their parameters as the whole model)."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    if layer:
        return spec.stage_of_block(int(layer.group(1)))
    return 0 if name.startswith("model.embed_tokens.") else spec.stages.num_stages - 1


class StageModel(nn.Module):
    """Blocks `[first_block, last_block)` of the model, plus the embedding and/or head where they belong.

    Parameters are named as in transformers' *ForCausalLM (`model.embed_tokens.weight`,
    `model.layers.3.self_attn.q_proj.weight`, `model.norm.weight`, `lm_head.weight`), in a stage as in
    the whole model, so stage states merge into a Hugging Face checkpoint by name alone.
    forward(inputs) returns hidden states; on the last stage with `targets` it returns the mean
    cross-entropy instead. In a mixture-of-experts run, `experts` is where the experts live: None
    builds them here (the plain model), else a remote backend (peer.server.dispatch) the gates call.
    With `tp`, this rank's shard of the stage (peer.model.tp): the same parameter names, local shapes,
    and the same initial values as the matching slices of the unsplit stage.
    """

    def __init__(
        self,
        spec: RunSpec,
        stage: int | None = None,
        experts: ExpertBackend | None = None,
        tp: TPGroup | None = None,
        init: bool = True,
    ):
        super().__init__()
        self.tp = tp
        self.seed = spec.seed
        world = tp.world if tp else 1
        cfg = spec.model
        num_stages = spec.stages.num_stages
        if stage is None:  # the whole model
            blocks, self.is_first, self.is_last = range(cfg.num_layers), True, True
        else:
            if not 0 <= stage < num_stages:
                raise ValueError(f"stage {stage} does not exist: the run has {num_stages} stages")
            blocks, self.is_first, self.is_last = spec.stage_blocks(stage), stage == 0, stage == num_stages - 1
        self.stage = stage
        self.cfg = cfg
        self.model = nn.Module()  # transformers' naming: the decoder under `model.`, the head beside it
        if self.is_first:
            # vocab-parallel; its weight is set by _init_weights (or a loaded state), so nn.Embedding's own normal_
            # init is skipped: on the meta device (StageModel.unallocated) its first call imports torch's
            # decompositions, 1-2 s of a join
            shape = (cfg.vocab_size // world, cfg.hidden_size)
            self.model.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        moe_layers = set(spec.moe_layers())

        def mlp(layer: int) -> nn.Module:
            if layer not in moe_layers:
                return SwiGLU(cfg.hidden_size, cfg.intermediate_size, tp)
            backend = experts or LocalExperts(
                make_expert(cfg, spec.moe, spec.seed, layer, e) for e in range(spec.moe.num_experts)
            )
            return MoE(cfg, spec.moe, layer, backend)

        self.model.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, mlp(i), tp) for i in blocks})
        self.aux_weight = spec.moe.aux_loss_weight
        self.checkpointing = spec.training.activation_checkpointing  # recompute blocks in the backward
        if self.is_last:
            self.model.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size // world, bias=False)  # vocab-parallel
        cos, sin = rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if init:
            self._init_weights(spec.seed)
        self._tie()

    def _tie(self) -> None:
        if self.cfg.tie_embeddings and self.is_first and self.is_last:  # validate refuses ties across stages
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def unallocated(cls, spec: RunSpec, stage: int | None = None, experts: ExpertBackend | None = None) -> StageModel:
        """The stage with its parameters zero and not yet in memory (pages the kernel fills when first
        written): for a server that loads a state into them, or calls init_from_seed when there is none.
        Not with local experts (each is initialised as it is built) nor tensor parallelism."""
        if (
            experts is None
            and stage is not None
            and any(layer in spec.stage_blocks(stage) for layer in spec.moe_layers())
        ):
            raise ValueError("an unallocated stage needs its experts remote (each local expert initialises itself)")
        with torch.device("meta"):
            model = cls(spec, stage, experts, init=False)
        # each module's parameters as zeros, allocated but never written (and untied: each module gets its own).
        # Not Module.to_empty: its empty_like on the meta device imports sympy, a second of a join
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                zeros = allocation.zeros(p.shape, p.dtype)
                module.register_parameter(name, nn.Parameter(zeros, requires_grad=p.requires_grad))
        model._tie()
        model.rope_cos, model.rope_sin = rotary_tables(model.cfg)
        return model

    def init_from_seed(self) -> None:
        """The run's initial weights (what the constructor gives), into an unallocated stage."""
        self._init_weights(self.seed)

    @property
    def layers(self) -> nn.ModuleDict:
        return self.model.layers

    @torch.no_grad()
    def _normal(self, name: str, p: torch.Tensor, std: float, gen: torch.Generator) -> None:
        """Draw the whole (unsplit) tensor from `gen`, keep this rank's shard: every degree starts equal."""
        if self.tp is None:
            p.normal_(0.0, std, generator=gen)
            return
        dim = shard_dim(name)
        full = torch.empty(full_shape(p.shape, dim, self.tp.world)).normal_(0.0, std, generator=gen)
        p.copy_(shard(full, dim, self.tp.rank, self.tp.world))

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        std = 0.02
        out_std = std / math.sqrt(2 * self.cfg.num_layers)
        if self.is_first:
            gen = torch.Generator().manual_seed(seed * 1_000_003)
            self._normal("model.embed_tokens.weight", self.model.embed_tokens.weight, std, gen)
        for name, layer in self.layers.items():
            gen = torch.Generator().manual_seed(seed * 1_000_003 + 1 + int(name))
            for pname, p in layer.named_parameters():
                if pname.startswith("block_sparse_moe.experts."):
                    continue  # every expert is initialised from its own seed (peer.model.moe.init_expert)
                if pname.endswith("norm.weight"):
                    p.fill_(1.0)
                elif pname.endswith(".bias"):
                    p.zero_()
                else:
                    scale = out_std if pname.endswith(("o_proj.weight", "down_proj.weight")) else std
                    self._normal(f"model.layers.{name}.{pname}", p, scale, gen)
        if self.is_last:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + 999_999)
            self.model.norm.weight.fill_(1.0)
            if not (self.is_first and self.lm_head.weight is self.model.embed_tokens.weight):  # tied: the embedding's
                self._normal("lm_head.weight", self.lm_head.weight, std, gen)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        tp = self.tp
        if self.is_first:
            embed = self.model.embed_tokens
            x = embed(inputs.long()) if tp is None else tp.embed(inputs.long(), embed.weight)
        else:
            x = inputs
        for layer in self.layers.values():
            x = self._layer(layer, x)
        if not self.is_last:
            return x
        x = self.model.norm(x)
        logits = self.lm_head(x if tp is None else tp.copy_in(x))
        if targets is None:
            return logits if tp is None else tp.gather_last(logits)
        flat = logits.float().reshape(-1, logits.shape[-1])
        if tp is None:
            return F.cross_entropy(flat, targets.long().reshape(-1))
        return tp.cross_entropy(flat, targets.long().reshape(-1))

    def _layer(self, layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        """One block; with activation checkpointing its activations are recomputed in the backward (not a
        mixture-of-experts block: recomputing would call its remote experts again)."""
        if self.checkpointing and self.training and torch.is_grad_enabled() and not isinstance(layer.ffn, MoE):
            return checkpoint(layer, x, self.rope_cos, self.rope_sin, use_reentrant=False)
        return layer(x, self.rope_cos, self.rope_sin)

    def aux_loss(self) -> torch.Tensor | None:
        """The weighted load-balancing loss of the last forward's MoE layers (None without MoE)."""
        losses = [b.ffn.aux_loss for b in self.layers.values() if isinstance(b.ffn, MoE) and b.ffn.aux_loss is not None]
        return self.aux_weight * sum(losses) if losses else None


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def flops_per_sample(spec: RunSpec, stage: int | None = None) -> float:
    """Approximate FLOPs of forward+backward for one sequence through a stage (6 * params * tokens + attention)."""
    model = StageModel(spec, stage)
    n = count_parameters(model) - (model.model.embed_tokens.weight.numel() if model.is_first else 0)
    t, cfg = spec.training.seq_len, spec.model
    attention = 6 * len(model.layers) * t * t * cfg.num_heads * cfg.head_size
    return 6.0 * n * t + attention
