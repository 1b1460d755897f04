"""Fuzz every gRPC method of a stage server and an expert host (real processes, real TLS).

Malformed bytes, mutated valid messages, oversized and NaN tensors, wrong dtypes and shapes: each
call must end with a clear status (OK or a refusal naming the problem, never INTERNAL or UNKNOWN),
the servers must keep serving, and their memory must stay bounded.
"""

from __future__ import annotations

import asyncio
import math
import struct

import grpc
import pytest
import torch
from helpers.calls import channel, info
from helpers.calls import client as admitted_client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols import codec, expert_pb2, stage_pb2, tensor_pb2

SPEC = {
    "name": "fuzz",
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64, "max_seq_len": 16},
    "stages": {"num_stages": 2},
    "moe": {"num_experts": 2, "top_k": 1, "layers": [1], "expert_size": 32},
    "training": {"micro_batch_size": 2, "seq_len": 16, "target_batch_size": 4, "total_steps": 5},
}
LIMITS = [
    *("--set", "server.max_tensor_elements=4096", "--set", "server.max_message_bytes=200000"),
    *("--set", "server.max_requests_per_peer=2", "--set", "server.max_inflight_bytes=12000"),
]
CLEAR = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.NOT_FOUND,  # an expert this host does not hold
    grpc.StatusCode.UNAVAILABLE,  # only "experts unavailable" or "server busy": checked below
}
UNARY = ["Forward", "Backward", "Info", "Round"]
STREAMS = ["ForwardStream", "BackwardStream"]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _tensors():
    """Tensor messages: good ones, NaN/Inf, wrong dtype, wrong or huge shapes, short data."""
    good = st.builds(
        lambda b, s: codec.encode(torch.randn(b, s, 32)),
        st.integers(1, 2),
        st.integers(1, 16),
    )
    nan = st.sampled_from([math.nan, math.inf, -math.inf]).map(lambda v: codec.encode(torch.full((1, 4, 32), v)))
    raw = st.builds(
        lambda dtype, shape, data, tensor_codec, block: tensor_pb2.Tensor(
            dtype=dtype, shape=shape, data=data, codec=tensor_codec, block_size=block
        ),
        st.integers(0, 12),
        st.lists(st.integers(-(2**40), 2**40), max_size=6),
        st.binary(max_size=512),
        st.integers(0, 6),
        st.integers(0, 2**32 - 1),
    )
    return st.one_of(good, nan, raw)


def _messages(kind: type):
    fields = {
        "run_id": st.sampled_from(["fuzz", "other", ""]),
        "stage": st.integers(0, 3),
        "uid": st.text(max_size=20),
    }
    if kind in (stage_pb2.ForwardRequest, stage_pb2.BackwardRequest):
        fields["inputs"] = _tensors()
        fields["targets"] = st.one_of(st.none(), _tensors())
        fields["output_codec"] = st.integers(0, 3)
    if kind is stage_pb2.BackwardRequest:
        fields["grad_outputs"] = st.one_of(st.none(), _tensors())
    if kind in (expert_pb2.ExpertForwardRequest, expert_pb2.ExpertBackwardRequest):
        fields = {"run_id": st.sampled_from(["fuzz", "x"]), "expert": st.sampled_from(["1.0", "1.1", "9.9", ""])}
        fields["inputs"] = _tensors()
        if kind is expert_pb2.ExpertBackwardRequest:
            fields["grad_outputs"] = _tensors()
    known = {f.name for f in kind.DESCRIPTOR.fields}
    fields = {k: v for k, v in fields.items() if k in known}

    def build(values):
        return kind(**{k: v for k, v in values.items() if v is not None}).SerializeToString()

    return st.fixed_dictionaries(fields).map(build)


def _mutated(data: bytes, flips: list[tuple[int, int]]) -> bytes:
    buf = bytearray(data)
    for position, value in flips:
        if buf:
            buf[position % len(buf)] = value
    return bytes(buf)


def _payloads(kinds: list[type]):
    structured = st.one_of(*(_messages(k) for k in kinds))
    mutated = st.builds(_mutated, structured, st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255))))
    return st.one_of(st.binary(max_size=2048), structured, mutated)


def _frames():
    """A framed stream: a header Chunk then data Chunks, any of them malformed."""
    chunk = st.binary(max_size=600).map(lambda d: tensor_pb2.Chunk(data=d).SerializeToString())
    lying = st.builds(lambda n, d: b"\x0a" + _varint(n) + d, st.integers(0, 2**40), st.binary(max_size=64))
    return st.lists(st.one_of(chunk, lying, st.binary(max_size=64)), max_size=6)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _check(call) -> None:
    try:
        call()
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
        assert code in CLEAR, f"{code}: {details}"
        assert details, f"{code} without a message"
        if code == grpc.StatusCode.UNAVAILABLE:
            assert "experts unavailable" in details or "busy" in details, details


