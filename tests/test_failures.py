"""Failures with a type (protocols.failures): reasons travel in trailing metadata, and a gone peer is told
by a refused TCP connect, never by reading a message. A real server's refusals are checked in
test_bad_input.py; these are the pieces on their own, over real sockets."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from peer.net.client import gone_after, refuses_connections
from peer.net.refusal import DEFAULT_REASONS, Refused
from protocols.failures import REASON_KEY, Reason, reason_metadata, reason_of


class _Error(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, trailing):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details="some message")


def test_a_reason_travels_in_trailing_metadata_and_unknown_ones_read_as_none():
    assert reason_of(_Error(grpc.StatusCode.UNAVAILABLE, reason_metadata(Reason.LEAVING))) == Reason.LEAVING
    assert reason_of(_Error(grpc.StatusCode.UNAVAILABLE, [])) is None
    assert reason_of(_Error(grpc.StatusCode.UNAVAILABLE, [(REASON_KEY, "from_a_newer_peer")])) is None
    assert reason_of(ValueError("not a call's error")) is None


def test_every_refusal_has_a_reason():
    assert Refused(grpc.StatusCode.INVALID_ARGUMENT, "x").reason == Reason.BAD_INPUT
    assert Refused(grpc.StatusCode.UNAVAILABLE, "x", Reason.LEAVING).reason == Reason.LEAVING
    with pytest.raises(KeyError):  # a code with no default needs its reason named
        Refused(grpc.StatusCode.INTERNAL, "x")
    assert set(DEFAULT_REASONS.values()) <= set(Reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_gone_peer_is_told_by_its_refused_port():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        alive = f"127.0.0.1:{listening.getsockname()[1]}"
        dead = f"127.0.0.1:{_free_port()}"

        async def check():
            assert not await refuses_connections(alive, 1.0)
            assert await refuses_connections(dead, 1.0)
            unavailable = _Error(grpc.StatusCode.UNAVAILABLE, [])
            assert await gone_after(unavailable, dead, 1.0)
            assert not await gone_after(unavailable, alive, 1.0)  # it failed, but something still listens
            leaving = _Error(grpc.StatusCode.UNAVAILABLE, reason_metadata(Reason.LEAVING))
            assert not await gone_after(leaving, dead, 1.0)  # a peer's handler said why: not a gone process

        asyncio.run(check())
