"""How a group's members' tensors become one: the weights the group's own data fixes, and the aggregates.

Pure functions on tensors; peer.server.owned_slice applies them to each piece an owner reduces. Every owner
computes the weights from the same contributions (each verdict says which), so all reach the same weights.

- weights: a member's weight is the samples it announced in the round's gathered data (every member
  sees the same), never the weight its messages carry, and at most `ratio` times the lower median of
  the members' positive claims (a member claiming 10^9 samples cannot outweigh the rest);
- `mean`: the weighted mean (exact data parallelism);
- `median`: the coordinate-wise median of the members that brought samples, each counted once (a
  median weighted by claims is not robust: one claim can outweigh the rest);
- `clipped`: a centered clip (Karimireddy, He and Jaggi, 2021) from that median: each member's
  difference from the current centre counts with a norm of at most the members' median distance, a
  few times over, each member once. An honest majority bounds what the rest can move.

With two members or fewer, no aggregate can tell the honest one, and each is the (sample-weighted) mean.
The robust kinds leave out a part with NaN or Inf (no honest member sends one).
"""

from __future__ import annotations

import torch

from peer.config import AGGREGATES

CLIP_ITERATIONS = 3  # centered-clip passes; each moves the centre by a clipped mean of the differences


def claimed_samples(info) -> int:
    """The samples a member's gathered data announces; anything but a non-negative int is 0."""
    samples = info.get("samples", 0) if isinstance(info, dict) else 0
    return max(0, samples) if isinstance(samples, int) else 0


def fixed_weights(samples: list[int], ratio: float) -> list[float]:
    """Each member's weight: its claimed samples (negative: 0), capped at `ratio` times the lower median of
    the positive claims; 0: no cap."""
    claims = [float(max(0, s)) for s in samples]
    positive = sorted(c for c in claims if c > 0)
    if ratio <= 0 or not positive:
        return claims
    cap = ratio * positive[(len(positive) - 1) // 2]
    return [min(c, cap) for c in claims]


def aggregate(parts: list[torch.Tensor], weights: list[float], kind: str) -> torch.Tensor:
    """The members' `parts` (one shape) made one by `kind` (AGGREGATES), with `weights` (zero: left out; the
    robust kinds count each other member once)."""
    kept = [(w, p.float()) for w, p in zip(weights, parts, strict=True) if w > 0]
    if kind != "mean":  # a part with NaN or Inf is no honest member's; the mean lets the norm check refuse it
        kept = [(w, p) for w, p in kept if bool(torch.isfinite(p).all())]
    if not kept:
        return torch.zeros_like(parts[0], dtype=torch.float32)
    x = torch.stack([p.reshape(-1) for _, p in kept])
    if kind == "mean" or len(kept) <= 2:  # two cannot outvote each other: the sample-weighted mean
        result = _mean(x, torch.tensor([w for w, _ in kept], dtype=torch.float32))
    else:
        result = _robust(x, kind)
    return result.reshape(parts[0].shape)


def _robust(x: torch.Tensor, kind: str) -> torch.Tensor:
    w = torch.ones(x.shape[0], dtype=torch.float32)
    if kind == "median":
        return _median(x, w)
    if kind == "clipped":
        return _centered_clip(x, w)
    raise ValueError(f"unknown aggregate {kind!r}: one of {', '.join(AGGREGATES)}")


def _mean(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (w[:, None] * x).sum(0) / w.sum()


def _median(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per coordinate, the smallest value at which the weights at or below it reach half the total (with even
    counts, the lower of the middle two)."""
    values, order = torch.sort(x, dim=0)
    reached = torch.cumsum(w[order], dim=0) >= w.sum() / 2
    first = reached.int().argmax(dim=0, keepdim=True)
    return values.gather(0, first).squeeze(0)


def _centered_clip(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    centre = _median(x, w)
    radius = torch.linalg.vector_norm(x - centre, dim=1).median()
    if radius <= 0:
        return centre
    for _ in range(CLIP_ITERATIONS):
        diff = x - centre
        scale = torch.clamp(radius / torch.linalg.vector_norm(diff, dim=1).clamp_min(1e-30), max=1.0)
        centre = centre + (w * scale)[:, None].mul(diff).sum(0) / w.sum()
    return centre
