"""Micro-batches from a stream of documents: tokenized in a background thread, packed into sequences.

The documents come in an order seeded by the trainer (its peer id by default: trainers do not feed
the swarm the same sequences) through a shuffle buffer, epoch after epoch (each reshuffled). Each
document's ids are followed by the tokenizer's end-of-text id (the byte default: a blank line), and
the stream is cut into sequences of `seq_len + 1` ids, `seq_len` apart (inputs and next-token
targets). The thread keeps at most `prefetch` sequences ahead.

The position (epoch, and documents of that epoch whose ids were all handed out) is saved beside the
trainer's key now and then and at its end; a trainer started again on the same data goes on from
there (the documents of its last micro-batches may come again: a document cut in two restarts).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from peer.data.corpus import CorpusError
from peer.data.sources import first_line, held_out
from peer.data.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)
ENCODE_BATCH = 64  # documents tokenized at once, at most
ENCODE_BYTES = 8 << 20  # characters tokenized at once, at most (a batch of big documents)


@dataclass
class Position:
    """Where a trainer is in its data stream."""

    epoch: int = 0  # passes over the data begun before this one
    documents: int = 0  # documents of this epoch's order whose ids were all handed out

    @staticmethod
    def load(path: Path, data: str) -> Position:
        """The position saved at `path` for data of fingerprint `data`; the start if none (or other data)."""
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            return Position()
        if saved.get("data") != data:
            logger.warning("%s is of other data: starting the data from the beginning", path)
            return Position()
        return Position(int(saved.get("epoch", 0)), int(saved.get("documents", 0)))

    def save(self, path: Path, data: str, seed: int) -> None:
        """Atomically, so a kill mid-write leaves the previous one."""
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps({"data": data, "seed": seed, "epoch": self.epoch, "documents": self.documents}))
        os.replace(temporary, path)


class TokenStream:
    """`next()`: a micro-batch (inputs, targets) of `batch_size` packed sequences of `seq_len` ids."""

    def __init__(
        self,
        dataset,
        tokenizer: TextTokenizer,
        seq_len: int,
        batch_size: int,
        seed: int,
        held_out_fraction: float = 0.0,
        start: Position | None = None,
        shuffle_buffer: int = 1000,
        prefetch: int = 1024,
    ):
        self.dataset, self.tokenizer, self.seq_len, self.batch_size = dataset, tokenizer, seq_len, batch_size
        self.seed, self.held_out_fraction, self.shuffle_buffer = seed, held_out_fraction, shuffle_buffer
        self.position = start or Position()
        self.skipped = 0  # bad documents (not text, no field) passed over
        self.used = 0  # documents tokenized
        self._queue: queue.Queue = queue.Queue(maxsize=max(prefetch, batch_size))
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="data", daemon=True)
        self._thread.start()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next micro-batch; blocks until the thread has it; CorpusError if the data ran dry or the
        stream was closed meanwhile."""
        rows, position = [], self.position
        while len(rows) < self.batch_size:
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set():
                    raise CorpusError("the data stream was closed") from None
                continue
            if item is None:
                raise self._error or CorpusError("the data stream ended")
            row, position = item
            rows.append(row)
        self.position = position
        batch = torch.from_numpy(np.stack(rows).astype(np.int64))
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (waiting at most `timeout` for it: it may be inside one long read)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:
                self._queue.get_nowait()  # a thread blocked on a full queue sees the stop
            except queue.Empty:
                self._thread.join(0.05)

    # ---- the thread ---------------------------------------------------------------------------
    def _work(self) -> None:
        try:
            self._pack()
        except BaseException as e:  # handed to the caller of next(), who says what went wrong
            self._error = e if isinstance(e, CorpusError) else CorpusError(f"reading the data failed: {first_line(e)}")
        finally:
            self._put(None)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _pack(self) -> None:
        epoch, begin = self.position.epoch, self.position.documents
        ids = np.empty(0, dtype=np.int32)
        ends: list[tuple[int, Position]] = []  # (offset just past a document's ids in `ids`, the position after it)
        done = Position(epoch, begin)
        while not self._stop.is_set():
            produced = 0
            for texts, indices in self._batches(epoch, begin):
                pieces, length = [], len(ids)
                for encoded, index in zip(self._encode(texts), indices, strict=True):
                    if encoded is None:
                        continue
                    pieces += [encoded, self.tokenizer.separator()]
                    length += len(encoded) + len(pieces[-1])
                    ends.append((length, Position(epoch, index)))
                ids = np.concatenate([ids, *pieces]) if pieces else ids
                while len(ids) > self.seq_len:
                    cut = self.seq_len
                    while ends and ends[0][0] <= cut + 1:  # all its ids are in this row: handed out with it
                        done = ends.pop(0)[1]
                    if not self._put((ids[: cut + 1].copy(), done)):
                        return
                    produced += 1
                    ids = ids[cut:]
                    ends = [(offset - cut, after) for offset, after in ends]
            if not produced and not begin and not self.used:
                raise CorpusError("the data holds no usable document (every one empty, held out or bad)")
            epoch, begin = epoch + 1, 0
            logger.info(
                "data: pass %d begins (%d documents used, %d skipped so far)", epoch + 1, self.used, self.skipped
            )

    def _encode(self, texts: list[str]) -> list[np.ndarray | None]:
        """Each text's ids; one the tokenizer refuses (None) is counted as skipped, the others go on."""
        try:
            return self.tokenizer.encode_batch(texts)
        except Exception:  # noqa: BLE001 - which document: tokenized one by one
            encoded = []
            for text in texts:
                try:
                    encoded += self.tokenizer.encode_batch([text])
                except Exception as e:  # noqa: BLE001 - a bad document is skipped, not the trainer's end
                    self.skipped += 1
                    logger.warning("a document the tokenizer refuses (%s); skipped", first_line(e))
                    encoded.append(None)
            return encoded

    def _batches(self, epoch: int, begin: int):
        """Batches of usable documents from position `begin` of the epoch: (texts, for each the documents of
        the epoch read up to it). At most ENCODE_BATCH documents or ENCODE_BYTES of text a batch."""
        dataset = self.dataset.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer)
        dataset.set_epoch(epoch)
        # skipped by hand: datasets' skip() starts a dataset whose epoch is 0 again (another order)
        index, texts, indices, size = begin, [], [], 0
        for row in itertools.islice(dataset, begin, None):
            if self._stop.is_set():
                return
            index += 1
            text = row["text"]
            if not isinstance(text, str):
                self.skipped += 1
            elif text and not held_out(text, self.held_out_fraction):
                texts.append(text)
                indices.append(index)
                size += len(text)
                self.used += 1
            if len(texts) >= ENCODE_BATCH or size >= ENCODE_BYTES:
                yield texts, indices
                texts, indices, size = [], [], 0
        if texts:
            yield texts, indices
