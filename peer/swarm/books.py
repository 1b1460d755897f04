"""The run's books, kept by the coordinator and shown by `peer status`: for each stage, the samples the
trainers completed against what the stage accounts for them. Every completed sample is in one finished step of each stage, or
waits in a live server's accumulator (or its round), or waits to be replayed by its trainer (its
server went away before stepping it). Samples of micro-batches under way may already sit in some
stages; so the books balance when

    stepped + pending + replaying - in flight  <=  completed  <=  stepped + pending + replaying

Less than completed: samples were lost; more: some were counted twice. Records lag a little behind
the work, so the coordinator warns only of books that stay off for `coordinator.books_grace`.
Trainers are remembered after they leave (by peer id and start), so their samples stay counted; a
run resumed from a checkpoint counts from the samples its stages had stepped at that checkpoint.

What a trainer completed is its own word, and so is what it holds for replay: with admission on, the books
take it only as far as every stage's servers counted that trainer's backwards (the rows that reached them:
`ServerRecord.counted`, remembered after the servers go), plus what it holds for replay at that stage. A key
that claims 10,000 samples and sent nothing completed none."""

from __future__ import annotations

import time
from dataclasses import dataclass

from dht.records import BooksRecord, ServerRecord, TrainerRecord
from peer.model.fingerprint import TOLERANCE, first_difference, short

LIVE = ("joining", "serving", "leaving")


@dataclass
class StageBooks:
    completed: int
    stepped: int
    pending: int
    replaying: int
    inflight: int
    servers: int  # live servers of the stage: without any, the stage's pending samples cannot be known
    apart: str = ""  # replicas at one step whose parameters differ, in words; empty: none
    # samples every stage counted of a trainer that its record does not say it completed yet (its record is
    # announced every few seconds, the servers' at each step): completed since, by the servers' word
    lag: int = 0

    @property
    def accounted(self) -> int:
        return self.stepped + self.pending + self.replaying

    @property
    def missing(self) -> int:
        """Completed samples the stage does not account for (lost), 0 if none."""
        return max(0, self.completed - self.accounted)

    @property
    def extra(self) -> int:
        """Samples the stage accounts beyond what trainers completed or have under way (counted twice)."""
        return max(0, self.accounted - self.inflight - self.lag - self.completed)

    @property
    def balanced(self) -> bool:
        return not self.apart and (self.servers == 0 or (self.missing == 0 and self.extra == 0))

    def words(self, stage: int) -> str:
        sums = (
            f"{self.completed} completed; {self.stepped} stepped + {self.pending} pending + "
            f"{self.replaying} to replay (+{self.inflight} under way"
            + (f", +{self.lag} completed since the trainers announced" if self.lag else "")
            + ")"
        )
        if self.apart:
            return f"stage {stage}: {self.apart} ({sums})"
        if self.servers == 0:
            return f"stage {stage}: no live server, its pending samples unknown ({sums})"
        if self.missing:
            return f"stage {stage}: {self.missing} completed samples are in no step, accumulator or replay ({sums})"
        if self.extra:
            return f"stage {stage}: {self.extra} samples are counted more than once ({sums})"
        return f"stage {stage}: balanced ({sums})"


