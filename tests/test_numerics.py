"""The data path's tensor checks (peer/model/numerics.py): one pass each, and the same verdicts as the plain ones."""

from __future__ import annotations

import math

import pytest
import torch

from peer.model.numerics import all_finite, squared_norm


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_finite_finds_one_bad_element_anywhere(bad, dtype):
    x = torch.randn(64, 33).to(dtype)
    assert all_finite(x)
    for index in [(0, 0), (17, 5), (63, 32)]:
        y = x.clone()
        y[index] = bad
        assert not all_finite(y), (bad, index)
        assert all_finite(y[index[0] + 1 :]) and all_finite(y[: index[0]])  # the rest is fine
    assert all_finite(torch.empty(0, 8))
    assert all_finite(torch.tensor([3, 4]))  # integers are always finite


def test_squared_norm_fast_and_exact_agree_and_tell_inf():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(300, 200, generator=g) * 1e-3, torch.randn(5000, generator=g) * 10]
    expected = sum(float((t.double() ** 2).sum()) for t in tensors)
    assert squared_norm(tensors) == pytest.approx(expected, rel=1e-12)
    assert squared_norm(tensors, exact=False) == pytest.approx(expected, rel=1e-5)
    assert squared_norm([]) == 0.0
    broken = [tensors[0], torch.tensor([1.0, math.nan])]
    assert not math.isfinite(squared_norm(broken)) and not math.isfinite(squared_norm(broken, exact=False))


def test_our_adamw_is_torchs_bit_for_bit_and_shares_its_state():
    """peer.model.optim.AdamW (no torch.optim.Optimizer: its construction imports torch._dynamo) makes torch's
    AdamW update (foreach=False) exactly, through lr changes and a parameter without a gradient, in torch's state
    layout: a state taken from one goes on in the other."""
    from peer.model.optim import AdamW

    torch.manual_seed(0)
    ours_params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    theirs_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
    settings = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    ours = AdamW(ours_params, **settings)
    theirs = torch.optim.AdamW(theirs_params, **settings, foreach=False)
    for step in range(6):
        for optimizer in (ours, theirs):
            optimizer.param_groups[0]["lr"] = 1e-2 * (step + 1) / 6
        grads = [torch.randn_like(p) for p in ours_params]
        for params in (ours_params, theirs_params):
            for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                p.grad = None if step == 2 and i == 1 else g.clone()
        ours.step()
        theirs.step()
        ours.zero_grad(set_to_none=True)
        theirs.zero_grad(set_to_none=True)
        assert all(torch.equal(a, b) for a, b in zip(ours_params, theirs_params, strict=True)), step
    for a, b in zip(ours_params, theirs_params, strict=True):
        assert set(ours.state[a]) == set(theirs.state[b]) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in ours.state[a].items():
            other = theirs.state[b][key]
            assert value.dtype == other.dtype and value.device == other.device and torch.equal(value, other), key
