"""Addresses a user gives (multiaddrs, the coordinator's peer id): checked at once, before anything heavy.

`peer join`, `peer status` and `peer coordinator --initial-peers` call these before torch and
hivemind are even imported, so a mistyped or dead address is said within seconds.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

from dht.errors import DHTStartError, UserError
from dht.identity import IdentityError, public_key_from_peer_id


class AddressError(UserError, ValueError):
    """An address or peer id that cannot name a run's peer; the message says which and why."""


def coordinator_peer_id(maddr: str, coordinator: str | None = None) -> str:
    """The run's trust anchor: `coordinator` when given, else the `/p2p/...` part of `maddr`.

    Without `coordinator`, `maddr` must be the coordinator's own address; with it, `maddr` may be
    any peer of the run or a plain DHT bootstrap node.
    """
    if coordinator:
        try:
            public_key_from_peer_id(coordinator)
        except IdentityError as e:
            raise AddressError(f"--coordinator: {e}") from None
        return coordinator
    parts = maddr.strip().split("/")
    if "p2p" not in parts or parts.index("p2p") + 1 >= len(parts):
        raise AddressError(f"{maddr!r} has no /p2p/<peer id> part; copy the whole address the coordinator printed")
    peer_id = parts[parts.index("p2p") + 1]
    try:
        public_key_from_peer_id(peer_id)
    except IdentityError as e:
        raise AddressError(f"{maddr!r}: {e}") from None
    return peer_id


def dial_address(maddr: str) -> tuple[str, int]:
    """(host, TCP port) of a multiaddr like /ip4/HOST/tcp/PORT/p2p/ID; AddressError if it names none."""
    parts = maddr.strip().split("/")
    try:
        host = parts[parts.index(next(p for p in parts if p in ("ip4", "ip6", "dns", "dns4", "dns6"))) + 1]
        port = int(parts[parts.index("tcp") + 1])
    except (StopIteration, ValueError, IndexError):
        raise AddressError(f"{maddr!r} is not a multiaddr like /ip4/HOST/tcp/PORT/p2p/PEER_ID") from None
    return host, port


def answering(maddrs: list[str], timeout: float) -> list[str]:
    """The multiaddrs at which something accepts a TCP connection within `timeout` (all tried at once)."""
    if not maddrs:
        return []

    def answers(maddr: str) -> bool:
        try:
            check_reachable(maddr, timeout)
            return True
        except (DHTStartError, AddressError):
            return False

    with ThreadPoolExecutor(max_workers=min(16, len(maddrs))) as pool:
        return [m for m, ok in zip(maddrs, pool.map(answers, maddrs), strict=True) if ok]


def check_reachable(maddr: str, timeout: float) -> None:
    """Say at once (DHTStartError) when nothing answers at the address a user gave, instead of a long wait."""
    host, port = dial_address(maddr)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except TimeoutError:
        raise DHTStartError(
            f"no answer from {host}:{port} within {timeout:g} s ({maddr}); check the address and that the peer "
            "runs and its DHT port is reachable from here"
        ) from None
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise DHTStartError(
            f"cannot reach {host}:{port} ({reason}); check the address ({maddr}) and that the peer runs"
        ) from None
