"""The coordinator: first DHT node of a run; publishes the signed run spec and reports the run's state.

It is not on the data path: servers and trainers talk to each other directly, so training goes
on while the coordinator is down.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

from dht import keys
from dht.address import answering
from dht.identity import Identity
from dht.node import DHTStartError, SwarmDHT
from dht.records import TrainerRecord
from peer.config import ConfigError, PeerConfig, RunSpec
from peer.coordinator import checkpoint
from peer.coordinator.admission_files import admission_notice, beside_key, invites_file, revoked_file
from peer.coordinator.archive import Archive
from peer.coordinator.authority import Authority
from peer.coordinator.checkpointer import Checkpointer
from peer.coordinator.custody import Custody
from peer.coordinator.dashboard import Dashboard, swarm_state
from peer.coordinator.pretrained import open_pretrained
from peer.coordinator.timeline import Timeline
from peer.model.moe import expert_uid
from peer.net.cadence import longest_ttl
from peer.net.metrics import open_metrics, serve_metrics
from peer.net.relay import RelayThread
from peer.net.security import Security
from peer.net.serving import http_host
from peer.process.lifetime import exit_within
from peer.process.status_lines import say
from peer.swarm.books import Books
from peer.swarm.consensus import backed
from peer.swarm.discovery import publish_spec
from peer.swarm.status import gather

logger = logging.getLogger(__name__)


MEMBERS = "members"  # the coordinator's DHT event: a peer joined (dht.node.SwarmDHT.touched)


def dht_maddrs(cfg: PeerConfig) -> tuple[list[str], list[str]]:
    return list(cfg.network.dht_host_maddrs), list(cfg.network.dht_announce_maddrs)


def join_line(maddr: str) -> str:
    return f"peer join {maddr}"


def pick_join_maddr(maddrs: list[str]) -> str:
    """Prefer an address others can dial: non-loopback IPv4 first, loopback last."""
    ranked = sorted(maddrs, key=lambda m: ("/ip4/127." in m or "/ip6/" in m, m))
    return ranked[0]


def swarm_summary(look: dict) -> dict:
    """The run's totals from one look at the DHT (`peer.swarm.status.gather`)."""
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
                # what more than half of its serving replicas say (peer.swarm.consensus); not those joining (one at
                # step 0 would hold a stage's `trained` step at 0, and a server joining it would start from the seed)
                "step": backed(r.epoch for r in serving),
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
    """The checkpoint to go on from, served to joiners (peer.coordinator.archive); CheckpointError naming what is wrong."""
    path = checkpoint.latest(resume)
    if path is None:
        raise checkpoint.CheckpointError(f"--resume {resume}: no complete checkpoint there")
    try:
        archive = Archive(path, spec, cfg, dht)
        archive.start()
    except OSError as e:
        raise checkpoint.CheckpointError(f"--resume {resume}: {e}") from None
    archive.announce()
    entries = archive.manifest["parts"]
    epochs = {int(e["epoch"]) for e in entries.values()}
    if len(epochs) == 1:
        parts = ", ".join(sorted(entries))
    else:  # its parts were pulled one after another, while stages stepped: each goes on from its own step
        parts = ", ".join(f"{name} at step {entries[name]['epoch']}" for name in sorted(entries))
    say(f"Resuming from {path} (step {archive.step}; {parts}), served at {archive.endpoint}.")
    return archive


def peers_file(cfg: PeerConfig, identity: Identity, spec: RunSpec) -> Path:
    return beside_key(cfg.coordinator.peers_file, identity, spec, "peers.json")


def timeline_file(cfg: PeerConfig, identity: Identity, spec: RunSpec) -> Path:
    return beside_key(cfg.coordinator.timeline_file, identity, spec, "timeline.json")


