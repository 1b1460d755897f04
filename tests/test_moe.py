"""Mixture-of-experts: the layer's math, the expert runtime and batcher, and real expert hosts.

The real tests start a coordinator, stage servers, expert hosts and trainers as processes on
loopback; this process only talks gRPC to them (no hivemind here).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import signal
import time
import urllib.request

import grpc
import pytest
import torch
from helpers.calls import client as admitted_client

from peer.config import RunSpec
from peer.model.expert import ExpertRuntime
from peer.model.llama import StageModel
from peer.model.moe import ExpertsUnavailable, LocalExperts, MoE, make_expert
from peer.net.client import StageClient
from peer.server.batcher import Batcher
from peer.server.expert_host import choose_experts
from protocols import codec, expert_pb2, stage_pb2

SPEC = {
    "name": "moe",
    "seed": 3,
    "model": {
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "intermediate_size": 128,
        "max_seq_len": 32,
    },
    "stages": {"num_stages": 2},
    "training": {
        "micro_batch_size": 8,
        "seq_len": 32,
        "target_batch_size": 16,
        "total_steps": 400,
        "lr": 0.005,
        "warmup_steps": 2,
    },
    "moe": {"num_experts": 4, "top_k": 2, "layers": [1]},
    "averaging": {"averaging_timeout": 8.0},
}


# ---- unit: the layer, the expert runtime, the batcher ------------------------------------------
class _Partial:
    """A backend whose experts in `down` do not answer (the others are local)."""

    def __init__(self, experts: LocalExperts, down: set[int]):
        self.experts, self.down = experts, down

    def __call__(self, layer, tokens, top_index, samples=1):
        outputs, answered = self.experts(layer, tokens, top_index)
        for e in self.down:
            answered &= top_index != e
        return outputs * answered.unsqueeze(-1), answered


def test_moe_skips_missing_experts_and_renormalises():
    spec = RunSpec.from_dict(SPEC)
    experts = LocalExperts(make_expert(spec.model, spec.moe, 0, 1, e) for e in range(4))
    layer = MoE(spec.model, spec.moe, 1, _Partial(experts, {2}))
    x = torch.randn(3, 5, 64)
    out = layer(x).reshape(-1, 64)
    tokens = x.reshape(-1, 64)
    top_logits, top_index = layer.gate(tokens).topk(2, dim=-1)
    for t in range(tokens.shape[0]):  # by hand: a softmax over the experts that answered
        alive = [k for k in range(2) if int(top_index[t, k]) != 2]
        weights = torch.softmax(top_logits[t, alive], dim=0)
        expected = sum(
            w * experts[int(top_index[t, k])](tokens[t : t + 1])[0] for w, k in zip(weights, alive, strict=False)
        )
        torch.testing.assert_close(out[t], expected, atol=1e-6, rtol=1e-5)
    strict = MoE(
        spec.model, RunSpec.from_dict({**SPEC, "moe": {**SPEC["moe"], "min_answers": 2}}).moe, 1, layer.experts
    )
    strict.gate.load_state_dict(layer.gate.state_dict())
    with pytest.raises(ExpertsUnavailable, match=r"experts \[2\]"):
        strict(x)


def test_expert_runtime_batches_match_autograd():
    spec = RunSpec.from_dict(SPEC)
    runtime = ExpertRuntime(spec, "1.3")
    reference = make_expert(spec.model, spec.moe, spec.seed, 1, 3)
    xs = [torch.randn(n, 64) for n in (5, 3, 7)]
    gs = [torch.randn(n, 64) for n in (5, 3, 7)]
    outs = runtime.forward(["a", "b", "c"], xs, train=True)  # one merged batch, graph kept
    grads_hit, _ = runtime.backward(["c", "a", "b"], [xs[2], xs[0], xs[1]], [gs[2], gs[0], gs[1]], samples=6)
    grads_miss, _ = runtime.backward(["a"], [xs[0]], [gs[0]], samples=2)  # no cached batch: recomputed
    assert runtime.cache_hits == 1 and runtime.cache_misses == 1
    for x, g, out, expected_grad in zip(xs, gs, outs, [grads_hit[1], grads_hit[2], grads_hit[0]], strict=False):
        x = x.clone().requires_grad_(True)
        y = reference(x)
        torch.testing.assert_close(out, y.detach(), atol=1e-6, rtol=1e-5)
        (gx,) = torch.autograd.grad(y, x, g)
        torch.testing.assert_close(expected_grad, gx, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grads_miss[0], grads_hit[1], atol=1e-6, rtol=1e-5)
    # the accumulator holds the parameter gradients of every backward: a twice, b and c once
    y = sum((reference(x) * g).sum() * (2 if i == 0 else 1) for i, (x, g) in enumerate(zip(xs, gs, strict=False)))
    expected = torch.autograd.grad(y, list(reference.parameters()))
    for acc, e in zip(runtime.accumulator, expected, strict=False):
        torch.testing.assert_close(acc, e, atol=1e-5, rtol=1e-5)
    assert runtime.samples_accumulated == 8 and runtime.seq == 2


def test_batcher_merges_concurrent_requests():
    async def main():
        sizes = []

        async def run(requests):
            sizes.append(len(requests))
            await asyncio.sleep(0.01)
            return [r * 10 for r in requests]

        batcher = Batcher(run, max_rows=100, max_wait=0.005)
        results = await asyncio.gather(*(batcher.submit(10, i) for i in range(25)))
        return results, sizes

    results, sizes = asyncio.run(main())
    assert results == [i * 10 for i in range(25)]
    assert sum(sizes) == 25 and max(sizes) <= 10 and len(sizes) < 25  # merged, never above max_rows


def test_choose_experts_takes_the_least_replicated():
    counts = {"1.0": 2, "1.1": 0, "1.2": 1, "1.3": 0}
    assert choose_experts(counts, 2) == ["1.1", "1.3"]
    assert choose_experts(counts, 3) == ["1.1", "1.3", "1.2"]


# ---- real processes -----------------------------------------------------------------------
def _expert_host(swarm, name: str, experts: str, extra: list[str] = ()):
    return swarm.start(name, _join(swarm, name, "--experts", experts, *extra))


def _join(swarm, name, *extra):
    from peer.cli.demo import loopback_join

    return loopback_join(swarm.maddr, name, *extra)


def _hosted_at(swarm, peer, timeout: float = 120) -> str:
    return swarm.known(peer.wait_for(r"Serving experts .* at (\S+:\d+)", timeout).group(1), peer.name)


def _tensor(t: torch.Tensor):
    return codec.encode(t)


async def _reference(client: StageClient, spec: RunSpec, stage_endpoint: str, hosts: dict[str, str]):
    """The local stage 1, with the weights its server and the expert hosts hold now."""
    model = StageModel(spec, 1)
    _, tensors = await client.get_state(stage_endpoint, spec.name, 1, timeout=20)
    weights = {name[len("param/") :]: t for name, t in tensors.items() if name.startswith("param/")}
    for uid, endpoint in hosts.items():
        _, tensors = await client.get_state(endpoint, spec.name, 1, timeout=20, expert=uid)
        index = uid.split(".")[1]
        for name, t in tensors.items():
            if name.startswith("param/"):
                weights[f"model.layers.1.block_sparse_moe.experts.{index}.{name[len('param/') :]}"] = t
    model.load_state_dict(weights, strict=True)
    return model


def test_remote_moe_matches_local_refuses_bad_input_and_trains(swarm):
    spec = RunSpec.from_dict(SPEC)
    swarm.coordinator(SPEC)
    host_a = _expert_host(swarm, "experts-a", "1.0,1.1", ["--set", "experts.max_request_tokens=256"])
    host_b = _expert_host(swarm, "experts-b", "1.2,1.3")
    s0, s1 = swarm.server("s0", stage=0), swarm.server("s1", stage=1)
    a, b = _hosted_at(swarm, host_a), _hosted_at(swarm, host_b)
    _e0, e1 = swarm.endpoint(s0), swarm.endpoint(s1)
    hosts = {"1.0": a, "1.1": a, "1.2": b, "1.3": b}

    async def checks():
        client = admitted_client(e1, 2**20, 2**28)
        try:
            # -- one host per expert, compression off: the remote layer equals the local one
            model = await _reference(client, spec, e1, hosts)
            gen = torch.Generator().manual_seed(7)
            x = torch.randn(2, 32, 64, generator=gen)
            y = torch.randint(0, 256, (2, 32), generator=gen)
            forward = stage_pb2.ForwardRequest(run_id="moe", stage=1, inputs=_tensor(x))
            response, returned = await client.forward(e1, forward, timeout=30)
            logits = codec.decode(response.outputs, payload=returned.get("outputs"))
            backward = stage_pb2.BackwardRequest(run_id="moe", stage=1, inputs=_tensor(x), targets=_tensor(y))
            response, returned = await client.backward(e1, backward, timeout=30)
            grad_inputs = codec.decode(response.grad_inputs, payload=returned.get("grad_inputs"))
            xr = x.clone().requires_grad_(True)
            with torch.no_grad():
                expected_logits = model(x)
            loss = model(xr, y)
            (expected_grad,) = torch.autograd.grad((loss + model.aux_loss()) * 2, xr)
            torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=0)
            assert abs(response.loss - loss.item()) < 1e-5
            torch.testing.assert_close(grad_inputs, expected_grad, atol=1e-5, rtol=0)

            # -- bad input to the expert service: a clear status each time, and the host keeps serving
            def call(expert, tokens):
                request = expert_pb2.ExpertForwardRequest(run_id="moe", expert=expert, inputs=_tensor(tokens))
                return client.expert_forward(a, request, {}, timeout=10)

            cases = [
                ("1.3", torch.randn(4, 64), grpc.StatusCode.NOT_FOUND, "not hosted here"),
                ("7.0", torch.randn(4, 64), grpc.StatusCode.NOT_FOUND, "not hosted here"),
                ("1.0", torch.randn(4, 32), grpc.StatusCode.INVALID_ARGUMENT, "shape"),
                ("1.0", torch.randn(2, 4, 64), grpc.StatusCode.INVALID_ARGUMENT, "shape"),
                ("1.0", torch.full((4, 64), float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "NaN"),
                ("1.0", torch.randn(300, 64), grpc.StatusCode.RESOURCE_EXHAUSTED, "at most 256"),
            ]
            for expert, tokens, code, words in cases:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call(expert, tokens)
                assert caught.value.code() == code and words in caught.value.details(), caught.value
            wrong_run = expert_pb2.ExpertForwardRequest(
                run_id="other", expert="1.0", inputs=_tensor(torch.randn(2, 64))
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client.expert_forward(a, wrong_run, {}, timeout=10)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            no_inputs = expert_pb2.ExpertBackwardRequest(
                run_id="moe", expert="1.0", uid="never-sent", samples=1, grad_outputs=_tensor(torch.randn(3, 64))
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client.expert_backward(a, no_inputs, {}, timeout=10)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "send the inputs" in caught.value.details()
            # a backward that claims 2^32 - 1 samples (it would steer the host's clip and outweigh every other
            # caller's gradients in the step): bounded by the run's micro-batch
            claims = expert_pb2.ExpertBackwardRequest(
                run_id="moe", expert="1.0", uid="", samples=2**32 - 1, grad_outputs=_tensor(torch.randn(3, 64))
            )
            claims.inputs.CopyFrom(_tensor(torch.randn(3, 64)))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client.expert_backward(a, claims, {}, timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "training.micro_batch_size" in caught.value.details(), caught.value.details()
            response, returned = await call("1.0", torch.randn(5, 64))
            assert list(codec.decode(response.outputs, payload=returned.get("outputs")).shape) == [5, 64]
            assert (await client.info(a, timeout=10, expert="1.1")).state == "serving"
        finally:
            await client.close()

    asyncio.run(checks())

    # -- training end to end: the loss falls, the experts step
    trainer = swarm.trainer("trainer", ["--max-micro-batches", "70"])
    assert trainer.wait(300) == 0, trainer.output()[-3000:]
    losses = [e["loss"] for e in swarm.log("trainer") if e["type"] == "micro_batch"]
    assert len(losses) == 70
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < first - 1.0, (first, last)
    steps = [int(m) for m in re.findall(r"expert 1\.\d step (\d+)", host_a.output() + host_b.output())]
    assert steps and max(steps) >= 20, steps


@pytest.mark.slow
def test_killed_expert_host_training_continues_and_a_newcomer_takes_its_experts(swarm):
    swarm.coordinator(SPEC)
    host_a = _expert_host(swarm, "experts-a", "1.0,1.1,1.2")
    host_b = _expert_host(swarm, "experts-b", "1.1,1.2,1.3")
    s0, s1 = swarm.server("s0", stage=0), swarm.server("s1", stage=1)
    a, _ = _hosted_at(swarm, host_a), _hosted_at(swarm, host_b)
    swarm.endpoint(s0), swarm.endpoint(s1)
    trainer = swarm.trainer("trainer", ["--max-micro-batches", "2000"])  # stopped below
    deadline = time.monotonic() + 120
    while len([e for e in swarm.log("trainer") if e["type"] == "micro_batch"]) < 15:
        assert time.monotonic() < deadline and trainer.proc.poll() is None, trainer.output()[-3000:]
        time.sleep(0.5)
    host_a.signal(signal.SIGKILL)
    killed_at = len([e for e in swarm.log("trainer") if e["type"] == "micro_batch"])
    # expert 1.0 has no replica left: its tokens go to their other expert; 1.1 and 1.2 go to host b
    newcomer = _expert_host(swarm, "experts-c", "1")
    assert re.search(r"Hosting 1 expert\(s\) on cpu: 1\.0\.", newcomer.wait_for(r"Hosting .*", 120).group(0))
    c = _hosted_at(swarm, newcomer)
    newcomer_at = len([e for e in swarm.log("trainer") if e["type"] == "micro_batch"])
    deadline = time.monotonic() + 120
    while len([e for e in swarm.log("trainer") if e["type"] == "micro_batch"]) < newcomer_at + 20:
        assert time.monotonic() < deadline and trainer.proc.poll() is None, trainer.output()[-3000:]
        time.sleep(0.5)
    trainer.signal(signal.SIGTERM)  # a graceful stop: finishes what is under way, exits 0 if nothing was given up
    assert trainer.wait(120) == 0, trainer.output()[-3000:]
    assert "0 given up" in trainer.output()
    losses = [e["loss"] for e in swarm.log("trainer") if e["type"] == "micro_batch"]
    assert killed_at < newcomer_at < len(losses) - 15, (killed_at, newcomer_at, len(losses))
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10
    stage_log = s1.output()
    # the dead host's calls failed (the first, to whichever of its experts, bans the host) and moved on
    assert re.search(rf"expert 1\.[012] \w+ on {re.escape(a)} failed", stage_log), stage_log[-3000:]

    async def newcomer_worked():
        client = admitted_client(c, 2**20, 2**28)
        try:
            return await client.info(c, timeout=10, expert="1.0")
        finally:
            await client.close()

    info = asyncio.run(newcomer_worked())
    # the stage's calls reached the newcomer's expert: it counted their tokens, stepped or still accumulating
    assert info.samples_stepped + info.samples_accumulated > 0, info

    # peer status shows the coverage once the killed host's records have expired (network.record_ttl, 10 s):
    # every expert of layer 1 hosted again, 1.0 by the newcomer alone
    deadline = time.monotonic() + 30
    for attempt in itertools.count():
        status = swarm.start(f"status{attempt}", ["status", swarm.maddr])
        assert status.wait(90) == 0, status.output()
        row = re.search(r"│ 1 +│ (\d)/4 +│ ([0-9: ]+?) +│ (\S+) ", status.output())
        assert row is not None, status.output()
        covered = row.group(1) == "4" and row.group(2).startswith("0:1 ") and row.group(3) == "none"
        if covered or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert covered, status.output()

    # the coordinator's dashboard shows the same coverage, and the killed host's experts going away
    url = swarm.peers[0].wait_for(r"Dashboard at (http://\S+/)", 10).group(1)
    deadline = time.monotonic() + 15
    while True:  # the page's state is one look (dashboard.period) old
        state = json.loads(urllib.request.urlopen(url + "api/state", timeout=10).read())
        (layer,) = state["experts"]
        serving = {e["uid"]: [h["endpoint"] for h in e["hosts"] if h["state"] == "serving"] for e in layer["experts"]}
        if (layer["hosted"] == 4 and serving["1.0"] == [c]) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert layer["hosted"] == 4 and serving["1.0"] == [c], serving
    gone = [e["text"] for e in state["events"] if e["kind"] in ("silent", "vanish") and "expert 1.0" in e["text"]]
    assert gone, state["events"]
