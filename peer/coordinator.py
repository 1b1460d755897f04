"""The coordinator: first DHT node of a run; publishes the signed run spec and reports the run's state.

It is not on the data path: servers and trainers talk to each other directly, so training goes
on while the coordinator is down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

from dht import keys
from dht.identity import Identity
from dht.node import DHTStartError, SwarmDHT
from dht.records import ServerRecord, TrainerRecord
from peer import checkpoint
from peer.checkpointer import Checkpointer
from peer.config import PeerConfig, RunSpec
from peer.metrics import open_metrics, serve_metrics
from peer.swarm import publish_spec

logger = logging.getLogger(__name__)
SPEC_TTL = 120.0  # s the published spec lives unless republished
SPEC_REPUBLISH = 30.0  # s between republications


def dht_maddrs(cfg: PeerConfig) -> tuple[list[str], list[str]]:
    return list(cfg.network.dht_host_maddrs), list(cfg.network.dht_announce_maddrs)


def join_line(maddr: str) -> str:
    return f"peer join {maddr}"


def pick_join_maddr(maddrs: list[str]) -> str:
    """Prefer an address others can dial: non-loopback IPv4 first, loopback last."""
    ranked = sorted(maddrs, key=lambda m: ("/ip4/127." in m or "/ip6/" in m, m))
    return ranked[0]


def swarm_summary(dht: SwarmDHT, spec: RunSpec) -> dict:
    """The run as the DHT shows it, from one read of each stage's records and of the trainers'."""
    stages, maddrs = [], []
    requests = errors = 0
    for stage in range(spec.stages.num_stages):
        servers = dht.get(keys.servers_key(spec.name, stage), ServerRecord)
        serving = [r for r in servers.values() if r.state == "serving"]
        for r in servers.values():
            requests, errors = requests + r.requests, errors + r.errors
        for r in serving:
            maddrs += [m for m in r.dht if "/p2p/" in m and m not in maddrs]
        stages.append(
            {
                "servers": len(serving),
                "step": max((r.epoch for r in serving), default=0),
                "throughput": sum(r.throughput for r in serving),
            }
        )
    trainers = dht.get(keys.trainers_key(spec.name), TrainerRecord)
    return {
        "stages": stages,
        "trainers": len(trainers),
        "samples": sum(t.samples for t in trainers.values()),
        "samples_per_second": sum(t.samples_per_second for t in trainers.values()),
        "failed_calls": sum(t.failed_calls for t in trainers.values()),
        "requests": requests,
        "errors": errors,
        "dht_maddrs": maddrs,  # the serving servers' DHT addresses (a restart rejoins through them)
    }


def swarm_levels(summary: dict) -> dict:
    """The coordinator's metrics: the swarm's view, from its last look at the DHT."""
    if not summary:
        return {}
    stages = summary["stages"]
    return {
        "servers": ("gauge", "Serving stage servers in the swarm", sum(s["servers"] for s in stages)),
        "trainers": ("gauge", "Trainers announcing in the swarm", summary["trainers"]),
        "step": ("gauge", "Highest training step of any stage", max(s["step"] for s in stages)),
        "bottleneck_throughput": ("gauge", "Samples/s of the slowest stage", min(s["throughput"] for s in stages)),
        "total_samples": ("counter", "Samples the trainers completed", summary["samples"]),
        "total_samples_per_second": ("gauge", "Samples/s of all trainers", summary["samples_per_second"]),
        "total_failed_calls": ("counter", "Calls the trainers rerouted", summary["failed_calls"]),
        "total_requests": ("counter", "Requests the stage servers served", summary["requests"]),
        "total_errors": ("counter", "Requests the stage servers answered with an error", summary["errors"]),
    }


def open_archive(resume: str, spec: RunSpec, cfg: PeerConfig, dht: SwarmDHT):
    """The checkpoint to go on from, served to joiners (peer.archive); SystemExit naming what is wrong."""
    from peer.archive import Archive

    try:
        path = checkpoint.latest(resume)
        if path is None:
            raise checkpoint.CheckpointError("no complete checkpoint there")
        archive = Archive(path, spec, cfg, dht)
        archive.start()
    except (checkpoint.CheckpointError, OSError) as e:
        raise SystemExit(f"peer coordinator: --resume {resume}: {e}") from None
    archive.announce()
    parts = ", ".join(sorted(archive.manifest["parts"]))
    print(f"Resuming from {path} (step {archive.step}; {parts}), served at {archive.endpoint}.", flush=True)
    return archive


def peers_file(cfg: PeerConfig, identity: Identity, spec: RunSpec) -> Path:
    if cfg.coordinator.peers_file:
        return Path(cfg.coordinator.peers_file)
    return Path(identity.path or ".").resolve().parent / f"{spec.name}.peers.json"


def remembered_peers(path: Path) -> list[str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [m for m in data.get("maddrs", []) if isinstance(m, str)] if isinstance(data, dict) else []


def remember_peers(path: Path, spec: RunSpec, maddrs: list[str], limit: int = 32) -> None:
    """Write the DHT addresses of the run's servers (atomically), to rejoin through them after a restart."""
    if maddrs:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"run": spec.name, "maddrs": maddrs[:limit], "updated": time.time()}))
        os.replace(tmp, path)


