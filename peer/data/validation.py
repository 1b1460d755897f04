"""The validation set: the same held-out sequences every time, and what a pass over them measures.

It covers at least `data.validation_bytes` of text (all of it when there is less), from the run
spec's `data.validation` path, or else from the documents of the trainer's data that `held_out`
sets aside (`data.validation_fraction`, by document: never trained on). Documents are read in their
natural order, packed like training data, and cut into micro-batches. Each sequence carries the
bytes of text its targets stand for (a document's bytes spread evenly over its ids), so that bits
per byte compare runs with different tokenizers.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from peer.data.sources import held_out
from peer.data.tokenizer import TextTokenizer


@dataclass
class ValidationSet:
    batches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (inputs, targets)
    batch_bytes: list[float] = field(default_factory=list)  # per micro-batch: bytes of text its targets stand for
    source: str = ""

    @property
    def nbytes(self) -> float:
        return sum(self.batch_bytes)

    def first(self, count: int) -> ValidationSet:
        """Its first `count` micro-batches (all: 0)."""
        if not count:
            return self
        return ValidationSet(self.batches[:count], self.batch_bytes[:count], self.source)

    @property
    def digest(self) -> str:
        """A hash of the set's ids: equal for the same sequences."""
        return digest(*(x for x, _ in self.batches), *(t for _, t in self.batches))

    @property
    def tokens(self) -> int:
        return sum(t.numel() for _, t in self.batches)


@dataclass
class Scores:
    loss: float  # mean cross-entropy per token, in nats
    perplexity: float
    bits_per_byte: float

    @staticmethod
    def of(mean_losses: list[float], validation: ValidationSet) -> Scores:
        """From the mean loss of each of the set's micro-batches, in order."""
        nats = sum(loss * t.numel() for loss, (_, t) in zip(mean_losses, validation.batches, strict=True))
        loss = nats / max(validation.tokens, 1)
        bpb = nats / math.log(2) / validation.nbytes if validation.nbytes else float("nan")
        return Scores(loss, math.exp(min(loss, 700.0)), bpb)


def from_bytes(data: np.ndarray, seq_len: int, batch_size: int, max_bytes: int, source: str) -> ValidationSet:
    """The byte-level corpus's held-out bytes: consecutive sequences covering `max_bytes` (or all)."""
    usable = min(len(data) - 1, max(max_bytes, seq_len))
    rows = [data[s : s + seq_len + 1] for s in range(0, usable - seq_len + 1, seq_len)]
    return _batched(rows, [float(seq_len)] * len(rows), batch_size, source)


def from_documents(
    documents, tokenizer: TextTokenizer, seq_len: int, batch_size: int, max_bytes: int, fraction: float, source: str
) -> ValidationSet:
    """From a `datasets.IterableDataset` of documents: the held-out ones (all of them with `fraction` 1)."""
    ids, weights, rows, row_bytes, taken = [], [], [], [], 0
    if fraction <= 0:
        return ValidationSet(source=source)  # nothing is held out: no pass over the data for nothing
    for row in documents:
        text = row["text"]
        if not isinstance(text, str) or not text or (fraction < 1 and not held_out(text, fraction)):
            continue
        try:
            (encoded,) = tokenizer.encode_batch([text])
        except Exception:  # noqa: BLE001 - a document the tokenizer refuses is left out here too
            continue
        sep = tokenizer.separator()
        size = len(text.encode("utf-8", "replace"))
        ids.append(np.concatenate([encoded, sep]))
        weights.append(np.full(len(encoded) + len(sep), size / max(len(encoded) + len(sep), 1)))
        taken += size
        if taken >= max_bytes:
            break
    if not ids:
        return ValidationSet(source=source)
    stream, per_id = np.concatenate(ids), np.concatenate(weights)
    for start in range(0, len(stream) - seq_len, seq_len):
        rows.append(stream[start : start + seq_len + 1])
        row_bytes.append(float(per_id[start + 1 : start + seq_len + 1].sum()))
    return _batched(rows, row_bytes, batch_size, source)


def _batched(rows: list[np.ndarray], row_bytes: list[float], batch_size: int, source: str) -> ValidationSet:
    """Micro-batches of whole `batch_size` rows (the last partial one dropped, unless it is the only one)."""
    keep = len(rows) - len(rows) % batch_size if len(rows) >= batch_size else len(rows)
    out = ValidationSet(source=source)
    for start in range(0, keep, batch_size):
        batch = torch.from_numpy(np.stack(rows[start : start + batch_size]).astype(np.int64))
        out.batches.append((batch[:, :-1].contiguous(), batch[:, 1:].contiguous()))
        out.batch_bytes.append(sum(row_bytes[start : start + batch_size]))
    return out


def digest(*tensors: torch.Tensor) -> str:
    """A short hash of token ids (of a micro-batch, of a validation set)."""
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:12]
