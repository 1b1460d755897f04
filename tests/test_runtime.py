"""Unit tests of a stage's runtime (the torch side of a stage server), without processes."""

from __future__ import annotations

import torch

from peer.config import RunSpec
from peer.runtime import StageRuntime


def test_a_retried_backward_is_answered_again_but_counted_once():
    spec = RunSpec.from_dict(
        {"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2}, "stages": {"num_stages": 2}}
    )
    runtime = StageRuntime(spec, 1)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 8, 32, generator=gen), torch.randint(0, 256, (3, 8), generator=gen)
    first_grad, first_loss, first_seq = runtime.backward("mb-1", x, None, y)
    accumulated = [a.clone() for a in runtime.accumulator]
    # the caller's answer came too late and it sends the same backward again
    grad, loss, seq = runtime.backward("mb-1", x, None, y)
    assert seq == first_seq == 1 and runtime.samples_accumulated == 3 and runtime.duplicates == 1
    torch.testing.assert_close(grad, first_grad)
    assert loss == first_loss
    for a, b in zip(runtime.accumulator, accumulated, strict=True):
        torch.testing.assert_close(a, b)
    # another micro-batch still counts; a dropped accumulator forgets what it counted
    assert runtime.backward("mb-2", x, None, y)[2] == 2 and runtime.samples_accumulated == 6
    runtime.drop_accumulator()
    assert runtime.backward("mb-1", x, None, y)[2] == 1 and runtime.samples_accumulated == 3


def test_bfloat16_compute_keeps_float32_weights_and_wire():
    """server.compute_dtype = bfloat16 runs the matmuls under autocast; what is stored and sent stays float32."""
    spec = RunSpec.from_dict(
        {"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2}, "stages": {"num_stages": 2}}
    )
    exact, fast = StageRuntime(spec, 0), StageRuntime(spec, 0, compute_dtype="bfloat16")
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    want, got = exact.forward("", ids, None, False), fast.forward("", ids, None, False)
    assert got.dtype == torch.float32 and all(p.dtype == torch.float32 for p in fast.params)
    assert not torch.equal(got, want)  # the matmuls did run in bfloat16
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    fast.backward("b", ids, torch.ones_like(want), None)
    assert all(a.dtype == torch.float32 and torch.isfinite(a).all() for a in fast.accumulator)
