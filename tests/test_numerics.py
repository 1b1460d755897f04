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