def start_dht(spec: RunSpec, cfg: PeerConfig, identity: Identity) -> SwarmDHT:
    """The coordinator's DHT node: rejoining the run's swarm through remembered peers, else the first node."""
    host_maddrs, announce_maddrs = dht_maddrs(cfg)
    net = cfg.network
    known = remembered_peers(peers_file(cfg, identity, spec))
    if known:
        try:
            timeout = cfg.coordinator.rejoin_timeout
            dht = SwarmDHT(identity, known, host_maddrs, announce_maddrs, timeout, net.dht_request_timeout)
            print(
                f"Rejoined the swarm of run '{spec.name}' through {len(known)} remembered peer address(es).", flush=True
            )
            return dht
        except DHTStartError as e:
            logger.warning("no remembered peer answered (%s); starting the run's DHT afresh", e)
    return SwarmDHT(identity, [], host_maddrs, announce_maddrs, net.dht_startup_timeout, net.dht_request_timeout)


def run_coordinator(spec: RunSpec, cfg: PeerConfig, identity: Identity, info_file: str = "", resume: str = "") -> None:
    dht = start_dht(spec, cfg, identity)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    archive = None
    try:
        archive = open_archive(resume, spec, cfg, dht) if resume else None
        if not publish_spec(dht, spec, SPEC_TTL):
            logger.warning("the run spec was not stored on any DHT node yet; will retry")
        maddrs = dht.visible_maddrs()
        join = join_line(pick_join_maddr(maddrs))
        print(f"Coordinator of run '{spec.name}' is up (peer id {identity.peer_id}).", flush=True)
        print("It listens on:", flush=True)
        for m in maddrs:
            print(f"  {m}", flush=True)
        print(f"To join, run on another machine:\n  {join}\n  {join} --role trainer", flush=True)
        if info_file:
            with open(info_file + ".tmp", "w") as f:
                json.dump({"maddrs": maddrs, "join": join, "peer_id": identity.peer_id, "run": spec.name}, f)
            os.replace(info_file + ".tmp", info_file)
        last_publish = time.monotonic()
        view: dict = {}
        metrics = open_metrics(cfg, "coordinator", lambda: swarm_levels(view))
        serve_metrics(metrics, cfg)
        checkpointer = Checkpointer(spec, cfg, dht)
        newest = checkpoint.latest(cfg.coordinator.checkpoint_dir) if cfg.coordinator.checkpoint_dir else None
        if newest is not None:  # a restarted coordinator numbers on from its own checkpoints
            checkpointer.last_step = checkpoint.read_manifest(newest, verify=False)["step"]
        if archive is not None:
            checkpointer.last_step = max(checkpointer.last_step, archive.step)
        if cfg.coordinator.checkpoint_dir:
            print(f"Checkpoints go to {cfg.coordinator.checkpoint_dir}.", flush=True)
        while not stop.wait(cfg.coordinator.report_period):
            if time.monotonic() - last_publish > SPEC_REPUBLISH:
                publish_spec(dht, spec, SPEC_TTL)
                last_publish = time.monotonic()
            if archive is not None:
                try:
                    archive.announce()
                except Exception as e:
                    logger.debug("archive announcement failed: %s", e)
            try:
                summary = swarm_summary(dht, spec)
            except Exception as e:
                logger.debug("summary failed: %s", e)
                continue
            view.clear()
            view.update(summary)
            try:
                remember_peers(peers_file(cfg, identity, spec), spec, summary["dht_maddrs"])
            except Exception as e:
                logger.debug("could not remember the peers: %s", e)
            stages = ", ".join(
                f"stage {i}: {s['servers']} server(s) at step {s['step']}" for i, s in enumerate(summary["stages"])
            )
            print(
                f"run '{spec.name}': {stages}; {summary['trainers']} trainer(s), {summary['samples']} samples",
                flush=True,
            )
            step = max(s["step"] for s in summary["stages"])
            if checkpointer.due(step):
                started = time.perf_counter()
                try:
                    path = asyncio.run(checkpointer.take(step))
                except Exception as e:
                    logger.warning("checkpoint at step %d failed: %s", step, e)
                    continue
                if path is not None:
                    print(
                        f"Wrote checkpoint {path} (step {step}, {len(checkpointer.parts())} parts) "
                        f"in {time.perf_counter() - started:.1f} s.",
                        flush=True,
                    )
    finally:
        if archive is not None:
            archive.stop()
        dht.shutdown()
