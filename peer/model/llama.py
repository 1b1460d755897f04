"""A small Llama-style language model and its split into pipeline stages.

RMSNorm, rotary attention through scaled_dot_product_attention, SwiGLU MLP. Stage 0 holds the
embedding, the last stage the final norm, head and loss. Parameter names are the same in a stage
and in the whole model (`blocks.3.attn.wq.weight`), so stage states merge into one model file.
Every component is initialised from its own seed, so any partition starts equal to the whole.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from peer.config import ModelConfig, RunSpec
from peer.model.moe import ExpertBackend, LocalExperts, MoE, SwiGLU, make_expert
from peer.model.tp import TPGroup, full_shape, shard, shard_dim


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = cfg.hidden_size // cfg.num_heads
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; rotates pairs (even, odd) of each head."""
    seq = x.shape[-2]
    cos, sin = cos[:seq].to(x.dtype), sin[:seq].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal self-attention; under tensor parallelism (`tp`) this rank holds num_heads / tp.world heads."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp
        self.num_heads = cfg.num_heads // (tp.world if tp else 1)  # heads on this rank
        self.head_dim = cfg.hidden_size // cfg.num_heads
        local = self.num_heads * self.head_dim
        self.wq = nn.Linear(cfg.hidden_size, local, bias=False)  # column-parallel under tp
        self.wk = nn.Linear(cfg.hidden_size, local, bias=False)
        self.wv = nn.Linear(cfg.hidden_size, local, bias=False)
        self.wo = nn.Linear(local, cfg.hidden_size, bias=False)  # row-parallel under tp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if self.tp is not None:
            x = self.tp.copy_in(x)
        shape = (b, t, self.num_heads, self.head_dim)
        q = apply_rotary(self.wq(x).view(shape).transpose(1, 2), cos, sin)
        k = apply_rotary(self.wk(x).view(shape).transpose(1, 2), cos, sin)
        v = self.wv(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = self.wo(out.transpose(1, 2).reshape(b, t, -1))
        return out if self.tp is None else self.tp.reduce_out(out)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp: nn.Module, tp: TPGroup | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg, tp)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class StageModel(nn.Module):
    """Blocks `[first_block, last_block)` of the model, plus the embedding and/or head where they belong.

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
    ):
        super().__init__()
        self.tp = tp
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
        if self.is_first:
            self.embed = nn.Embedding(cfg.vocab_size // world, cfg.hidden_size)  # vocab-parallel under tp
        moe_layers = set(spec.moe_layers())

        def mlp(layer: int) -> nn.Module:
            if layer not in moe_layers:
                return SwiGLU(cfg.hidden_size, cfg.intermediate_size, tp)
            backend = experts or LocalExperts(
                make_expert(cfg, spec.moe, spec.seed, layer, e) for e in range(spec.moe.num_experts)
            )
            return MoE(cfg, spec.moe, layer, backend)

        self.blocks = nn.ModuleDict({str(i): Block(cfg, mlp(i), tp) for i in blocks})
        self.aux_weight = spec.moe.aux_loss_weight
        if self.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size // world, bias=False)  # vocab-parallel under tp
        cos, sin = rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights(spec.seed)

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
            self._normal("embed.weight", self.embed.weight, std, gen)
        for name, block in self.blocks.items():
            gen = torch.Generator().manual_seed(seed * 1_000_003 + 1 + int(name))
            for pname, p in block.named_parameters():
                if pname.startswith("mlp.experts."):
                    continue  # every expert is initialised from its own seed (peer.model.moe.init_expert)
                if pname.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    scale = out_std if pname.endswith(("wo.weight", "down.weight")) else std
                    self._normal(f"blocks.{name}.{pname}", p, scale, gen)
        if self.is_last:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + 999_999)
            self.norm.weight.fill_(1.0)
            self._normal("head.weight", self.head.weight, std, gen)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        tp = self.tp
        if self.is_first:
            x = self.embed(inputs.long()) if tp is None else tp.embed(inputs.long(), self.embed.weight)
        else:
            x = inputs
        for block in self.blocks.values():
            x = block(x, self.rope_cos, self.rope_sin)
        if not self.is_last:
            return x
        x = self.norm(x)
        logits = self.head(x if tp is None else tp.copy_in(x))
        if targets is None:
            return logits if tp is None else tp.gather_last(logits)
        flat = logits.float().reshape(-1, logits.shape[-1])
        if tp is None:
            return F.cross_entropy(flat, targets.long().reshape(-1))
        return tp.cross_entropy(flat, targets.long().reshape(-1))

    def aux_loss(self) -> torch.Tensor | None:
        """The weighted load-balancing loss of the last forward's MoE layers (None without MoE)."""
        losses = [b.mlp.aux_loss for b in self.blocks.values() if isinstance(b.mlp, MoE) and b.mlp.aux_loss is not None]
        return self.aux_weight * sum(losses) if losses else None


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def flops_per_sample(spec: RunSpec, stage: int | None = None) -> float:
    """Approximate FLOPs of forward+backward for one sequence through a stage (6 * params * tokens + attention)."""
    model_params = StageModel(spec, stage)
    n = count_parameters(model_params) - (model_params.embed.weight.numel() if model_params.is_first else 0)
    t, cfg = spec.training.seq_len, spec.model
    attention = 6 * len(model_params.blocks) * t * t * cfg.hidden_size
    return 6.0 * n * t + attention
