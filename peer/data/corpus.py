"""Training data: bytes of text files, split into train and held-out validation by file.

The default corpus is Python's own standard library (`sysconfig.get_paths()["stdlib"]`, `*.py`,
without site-packages): real text on every machine, no download.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dht.errors import UserError

VALIDATION_PERCENT = 5  # files whose name hashes below this go to the held-out split
SEPARATOR = b"\n\n"


class CorpusError(UserError, ValueError):
    """Data that cannot be used for training; the message names the path and the problem."""


@dataclass
class Corpus:
    train: np.ndarray  # uint8 bytes of the training files, concatenated
    validation: np.ndarray  # uint8 bytes of the held-out files
    source: str  # where the text came from
    num_files: int


def _is_validation(relative: str) -> bool:
    return int(hashlib.sha1(relative.encode()).hexdigest(), 16) % 100 < VALIDATION_PERCENT


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return root, files


def is_text(path: Path, probe: int = 8192) -> bool:
    """Whether a file looks like text: no NUL byte in its first `probe` bytes (binaries nearly always have one)."""
    try:
        with open(path, "rb") as f:
            return b"\0" not in f.read(probe)
    except OSError:
        return False


def _user_files(path: Path) -> tuple[Path, list[Path]]:
    """The text files of `--data`: the file itself, or those under the directory, leaving out hidden
    files and directories (`.git/` among them) and binary files."""
    if path.is_file():
        return path.parent, [path]
    if path.is_dir():
        files = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            files += [Path(dirpath) / f for f in sorted(filenames) if not f.startswith(".")]
        return path, [f for f in files if f.is_file() and is_text(f)]
    raise CorpusError(f"--data {path}: no such file or directory")


def load_corpus(data: str = "") -> Corpus:
    """Read the corpus: `data` (a file or a directory of files) or, when empty, the standard library."""
    root, files = _user_files(Path(data)) if data else stdlib_files()
    train_parts, val_parts = [], []
    for path in files:
        try:
            content = path.read_bytes()
        except OSError:
            continue
        if not content:
            continue
        (val_parts if _is_validation(str(path.relative_to(root))) else train_parts).append(content)
    if len(files) == 1 and (train_parts or val_parts):  # a single file: hold out its last 5 %
        content = (train_parts or val_parts)[0]
        cut = len(content) * (100 - VALIDATION_PERCENT) // 100
        train_parts, val_parts = [content[:cut]], [content[cut:]]
    train = np.frombuffer(SEPARATOR.join(train_parts), dtype=np.uint8)
    validation = np.frombuffer(SEPARATOR.join(val_parts), dtype=np.uint8)
    if len(train) < 1024 or len(validation) < 1024:
        raise CorpusError(f"{data or root}: too little text ({len(train)} train, {len(validation)} held-out bytes)")
    return Corpus(train=train, validation=validation, source=str(data or root), num_files=len(files))


class Sampler:
    """Deterministic random windows of a byte array: inputs and next-byte targets."""

    def __init__(self, data: np.ndarray, seq_len: int, batch_size: int, seed: int):
        if len(data) <= seq_len + 1:
            raise CorpusError(f"text of {len(data)} bytes is shorter than one sequence of {seq_len}")
        self.data, self.seq_len, self.batch_size = data, seq_len, batch_size
        self.rng = np.random.default_rng(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.rng.integers(0, len(self.data) - self.seq_len - 1, size=self.batch_size)
        windows = np.stack([self.data[s : s + self.seq_len + 1] for s in starts])
        batch = torch.from_numpy(windows.astype(np.int64))
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def validation_batches(
    corpus: Corpus, seq_len: int, batch_size: int, count: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of held-out micro-batches, the same on every peer, so validation losses compare."""
    sampler = Sampler(corpus.validation, seq_len, batch_size, seed=20240611)
    return [sampler.next() for _ in range(count)]


def unigram_entropy(data: np.ndarray) -> float:
    """Entropy in nats of the byte frequencies: the loss of the best model that ignores context."""
    counts = np.bincount(data, minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