class Books:
    def __init__(
        self,
        num_stages: int,
        stepped_before: dict[int, int] | None = None,
        tolerance: float = TOLERANCE,
        vouched: bool = False,
        max_entries: int = 4096,
    ):
        self.num_stages = num_stages
        self.tolerance = tolerance  # how far apart replicas' fingerprints at one step may be (peer.model.fingerprint)
        self.before = stepped_before or {}  # stage -> samples stepped at the resumed checkpoint
        self.trainers: dict[tuple[str, float], int] = {}  # (peer id, start) -> samples it completed
        self.since = 0.0  # time.time() the books have disagreed since; 0 while they balance
        # with admission on: a trainer's word held to what the stages counted of it (`counted`)
        self.vouched, self.max_entries = vouched, max_entries
        # (stage, server peer id, server start) -> {trainer peer id: samples of its backwards that server counted}
        self.counted: dict[tuple[int, str, float], dict[str, int]] = {}

    def observe(self, stages: list[dict[str, ServerRecord]], trainers: dict[str, TrainerRecord]) -> list[StageBooks]:
        for pid, t in trainers.items():
            for key, samples in [((pid, t.started), t.samples), *(((pid, p[0]), int(p[1])) for p in t.predecessors)]:
                if key in self.trainers or self._room(self.trainers, key, self._unvouched):
                    self.trainers[key] = max(self.trainers.get(key, 0), samples, 0)
        self._remember_counted(stages)
        completed, replays, lag = self._completed(trainers)
        inflight = sum(max(t.inflight, 0) for t in trainers.values())  # a negative claim hides nothing
        books = []
        for stage in range(self.num_stages):
            live = [r for r in stages[stage].values() if r.state in LIVE and r.stage == stage and not r.expert]
            books.append(
                StageBooks(
                    completed=completed,
                    stepped=max((r.samples_stepped for r in live), default=0) - self.before.get(stage, 0),
                    pending=sum(r.samples + r.samples_averaging for r in live),
                    replaying=sum(replays[stage].values()),
                    inflight=inflight,
                    servers=len(live),
                    apart=apart([r for r in live if r.state == "serving"], self.tolerance),
                    lag=lag,
                )
            )
        balanced = all(b.balanced for b in books)
        self.since = 0.0 if balanced else (self.since or time.time())
        return books

    def _room(self, table: dict, key: tuple, idle) -> bool:
        """Whether `table` (keyed by (..., peer id, start)) takes `key`, making room when it must: a peer keeps its
        newest `max_entries` / 64 starts (one that announces a new start at every look pushes out only its own
        oldest), and a full table lets go of the entries `idle()` names (what no stage counted: a key that
        claims work and sent nothing), else it takes no new key."""
        peer, start = key[-2], key[-1]
        own = sorted((k for k in table if k[-2] == peer), key=lambda k: k[-1])
        if len(own) >= max(16, self.max_entries // 64):
            if start < own[0][-1]:
                return False
            del table[own[0]]
            return True
        if len(table) < self.max_entries:
            return True
        gone = idle()
        for k in gone:
            del table[k]
        return bool(gone)

    def _unvouched(self) -> list[tuple[str, float]]:
        """Trainer starts of peers no stage counted a backward of (with admission on; none without)."""
        if not self.vouched:
            return []
        counted = {pid for by in self.counted.values() for pid, n in by.items() if n > 0}
        return [k for k in self.trainers if k[0] not in counted]

    def _remember_counted(self, stages: list[dict[str, ServerRecord]]) -> None:
        """What each stage server says it counted of each trainer's backwards, kept after it goes (the most it
        said per server start; `_room`; at most max_entries / 16 callers a record)."""
        for stage, servers in enumerate(stages):
            for pid, r in servers.items():
                key = (stage, pid, r.started)
                if r.stage != stage or r.expert:
                    continue
                if key not in self.counted and not self._room(self.counted, key, self._counted_nothing):
                    continue
                mine = self.counted.setdefault(key, {})
                for trainer, samples in list(r.counted.items())[: max(64, self.max_entries // 16)]:
                    if trainer != pid:  # what a key says it counted of itself vouches for nothing
                        mine[trainer] = max(mine.get(trainer, 0), int(samples))

    def _counted_nothing(self) -> list[tuple[int, str, float]]:
        """Server starts that counted no backward."""
        return [k for k, by in self.counted.items() if not any(by.values())]

    def _completed(self, trainers: dict[str, TrainerRecord]) -> tuple[int, list[dict[str, int]], int]:
        """Samples the trainers completed, per stage what each holds for replay, and the lag: their word, held
        (with admission on) to what every stage counted of that trainer's backwards plus what it holds for replay
        there (a replayed backward went dry at its server, peer.trainer.calls); what every stage counted beyond
        its word is the lag (completed since it announced: a trainer completes a micro-batch once every stage
        counted it)."""
        said: dict[str, int] = {}
        for (pid, _), samples in self.trainers.items():
            said[pid] = said.get(pid, 0) + samples
        replays = [
            {pid: max(t.replaying[stage], 0) for pid, t in trainers.items() if len(t.replaying) > stage}
            for stage in range(self.num_stages)
        ]
        if not self.vouched:
            return sum(said.values()), replays, 0
        counted = [dict[str, int]() for _ in range(self.num_stages)]
        for (stage, _, _), by_trainer in self.counted.items():
            for pid, samples in by_trainer.items():
                counted[stage][pid] = counted[stage].get(pid, 0) + samples
        lag = 0
        for pid, samples in said.items():
            vouched = min(counted[s].get(pid, 0) + replays[s].get(pid, 0) for s in range(self.num_stages))
            said[pid], lag = min(samples, vouched), lag + max(0, vouched - samples)
            for s in range(self.num_stages):  # what it holds for replay is at most what it completed
                if pid in replays[s]:
                    replays[s][pid] = min(replays[s][pid], said[pid])
        return sum(said.values()), replays, lag

    def to_dict(self) -> dict:
        """What a restarted coordinator needs to go on with these books (JSON): the trainers seen, the base."""
        return {
            "before": {str(stage): n for stage, n in self.before.items()},
            "trainers": [[pid, started, samples] for (pid, started), samples in self.trainers.items()],
            "counted": [[stage, pid, started, by] for (stage, pid, started), by in self.counted.items()],
        }

    @classmethod
    def from_dict(cls, num_stages: int, data: dict, tolerance: float = TOLERANCE, **kwargs) -> Books:
        """Books saved by `to_dict`; ValueError (or KeyError, TypeError) if they are not."""
        books = cls(num_stages, {int(stage): int(n) for stage, n in data["before"].items()}, tolerance, **kwargs)
        books.trainers = {(str(pid), float(started)): int(samples) for pid, started, samples in data["trainers"]}
        books.counted = {
            (int(stage), str(pid), float(started)): {str(t): int(n) for t, n in by.items()}
            for stage, pid, started, by in data.get("counted", [])
        }
        return books

    def record(self, books: list[StageBooks]) -> BooksRecord:
        fields = ("completed", "stepped", "pending", "replaying", "inflight", "servers", "lag")
        return BooksRecord(
            stages=[{f: getattr(b, f) for f in fields} for b in books],
            apart=[b.apart for b in books],
            since=self.since,
            updated=time.time(),
        )


def apart(replicas: list[ServerRecord], tolerance: float = TOLERANCE) -> str:
    """Replicas of one part at one step whose announced fingerprints differ, in words ("" if none do)."""
    by_epoch: dict[int, list[ServerRecord]] = {}
    for r in replicas:
        if r.fingerprint:
            by_epoch.setdefault(r.epoch, []).append(r)
    for epoch, same in sorted(by_epoch.items()):
        first = same[0]
        for other in same[1:]:
            index = first_difference(first.fingerprint, other.fingerprint, tolerance)
            if index is not None:
                return (
                    f"replicas at step {epoch} hold different parameters: {first.endpoint} "
                    f"(fingerprint {short(first.fingerprint)}) and {other.endpoint} ({short(other.fingerprint)}), "
                    f"first at parameter {index}"
                )
    return ""


def from_record(record: BooksRecord) -> list[StageBooks]:
    aparts = record.apart or [""] * len(record.stages)
    return [
        StageBooks(**{k: int(v) for k, v in s.items()}, apart=a) for s, a in zip(record.stages, aparts, strict=False)
    ]
