"""A trainer's journal: its micro-batches not yet settled, on disk beside its key, so that a trainer that
was killed (SIGKILL, a crash) and is started again with the same key finishes them, each exactly once.

A micro-batch's uid and tokens are written when it starts, each backward's server before the call,
`done` once it completed, `settled` once no receipt of it is left (every stage stepped it, or holds
it in the accumulator of a live server when the trainer stops cleanly). A start reads what the last
one left: how many samples it completed (for the books: `TrainerRecord.predecessors`), and the
micro-batches not settled. It runs each of them again under its uid:
- a stage whose step already counted it (its receipt there settled: `stepped`) gets it dry: it answers
  the input gradients and adds nothing;
- a stage whose server's receipt the last start wrote down (`receipts`: server, incarnation, addition
  number) gets it dry too, and the receipt goes into this start's ledger (peer.trainer.ledger), settled
  like any other: stepped by that server, or, if it went away first, counted by its survivors' steps or
  replayed. Where the backward goes now does not matter;
- a stage whose backward was sent and not answered goes only to the server the last start sent it to,
  while that server lives: it answers a uid it counted with its first receipt and adds nothing
  (peer.model.runtime), and adds one it never got. Once it died or left (or its record expired), the
  backward goes anywhere: what it held went with it. So it does once that server was caught lying
  (peer.swarm.router.Router.lost): nothing it says it holds is taken on trust.
Every stage thus counts each micro-batch once.

Lines are appended and flushed: a killed process loses nothing the kernel has. When the file grows,
it is rewritten with only what is unsettled. A clean stop leaves no micro-batch in it.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
MAX_PREDECESSORS = 8  # earlier starts whose completed samples a start announces (the books may not have seen them)


@dataclass
class Entry:
    """A micro-batch under way or not settled."""

    uid: str
    inputs: torch.Tensor  # token ids
    targets: torch.Tensor
    sent: dict[int, str] = field(default_factory=dict)  # stage -> peer id its backward went to last
    stepped: set[int] = field(default_factory=set)  # stages whose step counted it: run again dry (adding nothing)
    # stage -> (peer id, incarnation, seq, time.time() answered): the server's receipt, once it answered
    receipts: dict[int, tuple[str, int, int, float]] = field(default_factory=dict)
    dry: set[int] = field(default_factory=set)  # the stages this start sends it to dry (not written down)
    held: dict[int, tuple[str, int, int, float]] = field(default_factory=dict)  # receipts of an earlier start
    # that this start holds in its ledger instead of sending the stage's backward counted (not written down)
    done: bool = False  # completed (its samples are counted in some start's completed samples)
    recovered: bool = False  # an earlier start's, run again by this one
    done_before: bool = False  # an earlier start completed it: this start does not count it again

    def line(self) -> dict:
        return {
            "begin": self.uid,
            "inputs": _tokens(self.inputs),
            "targets": _tokens(self.targets),
            "sent": {str(s): pid for s, pid in self.sent.items()},
            "stepped": sorted(self.stepped),
            "receipts": {str(s): list(r) for s, r in self.receipts.items()},
            "done_before": self.done_before,
        }


class Journal:
    def __init__(self, path: Path, compact_after: int = 4096):
        self.path, self.compact_after = path, compact_after
        self.entries: dict[str, Entry] = {}
        self.started = 0.0
        self.completed = 0  # samples this start completed
        self.predecessors: list[list[float]] = []  # [start time, samples completed] of earlier starts, newest last
        self._file = None
        self._lines = 0

    # ---- a start ----------------------------------------------------------------------------
    def open(self, started: float) -> list[Entry]:
        """Start anew at `started`; the micro-batches an earlier start left unsettled, to run again."""
        left = self._read()
        for entry in left:
            entry.recovered, entry.done_before, entry.done = True, entry.done_before or entry.done, False
        self.started, self.entries = started, {e.uid: e for e in left}
        self._rewrite()
        if left:
            logger.warning(
                "the last start of this trainer left %d micro-batches unsettled: running them again", len(left)
            )
        return left

    def _read(self) -> list[Entry]:
        """The entries the file holds that are not settled; the earlier starts' counts into `predecessors`."""
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        entries: dict[str, Entry] = {}
        start, completed = None, 0
        for number, text in enumerate(lines):
            try:
                line = json.loads(text)
                start, completed = self._replay(line, entries, start, completed)
            except (ValueError, KeyError, TypeError) as e:  # a line cut off by the kill: the last one only
                if number < len(lines) - 1:
                    logger.warning(
                        "%s: line %d is damaged (%s); the rest of the journal is ignored", self.path, number + 1, e
                    )
                break
        if start is not None:
            self.predecessors = (self.predecessors + [[start, completed]])[-MAX_PREDECESSORS:]
        return list(entries.values())

    def _replay(self, line: dict, entries: dict[str, Entry], start, completed: int):
        if "start" in line:
            self.predecessors = [list(p) for p in line.get("predecessors", [])]
            return float(line["start"]), int(line.get("completed", 0))
        if "begin" in line:
            sent = {int(s): pid for s, pid in line.get("sent", {}).items()}
            entries[line["begin"]] = Entry(
                line["begin"],
                _tensor(line["inputs"]),
                _tensor(line["targets"]),
                sent,
                {int(s) for s in line.get("stepped", [])},
                {int(s): _receipt(r) for s, r in line.get("receipts", {}).items()},
                done_before=line["done_before"],
            )
        elif "stepped" in line:
            entries[line["uid"]].stepped.add(int(line["stepped"]))
        elif "sent" in line:
            entries[line["uid"]].sent[int(line["stage"])] = line["sent"]
        elif "receipt" in line:
            entries[line["uid"]].receipts[int(line["stage"])] = _receipt(line["receipt"])
        elif "done" in line:
            entry = entries[line["done"]]
            entry.done = True
            completed += 0 if entry.done_before else int(line["samples"])
        elif "settled" in line:
            entries.pop(line["settled"], None)
        return start, completed

    # ---- as micro-batches go ------------------------------------------------------------------
    def begin(self, entry: Entry) -> None:
        if not entry.recovered:
            self.entries[entry.uid] = entry
            self._append(entry.line())

    def sent(self, uid: str, stage: int, peer_id: str) -> None:
        entry = self.entries.get(uid)
        if entry is not None and entry.sent.get(stage) != peer_id:
            entry.sent[stage] = peer_id
            self._append({"uid": uid, "stage": stage, "sent": peer_id})

    def received(self, uid: str, stage: int, receipt: tuple[str, int, int, float]) -> None:
        """Stage `stage`'s server answered the backward: its receipt (peer id, incarnation, seq, time answered)."""
        entry = self.entries.get(uid)
        if entry is not None and entry.receipts.get(stage) != receipt:
            entry.receipts[stage] = receipt
            self._append({"uid": uid, "stage": stage, "receipt": list(receipt)})

    def stepped(self, uid: str, stage: int) -> None:
        """Stage `stage` has this micro-batch in a finished step (its receipt there settled)."""
        entry = self.entries.get(uid)
        if entry is not None and stage not in entry.stepped:
            entry.stepped.add(stage)
            self._append({"uid": uid, "stepped": stage})

    def done(self, uid: str, samples: int) -> None:
        entry = self.entries.get(uid)
        if entry is not None:
            entry.done = True
            self.completed += 0 if entry.done_before else samples
            self._append({"done": uid, "samples": samples})

    def settled(self, uid: str) -> None:
        if self.entries.pop(uid, None) is not None:
            self._append({"settled": uid})

    def close(self, clean: bool) -> None:
        """A clean stop: what live servers hold is theirs to step, nothing is left to run again."""
        if clean:
            self.entries = {uid: e for uid, e in self.entries.items() if not e.done}
        self._rewrite()
        if self._file is not None:
            self._file.close()
            self._file = None

    # ---- the file ---------------------------------------------------------------------------
    def _append(self, line: dict) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()
        except OSError as e:  # a full disk: the journal stops, training goes on (said once)
            logger.warning("could not write the trainer's journal %s (%s): a kill now may lose samples", self.path, e)
            self._file = None
            return
        self._lines += 1
        if self._lines > self.compact_after:
            self._rewrite()

    def _rewrite(self) -> None:
        """The file anew: this start, and the entries not settled."""
        head = {"start": self.started, "completed": self.completed, "predecessors": self.predecessors}
        lines = [head]
        for entry in self.entries.values():
            lines.append(entry.line())
            if entry.done:
                lines.append({"done": entry.uid, "samples": 0})  # already counted in `completed`
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
            os.replace(tmp, self.path)
            if self._file is not None:
                self._file.close()
            self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - kept open, closed by close()
        except OSError as e:
            logger.warning("could not write the trainer's journal %s (%s): a kill now may lose samples", self.path, e)
            self._file = None
        self._lines = len(lines)


def _receipt(r: list) -> tuple[str, int, int, float]:
    return str(r[0]), int(r[1]), int(r[2]), float(r[3])


def _tokens(t: torch.Tensor) -> dict:
    return {"shape": list(t.shape), "data": base64.b64encode(t.to(torch.int32).contiguous().numpy().tobytes()).decode()}


def _tensor(d: dict) -> torch.Tensor:
    data = bytearray(base64.b64decode(d["data"]))
    return torch.frombuffer(data, dtype=torch.int32).reshape(d["shape"]).to(torch.long)
