"""The peer's DHT node: hivemind's DHT with Swarmtrain's identity, signed records and deadlines.

This is the one module that imports `hivemind.DHT`. Create it before any gRPC channel or server
in the process: hivemind forks, and gRPC does not survive a fork.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import multiprocessing
import os
import shutil
import threading
import time
from collections.abc import Sequence
from typing import TypeVar

import msgpack
from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils import get_dht_time
from pydantic import ValidationError

from dht import envelope, keys
from dht.errors import DHTStartError  # noqa: F401 - raised here, imported from here by callers
from dht.gate import Gate
from dht.identity import Identity
from dht.records import Record
from dht.validator import SignedRecordValidator
from protocols.version import software_version

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=Record)


async def _count_neighbours(_dht, node) -> int:
    """Runs inside the DHT process: how many peers the routing table knows."""
    return len(node.protocol.routing_table.uid_to_peer_id)


async def _local_subkeys(key_ids: list[bytes], _dht, node) -> list[list[tuple[str, float]]]:
    """Runs inside the DHT process: per key, the (subkey, expiration) pairs this node itself holds under it, without
    their values (no network)."""
    out = []
    for key_id in key_ids:
        found = node.protocol.storage.get(DHTID.from_bytes(key_id))
        held = found.value.items() if found is not None and isinstance(found.value, DictionaryDHTValue) else ()
        out.append(sorted((repr(subkey), item.expiration_time) for subkey, item in held))
    return out


async def _local_items(key_id: bytes, _dht, node) -> list:
    """Runs inside the DHT process: the (subkey, value bytes, expiration) entries this node itself holds under
    `key_id`, from its own storage (no network)."""
    found = node.protocol.storage.get(DHTID.from_bytes(key_id))
    if found is None or not isinstance(found.value, DictionaryDHTValue):
        return []
    return [(subkey, item.value, item.expiration_time) for subkey, item in found.value.items()]


class SwarmDHT:
    """A running hivemind DHT node that stores and reads Swarmtrain's signed, typed records."""

    def __init__(
        self,
        identity: Identity,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
        announce_maddrs: Sequence[str] = (),
        startup_timeout: float = 20.0,
        request_timeout: float = 5.0,
        client_mode: bool = False,
        watched: Sequence[str] = (),
        arrivals: dict[str, Sequence[str]] | None = None,
    ):
        """`client_mode`: a node others cannot dial (NAT): it asks, it is never asked. `watched`, `arrivals`: see
        `touched`."""
        self.identity, self.request_timeout, self.client_mode = identity, request_timeout, client_mode
        # set once this peer holds a credential (peer.net.security): records it stores carry the credential,
        # and records it reads count only from admitted peers (dht.gate)
        self.gate: Gate | None = None
        self.certificate: bytes | None = None  # DER of this peer's credential
        self.security = None  # the peer's peer.net.security.Security once admitted (TLS for its gRPC); opaque here
        self._init_counts()
        validator = self._init_events(watched, arrivals or {})
        self._key_path = identity.write_libp2p_key()
        kwargs = dict(
            initial_peers=list(initial_peers),
            host_maddrs=list(host_maddrs),
            identity_path=self._key_path,
            check_if_identity_free=False,  # hivemind's check reads RSA keys only; we lock the key file instead
            record_validators=[validator],
            start=False,
            await_ready=False,
            wait_timeout=request_timeout,
            bootstrap_timeout=startup_timeout,
            client_mode=client_mode,
        )
        if announce_maddrs:
            kwargs["announce_maddrs"] = list(announce_maddrs)
        self.dht = DHT(**kwargs)
        started = time.monotonic()
        try:
            self.dht.run_in_background(await_ready=True, timeout=startup_timeout)
        except Exception as e:  # hivemind's start fails in many ways: clean up what was made, then say why below
            self._cleanup_key()
            with contextlib.suppress(Exception):
                self.dht.shutdown()
            where = ", ".join(initial_peers) if initial_peers else "its listen addresses"
            took = time.monotonic() - started
            when = f"within {startup_timeout:.0f} s" if took >= startup_timeout * 0.9 else f"(after {took:.1f} s)"
            raise DHTStartError(
                f"could not start the DHT node and reach {where} {when} ({type(e).__name__}: "
                f"{str(e).strip() or 'timed out'}); check the address, that the peer runs, and that the /p2p/ id "
                "is that peer's (a wrong id fails the handshake)"
            ) from None
        if initial_peers and not self._has_neighbours():
            self.shutdown()
            raise DHTStartError(
                f"no peer answered at {', '.join(initial_peers)} within {time.monotonic() - started:.0f} s; "
                "check that the address is right and the peer is running"
            )

    def _init_events(self, watched: Sequence[str], arrivals: dict[str, Sequence[str]]) -> SignedRecordValidator:
        """The events the validator (in the DHT process, forked after this) sets: see `touched`; the validator."""
        # key -> an event its validator sets when a signed record under it arrives here
        self._touched = {key: multiprocessing.Event() for key in watched}
        by_id = {DHTID.generate(source=key).to_bytes(): event for key, event in self._touched.items()}
        # name -> one event for a group of keys, set when a record arrives under one from an owner new to that key (or
        # in another state)
        arrived = {}
        for name, group in arrivals.items():
            self._touched[name] = event = multiprocessing.Event()
            arrived.update((DHTID.generate(source=key).to_bytes(), event) for key in group)
        return SignedRecordValidator(by_id, arrived)

    def _init_counts(self) -> None:
        self._counts_lock = threading.Lock()
        self.operations = {"store": 0, "get": 0}  # DHT operations this peer made (stores and reads), since start
        # the same, by operation and kind of key (keys.kind_of): what a peer's DHT traffic is spent on
        self.operations_by_kind: collections.Counter[tuple[str, str]] = collections.Counter()

    def _has_neighbours(self) -> bool:
        return self.dht.run_coroutine(_count_neighbours) > 0

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def local_stamp(self, key: str) -> tuple:
        """What this node itself stores under `key` (subkeys and expirations), without asking the network: a
        change tells a poller that a full read is worth it. hivemind stores a record on the 5 nodes nearest its
        key (the storer's own among them, a client's too): in a small swarm on every full node, in a larger one
        maybe on others only. TimeoutError after the request timeout if the DHT process does not answer."""
        return tuple(self._subkeys([key])[0])

    def _subkeys(self, keys_: Sequence[str]) -> list:
        key_ids = [DHTID.generate(source=key).to_bytes() for key in keys_]
        return self._in_dht_process(functools.partial(_local_subkeys, key_ids))

    def _held(self, key: str) -> list:
        """The (subkey, value bytes, expiration) entries this node itself holds under `key` (no network)."""
        key_id = DHTID.generate(source=key).to_bytes()
        return self._in_dht_process(functools.partial(_local_items, key_id))

    def _in_dht_process(self, coroutine):
        """Run `coroutine(dht, node)` inside the DHT process; TimeoutError after the request timeout."""
        future = self.dht.run_coroutine(coroutine, return_future=True)
        try:
            return future.result(timeout=self.request_timeout)
        except TimeoutError:
            future.cancel()
            raise

    def touched(self, key: str):
        """The event set when a validly signed record under `key` (one of `watched`) reaches this node: stored here
        by any peer, or returned to one of this node's reads; for the name of a group of `arrivals`, when such a
        record comes under one of its keys from an owner this node has not seen under it before (a peer joined), or
        with another `state` than that owner's last one there (a server leaving).
        Its waiter clears it; None for a key or group not watched."""
        return self._touched.get(key)

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def replicate_p2p(self):
        return self.dht.replicate_p2p()

    # ---- signed records -------------------------------------------------------------------
    def _seal(self, key: str, expiration_time: float, record: Record) -> tuple[str, bytes]:
        record.software = record.software or software_version()  # every record this software stores names it
        subkey = keys.signed_subkey(self.peer_id)
        payload = record.model_dump_json().encode()
        key_id = DHTID.generate(source=key).to_bytes()
        subkey_bytes = msgpack.packb(subkey, use_bin_type=True)
        return subkey, envelope.seal(self.identity, key_id, subkey_bytes, expiration_time, payload, self.certificate)

    def _count(self, operation: str, key: str) -> None:
        with self._counts_lock:
            self.operations[operation] += 1
            self.operations_by_kind[operation, keys.kind_of(key)] += 1

    def levels(self) -> dict[str, tuple[str, str, float]]:
        """The DHT operations this peer made, for its metrics (peer.net.metrics)."""
        with self._counts_lock:
            stores, gets = self.operations["store"], self.operations["get"]
            by_kind = dict(self.operations_by_kind)
        return {
            "dht_stores": ("counter", "DHT stores this peer made", stores),
            "dht_gets": ("counter", "DHT reads this peer made", gets),
            "dht_operations": ("counter", "DHT operations this peer made, by operation and kind of key", by_kind),
        }

    def store(self, key: str, record: Record, ttl: float) -> bool:
        """Store `record` under `key` with this peer's signed subkey, for `ttl` seconds."""
        self._count("store", key)
        expiration = get_dht_time() + ttl
        subkey, value = self._seal(key, expiration, record)
        # back at the first replica that stored it (the others are written in the background): a frozen
        # DHT node (a stopped peer) must not hold every announcement up for its request timeout
        # a client's own storage is never read by others: its store is done once a full node holds the record
        future = self.dht.store(
            key, value, expiration, subkey=subkey, return_future=True, await_all_replicas=False, **self._remote()
        )
        return bool(future.result(timeout=self.request_timeout * 2))

    def get(self, key: str, model: type[R], gated: bool = True) -> dict[str, R]:
        """Every validly signed, well-formed record under `key`, by owner peer id.

        Once the node has a gate, only records of admitted peers count (unless `gated` is False:
        credential requests come from peers not admitted yet).
        """
        self._count("get", key)
        future = self.dht.get(key, latest=True, return_future=True)
        found = future.result(timeout=self.request_timeout * 2)
        if found is None or not isinstance(found.value, dict):
            return {}
        items = ((subkey, item.value, item.expiration_time) for subkey, item in found.value.items())
        return self._open_records(key, items, model, gated)

    def local_get(self, key: str, model: type[R], gated: bool = True) -> dict[str, R]:
        """What `get` returns, from the records this node itself stores under `key` (no network, not counted as
        a DHT operation): the same signatures and gate. A record stored on other nodes only is not seen.
        TimeoutError after the request timeout if the DHT process does not answer."""
        items = []
        for subkey, value_bytes, expiration in self._held(key):
            try:
                items.append((subkey, msgpack.unpackb(value_bytes, raw=False), expiration))
            except Exception:  # bytes another peer stored: whatever msgpack raises, the entry is not a record
                continue
        return self._open_records(key, items, model, gated)

    def _open_records(self, key: str, items, model: type[R], gated: bool) -> dict[str, R]:
        """The validly signed, well-formed records among (subkey, value, expiration) entries under `key`."""
        key_id = DHTID.generate(source=key).to_bytes()
        now = get_dht_time()
        records: dict[str, R] = {}
        for subkey, value, expiration in items:
            owner = keys.owner_of_subkey(subkey)
            if owner is None or expiration < now:
                continue  # unsigned entries under our keys are never used
            subkey_bytes = msgpack.packb(subkey, use_bin_type=True)
            opened = (
                envelope.open_sealed(owner, key_id, subkey_bytes, expiration, value)
                if isinstance(value, bytes)
                else None
            )
            if opened is None:
                logger.warning("ignored a record under %s with a bad signature (claims owner %s)", key, owner)
                continue
            payload, certificate = opened
            checked = self.gate is not None and gated
            roles = self.gate.roles_of(owner, certificate) if checked else None
            if checked and roles is None:
                logger.debug("ignored a record under %s from %s: not an admitted peer", key, owner)
                continue
            try:
                record = records[owner] = model.model_validate_json(payload)
            except ValidationError as e:
                logger.warning("ignored a malformed %s from %s: %s", model.__name__, owner, e)
                continue
            record.owner = owner
            if roles is not None and not self.gate.may_publish(roles, record.writers()):
                del records[owner]  # a trainer's credential announcing a server, say
                logger.debug("ignored a %s from %s: its roles may not publish one", model.__name__, owner)
        return records

    async def astore(self, key: str, record: Record, ttl: float) -> bool:
        return await asyncio.wait_for(asyncio.to_thread(self.store, key, record, ttl), self.request_timeout * 2)

    async def aget(self, key: str, model: type[R], gated: bool = True) -> dict[str, R]:
        return await asyncio.wait_for(asyncio.to_thread(self.get, key, model, gated), self.request_timeout * 2)

    def sealed(self, key: str, record: Record, ttl: float) -> tuple[float, bytes]:
        """`record` sealed as `store` stores it under `key` for `ttl` s, without storing it: (expiration, envelope),
        for a peer that hands its record to another directly (peer.server.replica_push); the reader checks it
        with `opened`."""
        expiration = get_dht_time() + ttl
        return expiration, self._seal(key, expiration, record)[1]

    def opened(self, key: str, owner: str, expiration: float, value: bytes, model: type[R]) -> R | None:
        """The record `owner` sealed for `key` (`sealed`), checked as `get` checks what the DHT returns (signature,
        expiry, credential, the roles that may publish it, its fields); None when it does not count."""
        found = self._open_records(key, [(keys.signed_subkey(owner), value, expiration)], model, gated=True)
        return found.get(owner)

    def _remote(self) -> dict:
        """hivemind store options: a client node (never asked by others) does not count itself as a replica."""
        return {"exclude_self": True} if self.client_mode else {}

    def store_raw(self, key: str, subkey: object, value: bytes, ttl: float) -> bool:
        """Store an arbitrary value without signing it (for tests of what the validators refuse)."""
        self._count("store", key)
        future = self.dht.store(key, value, get_dht_time() + ttl, subkey=subkey, return_future=True, **self._remote())
        return bool(future.result(timeout=self.request_timeout * 2))

    def shutdown(self) -> None:
        if self.security is not None:
            self.security.stop()
        with contextlib.suppress(Exception):
            if self.dht.is_alive():
                self.dht.shutdown()
        self._cleanup_key()

    def _cleanup_key(self) -> None:
        shutil.rmtree(os.path.dirname(self._key_path), ignore_errors=True)
