"""`peer join`: read and verify the run spec, then serve a stage or train."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time

import torch

from dht.address import coordinator_peer_id
from dht.identity import Identity
from dht.node import SwarmDHT
from peer.config import PeerConfig, RunSpec
from peer.net.security import Security
from peer.process.lifetime import exit_within
from peer.swarm.discovery import fetch_spec

MOVE_TIMEOUT_FACTOR = 3  # a server moving to another stage gets this many leave timeouts before it exits regardless


def connect(
    maddr: str, cfg: PeerConfig, identity: Identity, role: str, coordinator: str | None = None
) -> tuple[SwarmDHT, RunSpec]:
    """Join the DHT through `maddr` (any peer of the run), read the spec `coordinator` signed, get a credential.

    Without `coordinator`, `maddr` is the coordinator's own address and names it. The credential
    (peer.net.security) comes through the DHT, so no gRPC object exists yet when this returns:
    anything else that forks can still be created.
    """
    coordinator = coordinator_peer_id(maddr, coordinator)
    net = cfg.network  # (the CLI checked that something answers at maddr: dht.address.check_reachable)
    dht = SwarmDHT(
        identity,
        [maddr],
        net.dht_host_maddrs,
        net.dht_announce_maddrs,
        net.dht_startup_timeout,
        net.dht_request_timeout,
        # a DHT client asks the DHT and is never asked: a peer nobody can dial, and a trainer (it serves nothing,
        # so it neither stores nor checks anybody's records; the servers and the coordinator hold the DHT)
        client_mode=cfg.relay.reachability == "private" or role == "trainer",
    )
    try:
        spec = fetch_spec(dht, coordinator, timeout=net.spec_timeout)
        if spec.admission.mode != "off":
            security = Security(spec, cfg, identity, dht, coordinator, (role,))
            security.obtain()
            dht.security = security  # its renewal thread starts later (follow_admission): after hivemind forks
            left = security.credential.not_after - time.time()
            valid = f"{left / 60:.0f} min" if left >= 120 else f"{left:.0f} s"
            print(f"Admitted to run '{spec.name}' as {role} (credential valid {valid}, renewed).", flush=True)
    except BaseException:  # cleans up the DHT node, then re-raises whatever it was
        dht.shutdown()
        raise
    return dht, spec


def follow_admission(dht: SwarmDHT, on_revoked) -> None:
    """Renew the credential and follow revocations from now on; `on_revoked` (on this event loop) if revoked."""
    if dht.security is None:
        return
    loop = asyncio.get_running_loop()

    def revoked():
        print("This peer's credential was revoked by the run's coordinator; leaving the swarm.", flush=True)
        loop.call_soon_threadsafe(on_revoked)

    dht.security.on_revoked = revoked
    dht.security.start()


async def until_signalled(
    start, stop, done: asyncio.Event, leave_timeout: float, moving=lambda: False
) -> threading.Timer:
    """Run until SIGINT/SIGTERM/SIGHUP (or `done` is set), then stop.

    From the moment it is told to leave, the process has `leave_timeout` seconds to end, whatever
    is still running (a server that `moving()` to another stage: three times that, to hand over
    and start anew); the deadline's timer is returned, for a process that execs itself after.
    """
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, done.set)
    try:
        await start()
        await done.wait()
    finally:
        bound = leave_timeout * (MOVE_TIMEOUT_FACTOR if moving() else 1)
        deadline = exit_within(bound, f"still leaving the swarm after {bound:g} s")
        await stop()
    return deadline


def rejoin_argv(argv: list[str], stage: int) -> list[str]:
    """The command line of this peer, serving `stage` and still free to move."""
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--stage":
            skip = True
        elif not arg.startswith("--stage="):
            args.append(arg)
    return [sys.executable, "-m", "peer.cli.main", *args, "--stage", str(stage), "--set", "server.rebalance=always"]


def set_threads(threads: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)
