"""A server's stage takes memory only for the weights it keeps: built unwritten, filled by the state it
loads (whose tensors become its parameters) or by the run's seed, with averaging buffers and an
accumulator that stay out of memory until used. The figure at scale is benchmarks/scale.py's."""

from __future__ import annotations

import pytest
import torch

from peer.config import RunSpec
from peer.model import allocation
from peer.model.llama import StageModel
from peer.model.part_state import StateError
from peer.model.runtime import StageRuntime
from peer.process import memory
from protocols import codec

MB = 2**20


def spec(tie: bool = False, stages: int = 2) -> RunSpec:
    model = {"hidden_size": 64, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "tie_embeddings": tie}
    return RunSpec.from_dict({"model": model, "stages": {"num_stages": stages}})


def test_zeros_take_memory_only_where_written():
    before = memory.resident()
    plain = allocation.zeros((64, MB // 4))  # 64 MB
    assert memory.resident() - before < 8 * MB
    assert float(plain.sum()) == 0.0
    plain[:48].fill_(1.0)
    assert memory.resident() - before > 40 * MB
    assert float(plain.sum()) == 48 * MB // 4


@pytest.mark.parametrize("tie", [False, True])
def test_an_unallocated_stage_from_the_seed_equals_a_built_one(tie):
    s = spec(tie, stages=1 if tie else 2)
    for stage in range(s.stages.num_stages):
        built, later = StageModel(s, stage), StageModel.unallocated(s, stage)
        assert all(float(p.abs().sum()) == 0.0 for p in later.parameters())
        later.init_from_seed()
        want, got = built.state_dict(), later.state_dict()
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(want[name], got[name]), name
        assert torch.equal(built.rope_cos, later.rope_cos)
        if tie:
            assert later.lm_head.weight is later.model.embed_tokens.weight


def wire(t: torch.Tensor) -> torch.Tensor:
    """`t` as a receiver decodes it from a framed stream: its own buffer."""
    message, payload = codec.encode_payload(t)
    return codec.decode(message, payload=bytearray(payload))


def test_a_loaded_state_becomes_the_parameters_without_a_copy():
    donor = StageRuntime(spec(), 1)
    x, y = torch.randn(2, 8, 64), torch.randint(0, 256, (2, 8))
    donor.backward("a", x, None, y)
    donor.apply_step(*donor.take_gradients(), 1, ["donor"], {"donor": (1, 1)})
    metadata, tensors = donor.snapshot()
    received = {name: wire(t) for name, t in tensors.items()}
    joiner = StageRuntime(spec(), 1, init=False)
    assert not joiner.initialized
    joiner.load_state(metadata, received, "joiner")
    assert joiner.initialized and joiner.epoch == 1
    for name, p in zip(joiner.param_names, joiner.params, strict=True):
        assert p.data_ptr() == received[f"param/{name}"].data_ptr()  # the decoded buffer, not a copy
        assert torch.equal(p, dict(zip(donor.param_names, donor.params, strict=True))[name])
        assert joiner.optimizer.state[p]["exp_avg"].data_ptr() == received[f"optim/{name}/exp_avg"].data_ptr()
    joiner.init_from_seed()  # loaded: nothing to do
    assert torch.equal(joiner.params[0], donor.params[0])
    # it trains like the donor from there
    assert joiner.backward("b", x, None, y)[1] == donor.backward("b", x, None, y)[1]


def test_a_refused_state_leaves_an_unallocated_stage_for_the_seed():
    joiner, seeded = StageRuntime(spec(), 0, init=False), StageRuntime(spec(), 0)
    metadata, tensors = seeded.snapshot()
    tensors["param/model.embed_tokens.weight"][0, 0] = float("nan")
    with pytest.raises(StateError, match="not finite"):
        joiner.load_state(metadata, tensors, "joiner")
    assert not joiner.initialized  # nothing was half loaded
    joiner.init_from_seed()
    for a, b in zip(joiner.params, seeded.params, strict=True):
        assert torch.equal(a, b)
