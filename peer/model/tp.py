"""Tensor parallelism inside one peer: the rank group, its collectives, and Megatron-style shards.

A stage server started with `--tp N` runs N ranks in one `torch.distributed` group (NCCL on CUDA,
gloo on CPU). Every rank holds a shard of the stage:

- column-parallel (output features split): the attention's q_proj, k_proj, v_proj (weights and
  biases; query and key/value heads both split) and the MLP's gate_proj and up_proj;
- row-parallel (input features split): the attention's o_proj and the MLP's down_proj, whose
  partial outputs are summed by one all-reduce (o_proj's bias is added once, after it);
- vocab-parallel: the embedding's rows and the head's outputs, with a parallel cross-entropy;
- replicated: the norms (their gradients come out equal on every rank).

Each attention and each MLP costs one all-reduce in the forward (the row-parallel output) and one
in the backward (the gradient of the replicated input). `TPGroup` holds the rank's place and the
process group; `shard_dim` says how a parameter is split, by its name, which is the same at every
degree, so states of replicas at different degrees map onto each other through the full tensors.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from peer.config import RunSpec

# parameter-name endings (transformers' names) -> the dimension they are split along
_SPLIT = {
    "self_attn.q_proj.weight": 0,
    "self_attn.q_proj.bias": 0,
    "self_attn.k_proj.weight": 0,
    "self_attn.k_proj.bias": 0,
    "self_attn.v_proj.weight": 0,
    "self_attn.v_proj.bias": 0,
    "self_attn.o_proj.weight": 1,
    "mlp.gate_proj.weight": 0,
    "mlp.up_proj.weight": 0,
    "mlp.down_proj.weight": 1,
}


def shard_dim(name: str) -> int | None:
    """The dimension parameter `name` (as in the whole model) is split along, or None if replicated."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0
    if name.startswith("model.layers.") and ".experts." not in name:
        for ending, dim in _SPLIT.items():
            if name.endswith(ending):
                return dim
    return None


def state_dim(key: str) -> int | None:
    """The split dimension of a state tensor: `param/NAME`, `optim/NAME/KIND`, `outer/anchor|momentum/NAME`."""
    kind, _, rest = key.partition("/")
    if kind == "optim":
        name, _, slot = rest.rpartition("/")
        return None if slot == "step" else shard_dim(name)
    if kind == "outer":
        rest = rest.partition("/")[2]
    return shard_dim(rest)


