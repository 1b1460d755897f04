"""Mixture-of-experts MLP: a top-k gate on the stage server, experts local or on expert hosts.

Each token goes to the `top_k` experts with the largest gate logits; its output is the sum of
their outputs weighted by a softmax over those logits (Mixtral's routing: a softmax over all
experts, the top k, renormalised, is the same). Names are Mixtral's on disk
(`block_sparse_moe.gate`, `block_sparse_moe.experts.E.w1/w2/w3`), so a run exports as Mixtral. When an expert cannot be reached the
caller skips it: the softmax then runs over the experts that answered (the remaining weights are
renormalised), and a token with fewer than `moe.min_answers` answers fails the call. A
Switch-Transformer load-balancing loss (E * sum_e fraction_e * mean_prob_e) is kept for the
training objective.

The experts' side is a backend: `LocalExperts` (an nn.ModuleList, for the plain model and the
reference) or a remote one (peer.server.dispatch), both called as backend(layer, tokens, top_index,
samples) -> (outputs [tokens, k, hidden], answered [tokens, k]); `samples` is the micro-batch's
number of sequences, which remote experts count toward their optimizer steps.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from peer.config import ModelConfig, MoEConfig


class ExpertsUnavailable(RuntimeError):
    """Too few of a token's experts answered (fewer than moe.min_answers)."""


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), named as transformers' LlamaMLP; with `tp`
    (peer.model.tp.TPGroup) gate_proj/up_proj are column- and down_proj row-parallel."""

    def __init__(self, hidden: int, inner: int, tp=None):
        super().__init__()
        self.tp = tp
        inner //= tp.world if tp else 1
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        x = self.tp.copy_in(x)
        return self.tp.reduce_out(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class Expert(nn.Module):
    """One expert: w2(silu(w1(x)) * w3(x)), named as Mixtral's experts are on disk (w1 gate, w3 up, w2 down)."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def expert_size(cfg: ModelConfig, moe: MoEConfig) -> int:
    return moe.expert_size or cfg.intermediate_size


def expert_uid(layer: int, index: int) -> str:
    return f"{layer}.{index}"


def parse_expert_uid(uid: str) -> tuple[int, int]:
    layer, sep, index = uid.partition(".")
    if not sep or not layer.isdigit() or not index.isdigit():
        raise ValueError(f"expert {uid!r} is not of the form layer.index")
    return int(layer), int(index)


@torch.no_grad()
def init_expert(expert: Expert, seed: int, layer: int, index: int, num_layers: int) -> None:
    """Every expert from its own seed, so a host and the plain model start from the same weights."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 500_000 + layer * 10_000 + index)
    std = 0.02
    for name, p in expert.named_parameters():
        p.normal_(0.0, std / (2 * num_layers) ** 0.5 if name == "w2.weight" else std, generator=gen)


def make_expert(cfg: ModelConfig, moe: MoEConfig, seed: int, layer: int, index: int) -> Expert:
    expert = Expert(cfg.hidden_size, expert_size(cfg, moe))
    init_expert(expert, seed, layer, index, cfg.num_layers)
    return expert


class ExpertBackend(Protocol):
    def __call__(
        self, layer: int, tokens: torch.Tensor, top_index: torch.Tensor, samples: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class LocalExperts(nn.ModuleList):
    """The experts of one layer in this process."""

    def __call__(self, layer: int, tokens: torch.Tensor, top_index: torch.Tensor, samples: int = 1):
        outputs = tokens.new_zeros(*top_index.shape, tokens.shape[-1])
        for index, expert in enumerate(self):
            rows, slots = (top_index == index).nonzero(as_tuple=True)
            if rows.numel():
                outputs = outputs.index_put((rows, slots), expert(tokens[rows]))
        return outputs, torch.ones(top_index.shape, dtype=torch.bool)


class MoE(nn.Module):
    """A mixture-of-experts MLP for block `layer`; `experts` is LocalExperts or a remote backend."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, layer: int, experts: ExpertBackend):
        super().__init__()
        self.layer, self.num_experts, self.top_k, self.min_answers = layer, moe.num_experts, moe.top_k, moe.min_answers
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)  # the router, named as in Mixtral
        self.experts = experts
        self.aux_loss: torch.Tensor | None = None  # load-balancing loss of the last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.gate(tokens)
        top_logits, top_index = logits.topk(self.top_k, dim=-1)
        samples = x.shape[0] if x.dim() == 3 else 1
        outputs, answered = self.experts(self.layer, tokens, top_index, samples)
        if self.min_answers and bool((answered.sum(-1) < self.min_answers).any()):
            missing = sorted({int(e) for e in top_index[~answered].tolist()})
            raise ExpertsUnavailable(
                f"layer {self.layer}: experts {missing} did not answer and some tokens have fewer than "
                f"{self.min_answers} of their {self.top_k} experts"
            )
        weights = torch.softmax(top_logits.masked_fill(~answered, float("-inf")), dim=-1)
        weights = torch.nan_to_num(weights, nan=0.0)  # a token with no answer at all (min_answers 0)
        out = (weights.unsqueeze(-1) * outputs).sum(dim=1)
        # Switch Transformer: fraction of assignments per expert times its mean gate probability
        fraction = F.one_hot(top_index, self.num_experts).float().mean(dim=(0, 1))
        probs = torch.softmax(logits.float(), dim=-1).mean(dim=0)
        self.aux_loss = self.num_experts * (fraction * probs).sum()
        return out.view_as(x)
