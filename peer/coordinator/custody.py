"""What the coordinator keeps of the run's training (Custody, a piece of peer.coordinator.coordinator's
Coordinator): checkpoints taken in a thread and offered to joiners as the state of last resort, the
state of a part whose last server leaves (a handover), the highest step each stage reached, and the
books (samples completed against what each stage accounts)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path

from dht import keys
from dht.records import ServerRecord
from peer.coordinator.admission_files import beside_key
from peer.coordinator.archive import Archive
from peer.coordinator.checkpointer import Checkpointer
from peer.coordinator.timeline import Timeline
from peer.model.fingerprint import tolerance
from peer.process.status_lines import say
from peer.swarm.books import Books
from peer.swarm.consensus import backed, credible_limit

logger = logging.getLogger(__name__)


def take_checkpoint(step: int, checkpointer: Checkpointer, timeline: Timeline, about: dict) -> Path | None:
    """Pull every part and write a checkpoint at `step`; its path (None, said, when it failed or was skipped)."""
    started = time.perf_counter()
    try:
        path = asyncio.run(checkpointer.take(step))
    except Exception as e:  # a failed checkpoint must not end the run: said, and the next one is tried
        logger.warning("checkpoint at step %d failed: %s", step, e)
        timeline.add("checkpoint", f"checkpoint at step {step} failed: {e}")
        return None
    if path is not None:
        seconds = time.perf_counter() - started
        say(f"Wrote checkpoint {path} (step {step}, {len(checkpointer.parts())} parts) in {seconds:.1f} s.")
        timeline.add("checkpoint", f"wrote checkpoint {path} (step {step}) in {seconds:.1f} s")
        about["last_checkpoint"] = {"path": str(path), "step": step, "time": time.time()}
    return path


class Custody:
    """The coordinator's custody of the run's training (Coordinator inherits it)."""

    def _start_checkpoint(self, step: int) -> bool:
        """Take a checkpoint at `step` in a thread, unless one is under way (False then): the looks (and the
        archive's announcements) go on while a big part downloads."""
        if self._checkpointing is not None and self._checkpointing.is_alive():
            return False
        self._checkpointing = threading.Thread(target=self._checkpoint, args=(step,), name="checkpoint", daemon=True)
        self._checkpointing.start()
        return True

    def _take_handovers(self, look: dict) -> None:
        """A part whose only holders are leaving, at a later step than the copy on offer: checkpoint it now
        (the leaving server waits for that: peer.server.replica_handover), so its training outlives them."""
        if not self.takes_handover:
            return
        offered = {name: int(e["epoch"]) for name, e in self.archive.manifest["parts"].items()} if self.archive else {}
        parts = [(f"stage {s}", records) for s, records in enumerate(look["stages"])]
        parts += [(f"expert {uid}", records) for uid, records in look.get("experts", {}).items()]
        for name, records in parts:
            live = [r for r in records.values() if r.state in ("serving", "leaving")]
            if not live or any(r.state == "serving" for r in live):
                continue
            # the furthest step of its leaving holders that is credible (peer.swarm.consensus): not an honest
            # leaving replica's step lost behind one a step short, nor a far claim checkpointed at every look
            epochs = [r.epoch for r in live]
            limit = credible_limit(epochs, self.cfg.server.max_resync_jump)
            epoch = max(e for e in epochs if e <= limit)
            if epoch > offered.get(name, -1) and epoch > 0:
                # the step the checkpoint is named by: what more than half of each stage's replicas say, not the
                # furthest claim (one record of step 10^9 named every later checkpoint and stopped the periodic ones)
                step = max(
                    (
                        backed(r.epoch for r in stage.values() if r.state in ("serving", "leaving"))
                        for stage in look["stages"]
                    ),
                    default=epoch,
                )
                if self._start_checkpoint(step):
                    say(f"The last server of {name} is leaving at step {epoch}: checkpointing its state now.")
                return

    def _keep_books(self, look: dict) -> None:
        """The books of the run (peer.coordinator.books), announced for `peer status`; a warning, in words,
        when they stay off past coordinator.books_grace."""
        if self.books is None:
            self.books = Books(
                self.spec.stages.num_stages, self._stepped_before(), self._tolerance(), **self._vouched()
            )
        books = self.books.observe(look["stages"], look["trainers"])
        with contextlib.suppress(Exception):  # the DHT may be busy: announced again next tick
            self.dht.store(
                keys.books_key(self.spec.name),
                self.books.record(books),
                self.cfg.coordinator.refreshed_ttl(self.cfg.network),
            )
        since = self.books.since
        if since and time.time() - since > self.cfg.coordinator.books_grace and time.time() - self._books_said > 60:
            self._books_said = time.time()
            wrong = "; ".join(b.words(i) for i, b in enumerate(books) if not b.balanced)
            logger.warning("the books disagree for %.0f s: %s", time.time() - since, wrong)
            self.timeline.add("books", f"the books disagree: {wrong}")

    def _vouched(self) -> dict:
        """The books hold trainers' word to what stages counted of them when callers are known (admission on)."""
        return {"vouched": self.spec.admission.mode != "off", "max_entries": self.cfg.coordinator.books_max_entries}

    def _tolerance(self) -> float:
        return tolerance(self.spec.compression.averaging)

    def _books_path(self) -> Path:
        return beside_key(self.cfg.coordinator.books_file, self.identity, self.spec, "books.json")

    def save_books(self) -> None:
        """Write the books (atomically): a coordinator restarted with the same key goes on with them."""
        if self.books is None:
            return
        path = self._books_path()
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps({"run": self.spec.fingerprint(), **self.books.to_dict()}))
            os.replace(tmp, path)
        except OSError as e:  # written again at the next report
            logger.warning("could not save the books to %s: %s", path, e)

    def load_books(self) -> bool:
        """The books this run's coordinator saved before a restart, if any (True then)."""
        try:
            data = json.loads(self._books_path().read_text())
            if data.get("run") != self.spec.fingerprint():
                return False
            self.books = Books.from_dict(self.spec.stages.num_stages, data, self._tolerance(), **self._vouched())
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return False
        return True

    def _stepped_before(self) -> dict[int, int]:
        """Samples each stage had stepped at the checkpoint this run resumed from (the books count from there)."""
        if self.archive is None or not self.resumed:
            return {}
        parts = self.archive.manifest["parts"]
        stages = range(self.spec.stages.num_stages)
        return {
            s: int(parts[f"stage {s}"]["metadata"].get("samples_stepped", 0)) for s in stages if f"stage {s}" in parts
        }

    def _remember_trained(self, summary: dict) -> None:
        """The highest step each stage has reached. Without a checkpoint to offer, each stage that has
        stepped is announced as `trained` (no state, only its step): a server that joins it when nobody
        serves it waits for its state rather than start it from the seed (peer.server.stage). A coordinator
        that keeps checkpoints announces every stage from the start: their last servers hand over as they leave."""
        for stage, s in enumerate(summary["stages"]):
            self.trained[stage] = max(self.trained.get(stage, 0), s["step"])
        if self.archive is not None:
            return  # its records say where the state is
        now = time.time()
        for stage, epoch in self.trained.items():
            if epoch > 0 or self.takes_handover:
                record = ServerRecord(
                    stage=stage,
                    endpoint="",
                    throughput=0.0,
                    epoch=epoch,
                    step=epoch,
                    state="trained",
                    takes_handover=self.takes_handover,
                    updated=now,
                )
                with contextlib.suppress(Exception):  # the DHT may be busy: announced again next tick
                    self.dht.store(
                        keys.servers_key(self.spec.name, stage),
                        record,
                        self.cfg.coordinator.refreshed_ttl(self.cfg.network),
                    )

    def _checkpoint(self, step: int) -> None:
        """The checkpoint thread: take one, and offer it to joiners."""
        path = take_checkpoint(step, self.checkpointer, self.timeline, self.about)
        if path is not None:
            self._offer(path)

    def _offer(self, path: Path) -> None:
        """The checkpoint just written becomes the state of last resort of every part: a server that joins a
        part nobody serves (all left, or all died) loads it rather than start from the seed."""
        try:
            if self.archive is None:
                self.archive = Archive(path, self.spec, self.cfg, self.dht)
                self.archive.start()
            else:
                self.archive.switch(path)
            self.archive.announce()
        except Exception as e:  # the run goes on; offered again at the next checkpoint
            logger.warning("could not offer checkpoint %s to joiners: %s", path, e)

    def retract_handovers(self) -> None:
        """Stopping: the parts' records say this coordinator takes no more handovers (a last server that is
        leaving stops waiting for one)."""
        self.takes_handover = False
        with contextlib.suppress(Exception):  # the DHT may be going: the records' lifetime ends it all the same
            if self.archive is not None:
                self.archive.takes_handover = False
                self.archive.announce()
            else:
                self._remember_trained({"stages": []})
