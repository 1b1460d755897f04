"""Tensors that take no memory until written: a server that is about to load a state into its part
must not first hold (and write) a copy of it that it throws away.

Large CPU tensors come from pages the kernel hands out zero-filled on their first touch (an anonymous
mapping). Small ones are ordinary zeros."""

from __future__ import annotations

import math
import mmap

import torch

SMALL = 1 << 20  # bytes below which a tensor is an ordinary one: a page-sized mapping each would waste more


def zeros(shape, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """Zeros whose memory becomes resident only where written (CPU); ordinary zeros elsewhere."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < SMALL:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes)  # private and anonymous: zero-filled by the kernel, page by page, when touched
    return torch.frombuffer(pages, dtype=dtype).view(shape)


def zeros_like(t: torch.Tensor) -> torch.Tensor:
    return zeros(t.shape, t.dtype, t.device)
