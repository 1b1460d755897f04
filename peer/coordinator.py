"""The coordinator: first DHT node of a run; publishes the signed run spec and reports the run's state.

It is not on the data path: servers and trainers talk to each other directly, so training goes
on while the coordinator is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

from dht.address import answering
from dht.identity import Identity
from dht.node import DHTStartError, SwarmDHT
from dht.records import TrainerRecord
from peer import checkpoint
from peer.admission_files import beside_key, invites_file, revoked_file
from peer.authority import Authority
from peer.checkpointer import Checkpointer
from peer.config import ConfigError, PeerConfig, RunSpec
from peer.dashboard import Dashboard, swarm_state
from peer.lifetime import exit_within
from peer.metrics import open_metrics, serve_metrics
from peer.security import Security
from peer.status import gather
from peer.swarm import publish_spec
from peer.timeline import Timeline

logger = logging.getLogger(__name__)


def dht_maddrs(cfg: PeerConfig) -> tuple[list[str], list[str]]:
    return list(cfg.network.dht_host_maddrs), list(cfg.network.dht_announce_maddrs)


def join_line(maddr: str) -> str:
    return f"peer join {maddr}"


def pick_join_maddr(maddrs: list[str]) -> str:
    """Prefer an address others can dial: non-loopback IPv4 first, loopback last."""
    ranked = sorted(maddrs, key=lambda m: ("/ip4/127." in m or "/ip6/" in m, m))
    return ranked[0]


def swarm_summary(look: dict) -> dict:
    """The run's totals from one look at the DHT (`peer.status.gather`)."""
    stages, maddrs = [], []
    requests = errors = 0
    for stage, servers in enumerate(look["stages"]):
        serving = [r for r in servers.values() if r.state == "serving" and r.stage == stage]
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
    trainers: dict[str, TrainerRecord] = look["trainers"]
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
    """The checkpoint to go on from, served to joiners (peer.archive); CheckpointError naming what is wrong."""
    from peer.archive import Archive

    path = checkpoint.latest(resume)
    if path is None:
        raise checkpoint.CheckpointError(f"--resume {resume}: no complete checkpoint there")
    try:
        archive = Archive(path, spec, cfg, dht)
        archive.start()
    except OSError as e:
        raise checkpoint.CheckpointError(f"--resume {resume}: {e}") from None
    archive.announce()
    parts = ", ".join(sorted(archive.manifest["parts"]))
    print(f"Resuming from {path} (step {archive.step}; {parts}), served at {archive.endpoint}.", flush=True)
    return archive


def peers_file(cfg: PeerConfig, identity: Identity, spec: RunSpec) -> Path:
    return beside_key(cfg.coordinator.peers_file, identity, spec, "peers.json")


def timeline_file(cfg: PeerConfig, identity: Identity, spec: RunSpec) -> Path:
    return beside_key(cfg.coordinator.timeline_file, identity, spec, "timeline.json")


def start_authority(spec: RunSpec, cfg: PeerConfig, identity: Identity, dht: SwarmDHT) -> Authority | None:
    """The run's certificate authority and the coordinator's own credential (None with admission.mode off)."""
    if spec.admission.mode == "off":
        print("Admission is off: no TLS and no credentials (admission.mode = off; a trusted network only).")
        return None
    authority = Authority(spec, cfg, identity, dht, invites_file(identity, spec), revoked_file(identity, spec))
    authority.follow_revocations()
    security = Security(spec, cfg, identity, dht, identity.peer_id, ("coordinator",), issue=authority.issue_own)
    security.obtain()
    dht.security = security
    security.start()
    authority.start()
    how = {
        "open": "anyone who asks",
        "allowlist": f"the {len(spec.admission.allowlist)} peer(s) of admission.allowlist",
        "invite": "peers with an invite code (peer coordinator invite)",
    }[spec.admission.mode]
    print(f"Admission: {spec.admission.mode} ({how}); every peer needs a credential from this coordinator.")
    return authority


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