def start_authority(spec: RunSpec, cfg: PeerConfig, identity: Identity, dht: SwarmDHT) -> Authority | None:
    """The run's certificate authority and the coordinator's own credential (None with admission.mode off)."""
    if spec.admission.mode == "off":
        say("Admission is off: no TLS and no credentials (admission.mode = off; a trusted network only).")
        return None
    authority = Authority(spec, cfg, identity, dht, invites_file(identity, spec), revoked_file(identity, spec))
    authority.follow_revocations()
    # its own list: the authority sets the gate's from its file (no read of it from the DHT)
    security = Security(
        spec, cfg, identity, dht, identity.peer_id, ("coordinator",), authority.issue_own, follows_revocations=False
    )
    security.obtain()
    dht.security = security
    authority.follow_revocations()  # the gate now exists: it holds the list
    security.start()
    authority.start()
    for line in admission_notice(spec, identity):
        say(line)
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
    # the authority hears of credential requests and spot-check reports as they reach this node, and the coordinator
    # of a peer that joins (a record under a part's or the trainers' key from an owner new there: MEMBERS)
    watched = {
        "watched": [keys.credential_requests_key(spec.name), keys.reports_key(spec.name), keys.proofs_key(spec.name)],
        "arrivals": {MEMBERS: member_keys(spec)},
    }
    # remembered peers that no longer answer at all are left out at once, not waited for (rejoin_timeout)
    known = answering(remembered_peers(peers_file(cfg, identity, spec)), net.connect_timeout)
    if initial:  # (the CLI kept those that answer)
        dht = SwarmDHT(
            identity,
            [*initial, *known],
            host_maddrs,
            announce_maddrs,
            net.dht_startup_timeout,
            net.dht_request_timeout,
            **watched,
        )
        say(f"Joined the existing DHT through {', '.join(initial)}.")
        return dht, bool(known)
    if known:
        try:
            timeout = cfg.coordinator.rejoin_timeout
            dht = SwarmDHT(identity, known, host_maddrs, announce_maddrs, timeout, net.dht_request_timeout, **watched)
            say(f"Rejoined the swarm of run '{spec.name}' through {len(known)} remembered peer address(es).")
            return dht, True
        except DHTStartError as e:
            logger.warning("no remembered peer answered (%s); starting the run's DHT afresh", e)
    dht = SwarmDHT(
        identity, [], host_maddrs, announce_maddrs, net.dht_startup_timeout, net.dht_request_timeout, **watched
    )
    return dht, False


def open_dashboard(cfg: PeerConfig, timeline: Timeline) -> Dashboard | None:
    """The web dashboard (None with dashboard.port = -1); says where it is. SystemExit if the port is taken."""
    if cfg.dashboard.port < 0:
        return None
    host = cfg.dashboard.host or cfg.network.host
    dashboard = Dashboard(cfg.dashboard, timeline)
    try:
        endpoint = dashboard.start(host, cfg.dashboard.port, http_host(host, cfg.network.announce_host))
    except OSError as e:
        raise ConfigError(f"dashboard.port {cfg.dashboard.port}: cannot listen on it: {e}") from None
    say(f"Dashboard at http://{endpoint}/")
    return dashboard


def report(
    spec: RunSpec,
    cfg: PeerConfig,
    identity: Identity,
    summary: dict,
    checkpointer: Checkpointer,
    timeline: Timeline,
) -> int | None:
    """Every report period: remember the peers, print the summary line; the run's step when a checkpoint is due."""
    try:
        remember_peers(peers_file(cfg, identity, spec), spec, summary["dht_maddrs"])
        timeline.save(timeline_file(cfg, identity, spec), spec.fingerprint())
    except Exception as e:  # the report must not end the coordinator: remembered again next report
        logger.warning("could not remember the peers or the timeline: %s", e)
    stages = ", ".join(
        f"stage {i}: {s['servers']} server(s) at step {s['step']}" for i, s in enumerate(summary["stages"])
    )
    say(f"run '{spec.name}': {stages}; {summary['trainers']} trainer(s), {summary['samples']} samples")
    steps = [s["step"] for s in summary["stages"]]
    return max(steps) if checkpointer.due(max(steps), min(steps)) else None


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
    run = Coordinator(spec, cfg, identity, dht)
    try:
        run.start(resume, info_file, rejoined)
        run.watch(stop)
    finally:
        exit_within(
            cfg.server.leave_timeout, f"the coordinator was still stopping after {cfg.server.leave_timeout:g} s"
        )
        run.close()


def member_keys(spec: RunSpec) -> list[str]:
    """The keys a peer's joining shows under: every stage's and expert's servers, and the trainers."""
    parts = [keys.servers_key(spec.name, s) for s in range(spec.stages.num_stages)]
    parts += [
        keys.expert_key(spec.name, expert_uid(layer, e))
        for layer in spec.moe_layers()
        for e in range(spec.moe.num_experts)
    ]
    return [*parts, keys.trainers_key(spec.name)]


def resting(look: dict) -> tuple | None:
    """What a look at a swarm at rest saw (each server's and expert's step, samples and state), to compare with
    the next look; None while any trainer announces itself (training: the swarm is not at rest)."""
    if look["trainers"]:
        return None
    parts = [*look["stages"], *look["experts"].values()]
    return tuple(sorted((pid, r.epoch, r.samples, r.state) for records in parts for pid, r in records.items()))


