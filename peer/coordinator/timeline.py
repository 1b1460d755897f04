"""The run's recent past as the coordinator saw it: training curves and a list of events.

The coordinator looks at the DHT every few seconds (`peer.swarm.status.gather`). From each look the
timeline keeps one point of the curves (step, losses, samples/s, the bottleneck's throughput)
and, by comparing it with the look before, the events: servers joining, leaving, moving, going
silent or vanishing; parts stepping (with the size of their averaging round) or failing a round;
trainers joining, leaving and banning servers. The coordinator adds its own (checkpoints).
Both lists are bounded.
"""

from __future__ import annotations

import collections
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dht.records import ServerRecord, TrainerRecord
from peer.swarm.consensus import backed

ACTIVE = ("joining", "serving")


@dataclass
class Event:
    id: int  # increasing: a client that has seen event N asks only for later ones
    time: float  # unix time
    kind: str  # join, leave, move, silent, vanish, step, round_failed, trainer, ban, checkpoint, coordinator
    text: str  # a plain sentence


@dataclass
class Point:
    time: float
    step: int  # highest step of any stage
    samples: int  # samples the trainers completed
    samples_per_second: float  # of all trainers
    train_loss: float | None  # mean of the trainers' recent training losses
    val_loss: float | None  # mean of their last validation losses
    bottleneck: float  # samples/s of the slowest stage (announced throughputs)


def short(peer_id: str) -> str:
    return peer_id[-6:]