def shard(full: torch.Tensor, dim: int | None, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s contiguous part of `full` along `dim` (all of it if `dim` is None)."""
    if dim is None or world == 1:
        return full
    return full.chunk(world, dim)[rank]


def full_shape(local: torch.Size | list[int], dim: int | None, world: int) -> list[int]:
    shape = list(local)
    if dim is not None:
        shape[dim] *= world
    return shape


def check_degree(spec: RunSpec, stage: int, world: int) -> str | None:
    """Why `stage` cannot be split over `world` ranks, or None if it can."""
    if world == 1:
        return None
    m = spec.model
    if world < 1:
        return f"--tp must be at least 1, got {world}"
    problems = [
        f"model.{name} ({value}) is not divisible by {world}"
        for name, value in (
            ("num_heads", m.num_heads),
            ("num_kv_heads", m.kv_heads),
            ("intermediate_size", m.intermediate_size),
        )
        if value % world
    ]
    holds_vocab = stage == 0 or stage == spec.stages.num_stages - 1
    if holds_vocab and m.vocab_size % world:
        problems.append(f"model.vocab_size ({m.vocab_size}) is not divisible by {world}")
    if any(layer in spec.stage_blocks(stage) for layer in spec.moe_layers()):
        problems.append("the stage holds mixture-of-experts layers, which tensor parallelism does not split yet")
    return "; ".join(problems) or None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class TPGroup:
    """This rank's place in the peer's tensor-parallel group, and the collectives the shards need."""

    rank: int
    world: int
    device: torch.device  # where this rank's shard and its collectives' tensors live
    group: object = None  # the torch.distributed process group

    @classmethod
    def join(cls, rank: int, world: int, port: int, device: str, timeout: float) -> TPGroup:
        """This rank's place, connected to the group whose store rank 0 opens on loopback `port`."""
        tp = cls(rank, world, torch.device(device))
        tp.connect(port, timeout)
        return tp

    def connect(self, port: int, timeout: float) -> None:
        """Join the process group (NCCL on CUDA, gloo on CPU); rank 0's call waits for all the ranks."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            "nccl" if self.device.type == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=timeout),
        )
        self.group = dist.group.WORLD

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- plain collectives (no autograd) ---------------------------------------------------
    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` on every rank (the others pass a buffer of the right shape and dtype)."""
        buf = t.to(self.device).contiguous()
        dist.broadcast(buf, 0, group=self.group)
        return buf

    def agree(self, flag: bool) -> bool:
        """Rank 0's decision, on every rank."""
        return bool(self.broadcast(torch.tensor([int(flag)], dtype=torch.int64)).item())

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        buf = t.to(self.device).contiguous().clone()
        dist.all_reduce(buf, group=self.group)
        return buf

    def gather(self, local: torch.Tensor, dim: int | None) -> torch.Tensor | None:
        """The full tensor on rank 0 (CPU), from every rank's shard along `dim`; None elsewhere."""
        if dim is None:
            return local.detach().cpu().clone() if self.rank == 0 else None
        buf = local.detach().to(self.device).contiguous()
        parts = [torch.empty_like(buf) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(buf, parts, dst=0, group=self.group)
        return torch.cat(parts, dim).cpu() if self.rank == 0 else None

    def scatter(self, full: torch.Tensor | None, like: torch.Tensor, dim: int | None) -> torch.Tensor:
        """This rank's shard of rank 0's full tensor (the others pass None), shaped and typed as `like`."""
        out = torch.empty_like(like, device=self.device)
        if dim is None:
            if self.rank == 0:
                out.copy_(full)
            dist.broadcast(out, 0, group=self.group)
            return out
        chunks = None
        if self.rank == 0:
            chunks = [c.to(device=self.device, dtype=like.dtype).contiguous() for c in full.chunk(self.world, dim)]
        dist.scatter(out, chunks, src=0, group=self.group)
        return out

    # ---- autograd-aware pieces of the sharded model -----------------------------------------
    def copy_in(self, x: torch.Tensor) -> torch.Tensor:
        """Identity forward; the backward sums the input's gradient over the ranks (before a column split)."""
        return _CopyIn.apply(x, self)

    def reduce_out(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks forward (after a row split); identity backward."""
        return _ReduceOut.apply(x, self)

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' shards concatenated along the last dimension (vocab-parallel logits to full)."""
        return _GatherLast.apply(x, self)

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding: each rank looks up the ids in its rows; one all-reduce sums them."""
        rows = weight.shape[0]
        start = self.rank * rows
        outside = (ids < start) | (ids >= start + rows)
        local = F.embedding((ids - start).masked_fill(outside, 0), weight)
        return self.reduce_out(local.masked_fill(outside.unsqueeze(-1), 0.0))

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of vocab-parallel logits [tokens, vocab/world] against full target ids."""
        return _ParallelCrossEntropy.apply(logits, targets, self)


class _CopyIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.tp.group)
        return grad, None


class _ReduceOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=tp.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(tp.world)]
        dist.all_gather(parts, x, group=tp.group)
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.tp.world, -1)[ctx.tp.rank].contiguous(), None


class _ParallelCrossEntropy(torch.autograd.Function):
    """Three small all-reduces (max, sum of exponentials, target logit); the backward is local."""

    @staticmethod
    def forward(ctx, logits, targets, tp):
        logits = logits.float()
        width = logits.shape[-1]
        peak = logits.max(-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = logits - peak.unsqueeze(-1)
        start = tp.rank * width
        outside = (targets < start) | (targets >= start + width)
        local = (targets - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(picked, group=tp.group)
        exp = shifted.exp()
        total = exp.sum(-1)
        dist.all_reduce(total, group=tp.group)
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, outside)
        return (total.log() - picked).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(local.shape[0], device=local.device)
        grad_logits[rows, local] -= (~outside).to(grad_logits.dtype)
        return grad_logits * (grad / local.shape[0]), None, None