def start_dht(
    spec: RunSpec, cfg: PeerConfig, identity: Identity, initial: list[str] | None = None
) -> tuple[SwarmDHT, bool]:
    """The coordinator's DHT node, and whether it rejoined its run's swarm.

    Through `initial` (an existing DHT, e.g. a hivemind-dht bootstrap node) and the peers it
    remembers from an earlier start; with neither, it is the first node of a new DHT.
    """
    host_maddrs, announce_maddrs = dht_maddrs(cfg)
    net = cfg.network
    # remembered peers that no longer answer at all are left out at once, not waited for (rejoin_timeout)
    known = answering(remembered_peers(peers_file(cfg, identity, spec)), net.connect_timeout)
    if initial:  # (the CLI kept those that answer)
        dht = SwarmDHT(
            identity, [*initial, *known], host_maddrs, announce_maddrs, net.dht_startup_timeout, net.dht_request_timeout
        )
        print(f"Joined the existing DHT through {', '.join(initial)}.", flush=True)
        return dht, bool(known)
    if known:
        try:
            timeout = cfg.coordinator.rejoin_timeout
            dht = SwarmDHT(identity, known, host_maddrs, announce_maddrs, timeout, net.dht_request_timeout)
            print(
                f"Rejoined the swarm of run '{spec.name}' through {len(known)} remembered peer address(es).", flush=True
            )
            return dht, True
        except DHTStartError as e:
            logger.warning("no remembered peer answered (%s); starting the run's DHT afresh", e)
    return SwarmDHT(identity, [], host_maddrs, announce_maddrs, net.dht_startup_timeout, net.dht_request_timeout), False


def open_dashboard(cfg: PeerConfig, timeline: Timeline) -> Dashboard | None:
    """The web dashboard (None with dashboard.port = -1); says where it is. SystemExit if the port is taken."""
    if cfg.dashboard.port < 0:
        return None
    from peer.server import announce_host

    host = cfg.dashboard.host or cfg.network.host
    dashboard = Dashboard(cfg.dashboard, timeline)
    try:
        endpoint = dashboard.start(host, cfg.dashboard.port, announce_host(host, cfg.network.announce_host))
    except OSError as e:
        raise ConfigError(f"dashboard.port {cfg.dashboard.port}: cannot listen on it: {e}") from None
    print(f"Dashboard at http://{endpoint}/", flush=True)
    return dashboard


def report(
    spec: RunSpec,
    cfg: PeerConfig,
    identity: Identity,
    summary: dict,
    checkpointer: Checkpointer,
    timeline: Timeline,
    about: dict,
) -> None:
    """Every report period: remember the peers, print the summary line, take a checkpoint when due."""
    try:
        remember_peers(peers_file(cfg, identity, spec), spec, summary["dht_maddrs"])
        timeline.save(timeline_file(cfg, identity, spec), spec.fingerprint())
    except Exception as e:
        logger.debug("could not remember the peers or the timeline: %s", e)
    stages = ", ".join(
        f"stage {i}: {s['servers']} server(s) at step {s['step']}" for i, s in enumerate(summary["stages"])
    )
    print(f"run '{spec.name}': {stages}; {summary['trainers']} trainer(s), {summary['samples']} samples", flush=True)
    step = max(s["step"] for s in summary["stages"])
    if not checkpointer.due(step):
        return
    started = time.perf_counter()
    try:
        path = asyncio.run(checkpointer.take(step))
    except Exception as e:
        logger.warning("checkpoint at step %d failed: %s", step, e)
        timeline.add("checkpoint", f"checkpoint at step {step} failed: {e}")
        return
    if path is not None:
        seconds = time.perf_counter() - started
        print(
            f"Wrote checkpoint {path} (step {step}, {len(checkpointer.parts())} parts) in {seconds:.1f} s.", flush=True
        )
        timeline.add("checkpoint", f"wrote checkpoint {path} (step {step}) in {seconds:.1f} s")
        about["last_checkpoint"] = {"path": str(path), "step": step, "time": time.time()}


