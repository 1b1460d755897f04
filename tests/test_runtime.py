"""Unit tests of a stage's runtime (the torch side of a stage server), without processes."""

from __future__ import annotations

import torch

from peer.config import RunSpec
from peer.model.runtime import StageRuntime


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


def test_the_runs_training_dtype_and_activation_checkpointing():
    """training.dtype = "bf16" runs every stage under autocast (a server's compute_dtype overrides it);
    activation checkpointing recomputes the blocks in the backward and gives the same gradients."""
    base = {"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2}, "stages": {"num_stages": 2}}
    bf16 = RunSpec.from_dict({**base, "training": {"dtype": "bf16"}})
    assert StageRuntime(bf16, 0).compute_dtype == torch.bfloat16
    assert StageRuntime(bf16, 0, compute_dtype="float32").compute_dtype == torch.float32
    plain = StageRuntime(RunSpec.from_dict(base), 1)
    recomputed = StageRuntime(RunSpec.from_dict({**base, "training": {"activation_checkpointing": True}}), 1)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 8, 32, generator=gen), torch.randint(0, 256, (3, 8), generator=gen)
    calls = []

    def counted(forward):
        def run(*args):
            calls.append(1)
            return forward(*args)

        return run

    for layer in recomputed.model.layers.values():  # each block runs twice: forward, then again in backward
        layer.forward = counted(layer.forward)
    want, got = plain.backward("a", x, None, y), recomputed.backward("a", x, None, y)
    assert len(calls) == 2 * len(recomputed.model.layers)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    for a, b in zip(recomputed.accumulator, plain.accumulator, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_resync_drops_exactly_what_the_donors_step_counted_of_rounds_that_failed_here():
    """Two rounds at one step fail here; a partner's step counted the first one's take only (it
    succeeded there). Loading the partner's state drops that part and keeps the rest (12 samples
    were lost in a chaos run when the whole second take was dropped)."""
    spec = RunSpec.from_dict(
        {"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2}, "stages": {"num_stages": 2}}
    )
    me, donor = StageRuntime(spec, 1), StageRuntime(spec, 1)
    gen = torch.Generator().manual_seed(0)

    def backward(uid: str, rows: int) -> None:
        x, y = torch.randn(rows, 8, 32, generator=gen), torch.randint(0, 256, (rows, 8), generator=gen)
        me.backward(uid, x, None, y)

    backward("a", 4)
    backward("b", 4)
    first = [a.clone() for a in me.accumulator]  # a and b, summed
    grads, samples = me.take_for_round()  # the first round takes a and b (seq 2) ...
    assert (samples, me.taken_seq) == (8, 2)
    me.restore_round(grads, samples, me.taken_seq)  # ... and fails here, while the partner steps with it
    backward("c", 3)
    grads, samples = me.take_for_round()  # a second round at the same step takes a, b and c ...
    assert (samples, me.taken_seq) == (11, 3)
    me.restore_round(grads, samples, me.taken_seq)  # ... and fails too
    backward("d", 2)  # and a backward arrives after it
    before = [a.clone() for a in me.accumulator]

    donor.apply_step(
        [torch.zeros_like(p) for p in donor.params], 8, 0, ["donor", "me"], {"donor": (1, 5), "me": (me.incarnation, 2)}
    )
    metadata, tensors = donor.snapshot()
    me.load_state(metadata, tensors, "me")
    assert me.epoch == 1 and me.stepped_seq == 2  # a and b are in the donor's step: their receipts settle
    assert me.samples_accumulated == 3 + 2  # c and d wait for the next step; nothing counted twice or lost
    assert me.restored == []
    for acc, total, ab in zip(me.accumulator, before, first, strict=True):
        torch.testing.assert_close(acc, total - ab, rtol=1e-5, atol=1e-6)  # exactly c and d's gradients


def test_a_resync_keeps_what_the_donors_step_did_not_count():
    spec = RunSpec.from_dict(
        {"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2}, "stages": {"num_stages": 2}}
    )
    me, donor = StageRuntime(spec, 1), StageRuntime(spec, 1)
    x, y = torch.randn(4, 8, 32), torch.randint(0, 256, (4, 8))
    me.backward("a", x, None, y)
    grads, samples = me.take_for_round()
    me.restore_round(grads, samples, me.taken_seq)
    donor.apply_step([torch.zeros_like(p) for p in donor.params], 4, 0, ["donor"], {"donor": (1, 1)})
    me.load_state(*donor.snapshot(), "me")
    assert me.samples_accumulated == 4 and me.stepped_seq == 0


def test_a_state_sent_in_shards_is_one_step_even_if_the_donor_steps_meanwhile():
    """A joiner asks for a big state in several shards of one step; the donor pins that step at the first
    shard, copying only that shard, and serves the others of that step though it stepped in between: the step
    first copied the shards still owed. A shard asked again after the step is not of that step any more."""
    spec = RunSpec.from_dict(
        {"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2}, "stages": {"num_stages": 2}}
    )
    donor = StageRuntime(spec, 1)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 8, 32, generator=gen), torch.randint(0, 256, (3, 8), generator=gen)
    donor.backward("a", x, None, y)
    grads, samples = donor.take_gradients()
    donor.apply_step(grads, samples, donor.taken_seq)
    before = {n: t.detach().clone() for n, t in donor.state_tensors().items()}  # weights and Adam's state
    first_meta, first = donor.snapshot(0, 3, epoch=1)
    assert not donor._shared_snapshot["kept"], "the first shard's request copied more than its shard"
    donor.backward("b", x, None, y)  # the donor steps while the joiner fetches the other shards
    grads, samples = donor.take_gradients()
    donor.apply_step(grads, samples, donor.taken_seq)
    owed = set(donor._shared_snapshot["kept"])
    parts = [first, donor.snapshot(1, 3, epoch=1)[1], donor.snapshot(2, 3, epoch=1)[1]]
    assert first_meta["epoch"] == 1 and donor.epoch == 2
    assert owed == set(parts[1]) | set(parts[2]), "the step copied other than the shards still owed"
    merged = {k: t for part in parts for k, t in part.items()}
    assert len(merged) == sum(len(p) for p in parts) == first_meta["tensor_count"] == len(before)
    assert all(torch.equal(merged[k], t) for k, t in before.items())  # the step-1 state, not step 2's
    assert donor.snapshot(0, 3, epoch=2)[0]["epoch"] == 2  # a later request gets the state as it is now
    donor.snapshot(1, 3, epoch=2)
    donor.backward("c", x, None, y)
    grads, samples = donor.take_gradients()
    donor.apply_step(grads, samples, donor.taken_seq)
    assert donor.snapshot(1, 3, epoch=2)[0]["epoch"] == 3, "a shard sent before the step was sent again of step 2"


def test_the_forwards_a_step_would_wait_for_are_those_on_its_weights_without_their_backward():
    """What a replica drains before a step (peer.server.replica_round): training forwards cached on the current
    weights whose backward has not come; not one whose backward came, not one from before the last step."""
    spec = RunSpec.from_dict(
        {"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2}, "stages": {"num_stages": 2}}
    )
    runtime = StageRuntime(spec, 0)
    tokens = torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(0))
    grad_out = torch.randn(3, 8, 32)
    for uid in ("a", "b"):
        runtime.forward(uid, tokens, None, True)
    runtime.forward("eval", tokens, None, False)  # no backward will come: nothing cached
    assert runtime.awaiting_backward() == {"a", "b"} and runtime.samples_awaiting_backward() == 6
    runtime.backward("a", tokens, grad_out, None)
    assert runtime.awaiting_backward() == {"b"} and runtime.samples_awaiting_backward() == 3
    me = "me"
    grads, samples = runtime.take_for_round()
    runtime.apply_round(grads, samples, runtime.taken_seq, [me], {me: (runtime.incarnation, runtime.taken_seq)})
    # "b" ran on the weights before this step: its backward applies a step late whatever a drain waits for now
    assert runtime.awaiting_backward() == frozenset() and runtime.samples_awaiting_backward() == 0
    runtime.backward("b", tokens, grad_out, None)
    assert runtime.cache_stashed == 1