def part_name(record: ServerRecord) -> str:
    return f"expert {record.expert}" if record.expert else f"stage {record.stage}"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class Timeline:
    def __init__(
        self,
        max_points: int = 2000,
        max_events: int = 500,
        stale_after: float = 10.0,
        record_ttl: float = 10.0,
        rest_slack: float = 0.0,
    ):
        self.points: collections.deque[Point] = collections.deque(maxlen=max_points)
        self.events: collections.deque[Event] = collections.deque(maxlen=max_events)
        self.stale_after = stale_after  # s without a new record before a server or trainer counts as silent
        # a server at rest refreshes its record seldom and says so (its record's ttl over record_ttl, at most
        # rest_slack: peer.net.cadence); it counts as silent that much later
        self.record_ttl, self.rest_slack = record_ttl, rest_slack
        self._next_id = 1
        self._servers: dict[tuple[str, str], ServerRecord] = {}  # (part, peer id) -> its record in the last look
        self._silent: set[tuple[str, str]] = set()
        # when this coordinator saw each record change (its own clock: peers' clocks may differ)
        self._changed: dict[tuple[str, str], tuple[float, float]] = {}  # key -> (record's updated, seen at)
        self._where: dict[str, str] = {}  # peer id -> the part it last left (to tell a move from a join)
        self._steps: dict[str, int] = {}  # part -> highest step of its active servers
        self._trainers: dict[str, TrainerRecord] = {}
        self._banned: dict[str, set[str]] = {}  # trainer -> endpoints it had banned in the last look
        self._quiet = False  # the next look only takes note (the first after a restart)

    def add(self, kind: str, text: str, when: float | None = None) -> Event | None:
        if self._quiet and kind != "coordinator":  # seen before the restart: not news
            return None
        event = Event(self._next_id, time.time() if when is None else when, kind, text)
        self._next_id += 1
        self.events.append(event)
        return event

    def since(self, event_id: int) -> list[dict]:
        return [asdict(e) for e in self.events if e.id > event_id]

    def silent_after(self, r: ServerRecord) -> float:
        """Seconds without a new announcement of `r`'s server before it counts as silent."""
        return self.stale_after + min(max(0.0, r.ttl - self.record_ttl), self.rest_slack)

    def quiet_for(self, key: tuple[str, str], updated: float, now: float) -> float:
        """Seconds since this coordinator first saw the record's current announcement."""
        seen = self._changed.get(key)
        if seen is None or seen[0] != updated:
            self._changed[key] = seen = (updated, now)
        return now - seen[1]

    # ---- kept across a restart of the coordinator -------------------------------------------
    def save(self, path: Path, run: str) -> None:
        """Write the curves and events (atomically), so a restarted coordinator shows the run's past.

        `run` names the run (its spec's fingerprint): only a coordinator of the same run loads them.
        """
        data = {"run": run, "points": [asdict(p) for p in self.points], "events": [asdict(e) for e in self.events]}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

    def load(self, path: Path, run: str) -> int:
        """Take the curves and events a coordinator of `run` saved; how many points (0: none usable).

        The first look after a load tells no events: what it sees was there before the restart.
        """
        try:
            data = json.loads(path.read_text())
            if data.get("run") != run:
                return 0
            points = [Point(**p) for p in data["points"]]
            events = [Event(**e) for e in data["events"]]
            if not all(isinstance(p.time, int | float) and isinstance(p.step, int) for p in points):
                raise ValueError("a point without a number for its time or step")
            if not all(isinstance(e.id, int) and isinstance(e.text, str) for e in events):
                raise ValueError("an event without an id or a text")
        except (OSError, ValueError, TypeError, KeyError):
            return 0
        self.points.extend(points)
        self.events.extend(events)
        self._next_id = max((e.id for e in self.events), default=0) + 1
        self._quiet = bool(points)
        return len(points)

    # ---- one look ---------------------------------------------------------------------------
    def observe(self, look: dict, now: float | None = None) -> Point:
        """Take one look (`peer.swarm.status.gather`): add a point to the curves and the events since the last look."""
        now = time.time() if now is None else now
        servers: dict[tuple[str, str], ServerRecord] = {}
        for records in look["stages"]:
            servers.update({(part_name(r), pid): r for pid, r in records.items() if not r.expert})
        for records in look.get("experts", {}).values():
            servers.update({(part_name(r), pid): r for pid, r in records.items()})
        self._server_events(servers, now)
        self._step_events(servers, now)
        self._trainer_events(look["trainers"], now)
        self._quiet = False
        keys = set(servers) | {("trainer", pid) for pid in look["trainers"]}
        self._changed = {k: v for k, v in self._changed.items() if k in keys}
        point = self._point(look, now)
        self.points.append(point)
        return point

    def _server_events(self, servers: dict[tuple[str, str], ServerRecord], now: float) -> None:
        def where(key: tuple[str, str], r: ServerRecord) -> str:
            return f"{r.endpoint} ({short(key[1])})"

        # departures first, so that a server seen leaving one part and joining another moved
        for key, r in self._servers.items():
            now_r = servers.get(key)
            if r.state not in ACTIVE:
                continue
            if now_r is None:
                self._where[key[1]] = key[0]
                self.add("vanish", f"{where(key, r)} of {key[0]} vanished: its record expired", now)
            elif now_r.state not in ACTIVE:
                self._where[key[1]] = key[0]
                self.add("leave", f"{where(key, now_r)} left {key[0]} ({now_r.state})", now)
        for key, r in servers.items():
            part, pid = key
            before = self._servers.get(key)
            if (before is None or before.state not in ACTIVE) and r.state in ACTIVE:
                came_from = self._where.pop(pid, None)
                tp = f", tensor-parallel over {r.tp}" if r.tp > 1 else ""
                if came_from is not None and came_from != part:
                    self.add("move", f"{where(key, r)} moved from {came_from} to {part}{tp}", now)
                else:
                    self.add("join", f"{where(key, r)} joined {part}{tp}", now)
            quiet = self.quiet_for(key, r.updated, now)
            if r.state in ACTIVE and quiet > self.silent_after(r):
                if key not in self._silent:
                    self._silent.add(key)
                    self.add("silent", f"{where(key, r)} of {part} has not announced for {quiet:.0f} s", now)
            else:
                self._silent.discard(key)
            if before is not None and r.rounds_failed > before.rounds_failed:
                self.add("round_failed", f"an averaging round of {part} failed on {where(key, r)}", now)
        self._silent &= set(servers)
        self._servers = servers
        if len(self._where) > 4 * len(servers) + 64:  # bounded: forget the oldest departures
            for pid in list(self._where)[: len(self._where) // 2]:
                del self._where[pid]

    def _step_events(self, servers: dict[tuple[str, str], ServerRecord], now: float) -> None:
        by_part: dict[str, list[ServerRecord]] = collections.defaultdict(list)
        for (part, _), r in servers.items():
            if r.state in ACTIVE:
                by_part[part].append(r)
        stepped_experts = []
        for part, records in by_part.items():
            step = max(r.epoch for r in records)
            before = self._steps.get(part)
            self._steps[part] = step
            if before is None or step <= before:
                continue
            if part.startswith("expert"):
                stepped_experts.append(part.removeprefix("expert "))
                continue
            at = [r for r in records if r.epoch == step and r.last_round > 0]
            jump = f" (+{step - before})" if step - before > 1 else ""
            if at:
                members = max(r.last_round for r in at)
                seconds = max(r.last_round_seconds for r in at)
                how = f"averaged by {members} replicas" if members > 1 else "stepped alone"
                self.add("step", f"{part} reached step {step}{jump}: {how} in {seconds:.2f} s", now)
            else:
                self.add("step", f"{part} reached step {step}{jump}", now)
        if stepped_experts:
            self.add("step", f"experts {', '.join(sorted(stepped_experts))} stepped", now)

    def _trainer_events(self, trainers: dict[str, TrainerRecord], now: float) -> None:
        for pid, t in trainers.items():
            if pid not in self._trainers:
                self.add("trainer", f"trainer {short(pid)} joined", now)
            banned = set(t.banned)
            for endpoint in sorted(banned - self._banned.get(pid, set())):
                self.add("ban", f"trainer {short(pid)} banned {endpoint} after a failed call", now)
            self._banned[pid] = banned
        for pid in set(self._trainers) - set(trainers):
            self.add("trainer", f"trainer {short(pid)} left", now)
            self._banned.pop(pid, None)
        self._trainers = dict(trainers)

    def _point(self, look: dict, now: float) -> Point:
        trainers = [
            t
            for pid, t in look["trainers"].items()
            if self.quiet_for(("trainer", pid), t.updated, now) <= self.stale_after
        ]
        totals = [0.0] * len(look["stages"])
        step = 0
        for stage, records in enumerate(look["stages"]):
            serving = [r for r in records.values() if r.state == "serving" and not r.expert]
            totals[stage] = sum(r.throughput for r in serving)
            step = max(step, backed(r.epoch for r in serving))  # what more than half say (peer.swarm.consensus)
        return Point(
            time=now,
            step=step,
            samples=sum(t.samples for t in look["trainers"].values()),
            samples_per_second=sum(t.samples_per_second for t in trainers),
            train_loss=_mean([t.train_loss for t in trainers if t.train_loss is not None]),
            val_loss=_mean([t.val_loss for t in look["trainers"].values() if t.val_loss is not None]),
            bottleneck=min(totals, default=0.0),
        )