def run_coordinator(
    spec: RunSpec,
    cfg: PeerConfig,
    identity: Identity,
    info_file: str = "",
    resume: str = "",
    initial: list[str] | None = None,
) -> None:
    dht, rejoined = start_dht(spec, cfg, identity, initial)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    archive = dashboard = timeline = authority = relay = None
    try:
        authority = start_authority(spec, cfg, identity, dht)
        archive = open_archive(resume, spec, cfg, dht) if resume else None
        if cfg.coordinator.relay:
            from peer.relay import RelayThread

            relay = RelayThread(cfg, spec.name, dht, cfg.coordinator.relay_port)
            where = relay.start()
            print(f"Relaying for peers that cannot be dialled, at {where} (coordinator.relay).", flush=True)
        if not publish_spec(dht, spec, cfg.coordinator.spec_ttl):
            logger.warning("the run spec was not stored on any DHT node yet; will retry")
        maddrs = dht.visible_maddrs()
        join = join_line(pick_join_maddr(maddrs))
        print(f"Coordinator of run '{spec.name}' is up (peer id {identity.peer_id}).", flush=True)
        print("It listens on:", flush=True)
        for m in maddrs:
            print(f"  {m}", flush=True)
        print(f"To join, run on another machine:\n  {join}\n  {join} --role trainer", flush=True)
        print(
            f"(or through any peer of the run, the coordinator named: peer join PEER_MADDR --coordinator {identity.peer_id})",
            flush=True,
        )
        if info_file:
            with open(info_file + ".tmp", "w") as f:
                json.dump({"maddrs": maddrs, "join": join, "peer_id": identity.peer_id, "run": spec.name}, f)
            os.replace(info_file + ".tmp", info_file)
        last_publish = time.monotonic()
        view: dict = {}
        own_relay = relay.relay.levels if relay is not None else dict
        metrics = open_metrics(cfg, "coordinator", lambda: {**swarm_levels(view), **own_relay()})
        serve_metrics(metrics, cfg)
        timeline = Timeline(cfg.dashboard.history, cfg.dashboard.events, cfg.dashboard.silent_after)
        # rejoining its swarm: the dashboard goes on from the run's past (only this run's, by fingerprint)
        restarted = rejoined and timeline.load(timeline_file(cfg, identity, spec), spec.fingerprint()) > 0
        about = {
            "started": time.time(),  # this coordinator's start: a page that sees it change loads anew
            "peer_id": identity.peer_id,
            "join": join,
            "maddrs": maddrs,
            "metrics": metrics.endpoint if metrics else "",
        }
        dashboard = open_dashboard(cfg, timeline)
        checkpointer = Checkpointer(spec, cfg, dht)
        newest = checkpoint.latest(cfg.coordinator.checkpoint_dir) if cfg.coordinator.checkpoint_dir else None
        if newest is not None:  # a restarted coordinator numbers on from its own checkpoints
            checkpointer.last_step = checkpoint.read_manifest(newest, verify=False)["step"]
        if archive is not None:
            checkpointer.last_step = max(checkpointer.last_step, archive.step)
            timeline.add("coordinator", f"resumed from {archive.path} (step {archive.step})")
        if cfg.coordinator.checkpoint_dir:
            print(f"Checkpoints go to {cfg.coordinator.checkpoint_dir}.", flush=True)
        about.update(checkpoints=cfg.coordinator.checkpoint_dir, last_checkpoint=None)
        again = "restarted (curves and events before this are from its last run)" if restarted else "started"
        timeline.add("coordinator", f"coordinator of run '{spec.name}' {again}")
        report_period = cfg.coordinator.report_period
        tick = min(report_period, cfg.dashboard.period) if dashboard is not None else report_period
        last_report = time.monotonic()
        while True:  # a first look at once (the dashboard has a state to show), then every tick
            if time.monotonic() - last_publish > cfg.coordinator.spec_republish:
                publish_spec(dht, spec, cfg.coordinator.spec_ttl)
                last_publish = time.monotonic()
            if archive is not None:
                try:
                    archive.announce()
                except Exception as e:
                    logger.debug("archive announcement failed: %s", e)
            try:
                look = gather(dht, spec)
                summary = swarm_summary(look)
                view.clear()
                view.update(summary)
            except Exception as e:
                logger.debug("look at the swarm failed: %s", e)
                look = None
            if look is not None:
                try:
                    timeline.observe(look)
                    if dashboard is not None:
                        dashboard.publish(swarm_state(spec, look, timeline, time.time(), about))
                except Exception:  # the dashboard must never take the coordinator down
                    logger.exception("the dashboard's update failed")
                if time.monotonic() - last_report >= report_period - 1e-3:
                    last_report = time.monotonic()
                    report(spec, cfg, identity, summary, checkpointer, timeline, about)
            if stop.wait(tick):
                break
    finally:
        exit_within(
            cfg.server.leave_timeout, f"the coordinator was still stopping after {cfg.server.leave_timeout:g} s"
        )
        if timeline is not None:
            with contextlib.suppress(Exception):
                timeline.save(timeline_file(cfg, identity, spec), spec.fingerprint())
        if dashboard is not None:
            dashboard.stop()
        if archive is not None:
            archive.stop()
        if relay is not None:
            relay.stop()
        if authority is not None:
            authority.stop()
        dht.shutdown()