def announce(spec: RunSpec, identity: Identity, maddrs: list[str], join: str, info_file: str) -> None:
    """Say where the run is and how to join it; the same as JSON in `info_file`."""
    say(f"Coordinator of run '{spec.name}' is up (peer id {identity.peer_id}).")
    say("It listens on:")
    for m in maddrs:
        say(f"  {m}")
    code = " --invite CODE" if spec.admission.mode == "invite" else ""
    say(f"To join, run on another machine:\n  {join}{code}\n  {join}{code} --role trainer")
    say(
        f"(or through any peer of the run, the coordinator named: peer join PEER_MADDR --coordinator {identity.peer_id})"
    )
    if info_file:
        with open(info_file + ".tmp", "w") as f:
            json.dump({"maddrs": maddrs, "join": join, "peer_id": identity.peer_id, "run": spec.name}, f)
        os.replace(info_file + ".tmp", info_file)


class Coordinator(Custody):
    """What a running coordinator holds: the DHT node, admission, the archive it resumes from, a relay,
    the timeline and dashboard, checkpoints; `watch` looks at the swarm every tick until stopped."""

    def __init__(self, spec: RunSpec, cfg: PeerConfig, identity: Identity, dht: SwarmDHT):
        self.spec, self.cfg, self.identity, self.dht = spec, cfg, identity, dht
        self.archive = self.dashboard = self.timeline = self.authority = self.relay = self.checkpointer = None
        self.resumed = False  # the archive is a checkpoint it resumes from (else pretrained weights, or none)
        self.view: dict = {}  # the last summary of the swarm, for the metrics
        self._marker: tuple | None = None  # what the last look saw of a swarm at rest (`resting`); None: not at rest
        self.about: dict = {}  # what the dashboard shows of the coordinator itself
        self.last_publish = 0.0
        self.trained: dict[int, int] = {}  # stage -> the highest step the coordinator has seen it at
        self.books: Books | None = None  # the run's books (samples completed against each stage's accounts)
        self._books_said = 0.0  # time.time() of the last warning that they disagree
        self._checkpointing: threading.Thread | None = None  # the checkpoint being taken, if any
        # it checkpoints a part whose last server leaves (peer.coordinator.custody), while it keeps checkpoints
        self.takes_handover = bool(cfg.coordinator.checkpoint_dir)

    def start(self, resume: str, info_file: str, rejoined: bool) -> None:
        spec, cfg = self.spec, self.cfg
        self.authority = start_authority(spec, cfg, self.identity, self.dht)
        self.resumed = bool(resume)
        if resume:
            self.archive = open_archive(resume, spec, cfg, self.dht)
        elif spec.model.weights:  # a model directory's pretrained weights, served like a checkpoint at step 0
            self.archive = open_pretrained(spec, cfg, self.dht)
        if cfg.coordinator.relay:
            self.relay = RelayThread(cfg, spec.name, self.dht, cfg.coordinator.relay_port)
            where = self.relay.start()
            say(f"Relaying for peers that cannot be dialled, at {where} (coordinator.relay).")
        if not publish_spec(self.dht, spec, cfg.coordinator.spec_ttl):
            logger.warning("the run spec was not stored on any DHT node yet; will retry")
        self.last_publish = time.monotonic()
        maddrs = self.dht.visible_maddrs()
        join = join_line(pick_join_maddr(maddrs))
        announce(spec, self.identity, maddrs, join, info_file)
        own_relay = self.relay.relay.levels if self.relay is not None else dict
        metrics = open_metrics(cfg, "coordinator", lambda: {**swarm_levels(self.view), **own_relay()}, self.dht)
        serve_metrics(metrics, cfg)
        net = cfg.network
        self.timeline = Timeline(
            cfg.dashboard.history,
            cfg.dashboard.events,
            cfg.dashboard.silent_after,
            record_ttl=net.record_ttl,
            rest_slack=longest_ttl(net) - net.record_ttl,
        )
        # rejoining its swarm: the dashboard goes on from the run's past (only this run's, by fingerprint)
        history = timeline_file(cfg, self.identity, spec)
        restarted = rejoined and self.timeline.load(history, spec.fingerprint()) > 0
        if rejoined and self.load_books():  # its swarm went on meanwhile: so do its books
            say("Went on with the books of this run from before the restart.")
        self.about = {
            "started": time.time(),  # this coordinator's start: a page that sees it change loads anew
            "peer_id": self.identity.peer_id,
            "join": join,
            "maddrs": maddrs,
            "metrics": metrics.endpoint if metrics else "",
        }
        self.dashboard = open_dashboard(cfg, self.timeline)
        self._open_checkpoints()
        again = "restarted (curves and events before this are from its last run)" if restarted else "started"
        self.timeline.add("coordinator", f"coordinator of run '{spec.name}' {again}")

    def _open_checkpoints(self) -> None:
        """Checkpoints number on from this coordinator's own last one, or from the one it resumed."""
        cfg = self.cfg
        self.checkpointer = Checkpointer(self.spec, cfg, self.dht)
        newest = checkpoint.latest(cfg.coordinator.checkpoint_dir) if cfg.coordinator.checkpoint_dir else None
        if newest is not None:
            self.checkpointer.last_step = checkpoint.read_manifest(newest, verify=False)["step"]
        if self.archive is not None and self.resumed:  # it goes on from there, even if the directory has newer
            self.checkpointer.last_step, self.checkpointer.previous = self.archive.step, self.archive.path
            self.timeline.add("coordinator", f"resumed from {self.archive.path} (step {self.archive.step})")
        if cfg.coordinator.checkpoint_dir:
            say(f"Checkpoints go to {cfg.coordinator.checkpoint_dir}.")
        self.about.update(checkpoints=cfg.coordinator.checkpoint_dir, last_checkpoint=None)

    def watch(self, stop: threading.Event) -> None:
        """A first look at once (the dashboard has a state to show), then every tick; a report every period, at
        most. At rest (`resting`) the tick doubles up to coordinator.rest_period; a change makes it fast again."""
        period = self.cfg.coordinator.report_period
        fast = min(period, self.cfg.dashboard.period) if self.dashboard is not None else period
        tick, last_report, previous = fast, time.monotonic(), None
        while True:
            summary = self._look()
            if summary is not None and time.monotonic() - last_report >= period - 1e-3:
                last_report = time.monotonic()
                due = report(self.spec, self.cfg, self.identity, summary, self.checkpointer, self.timeline)
                self.save_books()
                if due is not None:
                    self._start_checkpoint(due)
            marker = self._marker
            if marker is None or marker != previous:
                tick = fast
            else:
                tick = min(2 * tick, max(fast, self.cfg.coordinator.rest_period))
            previous = marker
            if tick <= fast:
                if stop.wait(tick):
                    return
                continue
            woken = self._rest(stop, tick, fast)
            if woken is None:
                return
            if woken:
                tick = fast

    def _rest(self, stop: threading.Event, tick: float, fast: float) -> bool | None:
        """Wait `tick` s at rest, and every `fast` s see whether a peer joined meanwhile (a record from an owner new
        to a part's or the trainers' key reached this node: `MEMBERS`, set in the DHT process, no call there):
        True then (look now), False after the whole tick, None when stopped. A peer that vanished is seen at the
        next look."""
        joined, end = self.dht.touched(MEMBERS), time.monotonic() + tick
        while (left := end - time.monotonic()) > 0:
            if stop.wait(min(fast, left)):
                return None
            if joined is not None and joined.is_set():
                joined.clear()
                return True
        return False

    def _look(self) -> dict | None:
        """Republish the spec when due, announce the archive, read the swarm and show it; its summary."""
        spec, cfg = self.spec, self.cfg
        if time.monotonic() - self.last_publish > cfg.coordinator.spec_republish:
            publish_spec(self.dht, spec, cfg.coordinator.spec_ttl)
            self.last_publish = time.monotonic()
        if self.archive is not None:
            try:
                self.archive.announce()
            except Exception as e:  # the DHT may be busy: announced again next tick
                logger.warning("archive announcement failed: %s", e)
        try:
            look = gather(self.dht, spec, books=False)
            summary = swarm_summary(look)
        except Exception as e:  # the DHT may be busy: looked at again next tick
            logger.warning("look at the swarm failed: %s", e)
            return None
        self.view.clear()
        self.view.update(summary)
        self._marker = resting(look)
        for what, work in (
            ("trained steps", lambda: self._remember_trained(summary)),
            ("handovers", lambda: self._take_handovers(look)),
            ("books", lambda: self._keep_books(look)),
        ):
            try:
                work()
            except Exception:  # a peer's malformed word must never take the coordinator down: the next look goes on
                logger.exception("the coordinator's look at the %s failed", what)
        try:
            self.timeline.observe(look)
            if self.dashboard is not None:
                self.dashboard.publish(swarm_state(spec, look, self.timeline, time.time(), self.about))
        except Exception:  # the dashboard must never take the coordinator down
            logger.exception("the dashboard's update failed")
        return summary

    def close(self) -> None:
        self.retract_handovers()
        self.save_books()
        if self.timeline is not None:
            with contextlib.suppress(Exception):
                self.timeline.save(timeline_file(self.cfg, self.identity, self.spec), self.spec.fingerprint())
        for part in (self.dashboard, self.archive, self.relay, self.authority):
            if part is not None:
                part.stop()
        self.dht.shutdown()