def _fuzz(endpoint: str, service: str, kinds: list[type]) -> None:
    """Hypothesis-drawn calls of every method of `service` at `endpoint`."""
    with channel(endpoint) as ch:
        kinds = [*kinds, stage_pb2.InfoRequest, stage_pb2.RoundRequest, stage_pb2.StateRequest]

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(method=st.sampled_from(UNARY), payload=_payloads(kinds))
        def unary(method, payload):
            call = ch.unary_unary(f"/{service}/{method}")
            _check(lambda: call(payload, timeout=10))

        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(method=st.sampled_from(STREAMS), frames=_frames())
        def streams(method, frames):
            call = ch.stream_stream(f"/{service}/{method}")
            _check(lambda: list(call(iter(frames), timeout=10)))

        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(payload=_payloads([stage_pb2.StateRequest]))
        def get_state(payload):
            call = ch.unary_stream(f"/{service}/GetState")
            _check(lambda: list(call(payload, timeout=20)))

        unary()
        streams()
        get_state()
        # oversized: a message past server.max_message_bytes, unary and streamed
        big = stage_pb2.ForwardRequest(run_id="fuzz", stage=1, inputs=codec.encode(torch.randn(2, 16, 2000)))
        _check(lambda: ch.unary_unary(f"/{service}/Forward")(big.SerializeToString(), timeout=10))
        header = tensor_pb2.Chunk(data=b"\x0a" + struct.pack("<I", 0)).SerializeToString()
        huge = [header, *[tensor_pb2.Chunk(data=b"x" * 60000).SerializeToString()] * 8]
        _check(lambda: list(ch.stream_stream(f"/{service}/ForwardStream")(iter(huge), timeout=10)))


@pytest.fixture
def servers(swarm):
    swarm.coordinator(SPEC)
    host = swarm.start(
        "experts",
        [
            "join",
            swarm.maddr,
            "--identity",
            "experts.pem",
            "--host",
            "127.0.0.1",
            "--threads",
            "1",
            "--experts",
            "1.0,1.1",
            *LIMITS,
        ],
    )
    expert_endpoint = swarm.known(host.wait_for(r"Serving experts .* at (\S+:\d+)", 120).group(1), "experts")
    stage = swarm.server("s1", 1, LIMITS)
    return (stage, swarm.endpoint(stage)), (host, expert_endpoint)


def test_every_method_answers_garbage_with_a_clear_status_and_keeps_serving(servers):
    (stage, stage_endpoint), (host, expert_endpoint) = servers
    targets = [
        (stage, stage_endpoint, "swarmtrain.Stage", [stage_pb2.ForwardRequest, stage_pb2.BackwardRequest]),
        (
            host,
            expert_endpoint,
            "swarmtrain.Expert",
            [expert_pb2.ExpertForwardRequest, expert_pb2.ExpertBackwardRequest],
        ),
    ]
    before = {peer.name: _rss_mb(peer.proc.pid) for peer, *_ in targets}
    for peer, endpoint, service, kinds in targets:
        _fuzz(endpoint, service, kinds)
        assert peer.proc.poll() is None, f"{peer.name} died:\n{peer.output()[-3000:]}"
    # still serving, and memory stayed bounded
    assert info(stage_endpoint).stage == 1
    with channel(expert_endpoint) as ch:
        answer = ch.unary_unary(
            "/swarmtrain.Expert/Info",
            request_serializer=stage_pb2.InfoRequest.SerializeToString,
            response_deserializer=stage_pb2.InfoResponse.FromString,
        )(stage_pb2.InfoRequest(expert="1.0"), timeout=10)
        assert answer.run_id == "fuzz"
    for peer, *_ in targets:
        grown = _rss_mb(peer.proc.pid) - before[peer.name]
        assert grown < 300, f"{peer.name} grew by {grown:.0f} MB"

    # limits: one caller's concurrent calls (2 in flight hold 8192 bytes, within max_inflight_bytes,
    # so the burst meets only the per-peer limit), then one request over max_inflight_bytes alone
    async def burst():
        client = admitted_client(stage_endpoint, 2**20, 2**28)
        request = stage_pb2.ForwardRequest(run_id="fuzz", stage=1, inputs=codec.encode(torch.randn(2, 16, 32)))
        try:
            return await asyncio.gather(
                *(client.forward(stage_endpoint, request, timeout=30) for _ in range(24)), return_exceptions=True
            )
        finally:
            await client.close()

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(refused) < len(results), results  # some went through
    assert refused and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused), refused
    assert any("server.max_requests_per_peer" in r.details() for r in refused)
    big = stage_pb2.ForwardRequest(run_id="fuzz", stage=1, inputs=codec.encode(torch.randn(8, 16, 32)))
    with channel(stage_endpoint) as ch, pytest.raises(grpc.RpcError) as e:
        ch.unary_unary("/swarmtrain.Stage/Forward")(big.SerializeToString(), timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "server.max_inflight_bytes" in e.value.details()
