"""Where a trainer's micro-batches and validation set come from (peer.data), chosen by its settings.

- No `--data` and the byte-level tokenizer: Python's standard library as bytes (the demo's corpus),
  random windows in an order seeded by the trainer.
- Otherwise: the files of `--data` (or the standard library's, for a run with a tokenizer) streamed
  through `datasets`, tokenized in a background thread, packed (peer.data.stream); the stream's
  position is saved beside the trainer's key, so a trainer started again goes on from there.

The run spec pins the tokenizer (`data.tokenizer_fingerprint`): a trainer whose tokenizer is another
is refused before it joins in, as is one whose vocabulary does not fit the model.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path

from dht.errors import UserError
from peer.config import ConfigError, PeerConfig, RunSpec
from peer.data import sources, validation
from peer.data.corpus import Sampler, load_corpus, stdlib_files
from peer.data.stream import Position, TokenStream
from peer.data.tokenizer import BYTE_FINGERPRINT, TextTokenizer, check_vocabulary, load_tokenizer

logger = logging.getLogger(__name__)
SAVE_EVERY = 2.0  # s between saves of the stream's position


class Feed:
    """`next()`: a micro-batch (inputs, targets); `validation()`: the fixed validation set (built once, in
    the background from the start); `close()`: the stream's position saved, its thread stopped."""

    def __init__(self, spec: RunSpec, cfg: PeerConfig, seed: int, position_file: Path):
        self.spec, self.cfg, self.seed, self.position_file = spec, cfg, seed, position_file
        t, d = spec.training, spec.data
        self.tokenizer = trainer_tokenizer(spec, cfg)
        self.stream: TokenStream | None = None
        self._last_save, self._said_save = 0.0, False
        self._validation: validation.ValidationSet | None = None
        self._validation_error: BaseException | None = None
        self._built = threading.Event()  # the validation set is built, or failed, or the feed closed
        if self.tokenizer.fingerprint == BYTE_FINGERPRINT and not cfg.trainer.data:
            corpus = load_corpus()
            self._sampler = Sampler(corpus.train, t.seq_len, t.micro_batch_size, seed=seed)
            self.describe = (
                f"{corpus.source} ({len(corpus.train) / 1e6:.1f} MB, {len(corpus.validation) / 1e6:.1f} MB held out)"
            )
            if not d.validation:
                self._validation = validation.from_bytes(
                    corpus.validation, t.seq_len, t.micro_batch_size, d.validation_bytes, "held-out files"
                )
                self._built.set()
                return
        else:
            self.files = data_files(cfg, spec)
            documents = sources.documents(self.files, cfg.trainer.text_field)
            held = d.validation_fraction if not d.validation else 0.0
            # the order this trainer reads in: the position of another order (seed, buffer, ...) means nothing
            self.order = order_key(self.files.fingerprint(), seed, d.shuffle_buffer, held, cfg.trainer.text_field)
            start = Position.load(position_file, self.order)
            self.stream = TokenStream(
                documents, self.tokenizer, t.seq_len, t.micro_batch_size, seed, held, start, d.shuffle_buffer,
                cfg.trainer.prefetch_sequences,
            )  # fmt: skip
            self._sampler = self.stream
            at = f" from document {start.documents} of pass {start.epoch + 1}" if start.documents or start.epoch else ""
            self.describe = f"{cfg.trainer.data or 'the standard library'} ({self.files.describe()}){at}"
        threading.Thread(target=self._build_validation, name="validation", daemon=True).start()

    def next(self):
        batch = self._sampler.next()
        if self.stream is not None and time.monotonic() - self._last_save > SAVE_EVERY:
            self.save()
        return batch

    def save(self) -> None:
        """The stream's position, beside the key; a failure (a full disk) is said once, and training goes on."""
        if self.stream is None:
            return
        self._last_save = time.monotonic()
        try:
            self.stream.position.save(self.position_file, self.order, self.seed)
        except OSError as e:
            if not self._said_save:
                self._said_save = True
                logger.warning(
                    "cannot save the data position to %s (%s): a restart starts the data over", self.position_file, e
                )

    def close(self) -> None:
        self._built.set()  # nobody waits for the validation set any more
        if self.stream is not None:
            self.save()
            self.stream.close()

    def validation(self, timeout: float) -> validation.ValidationSet:
        """The validation set, waiting up to `timeout` s for its build; UserError if it is not there (yet)."""
        self._built.wait(timeout)
        if self._validation_error is not None:
            raise self._validation_error
        if self._validation is None:
            raise UserError(f"the validation set is not built yet (after {timeout:g} s)")
        if not self._validation.batches:
            raise UserError(f"no validation data ({self._validation.source})")
        return self._validation

    def _build_validation(self) -> None:
        t, d, field = self.spec.training, self.spec.data, self.cfg.trainer.text_field
        try:
            if d.validation:
                files, fraction, source = sources.find_files(d.validation), 1.0, d.validation
                sources.check_files(files, field)
            else:
                fraction = d.validation_fraction
                files, source = self.files, f"{fraction:.1%} of the documents held out"
            self._validation = validation.from_documents(
                sources.documents(files, field), self.tokenizer, t.seq_len, t.micro_batch_size, d.validation_bytes,
                fraction, source,
            )  # fmt: skip
            logger.info(
                "validation: %d sequences, %.0f kB of text (%s)",
                sum(len(x) for x, _ in self._validation.batches),
                self._validation.nbytes / 1e3,
                source,
            )
        except BaseException as e:  # said when validation runs
            said = e if isinstance(e, UserError) else UserError(f"validation data: {sources.first_line(e)}")
            self._validation_error = said
        finally:
            self._built.set()


def order_key(files: str, seed: int, buffer: int, held: float, field: str) -> str:
    """What fixes the order a trainer reads its documents in: its position holds only for the same."""
    return hashlib.sha256(f"{files}:{seed}:{buffer}:{held}:{field}".encode()).hexdigest()[:16]


def trainer_tokenizer(spec: RunSpec, cfg: PeerConfig) -> TextTokenizer:
    """This trainer's tokenizer (--tokenizer, else the spec's data.tokenizer); refused unless it is the one the
    spec pins and fits the model's vocabulary."""
    path = cfg.trainer.tokenizer or spec.data.tokenizer
    tokenizer = load_tokenizer(path)
    pinned = spec.data.tokenizer_fingerprint or BYTE_FINGERPRINT
    if tokenizer.fingerprint != pinned:
        raise ConfigError(
            f"trainer.tokenizer: {path or 'the byte-level default'} (fingerprint {tokenizer.fingerprint}) is not the "
            f"tokenizer of run '{spec.name}' (fingerprint {pinned}"
            + (f", from {spec.data.tokenizer}" if spec.data.tokenizer else "")
            + "); give its directory with --tokenizer"
        )
    check_vocabulary(tokenizer, spec)
    return tokenizer


def data_files(cfg: PeerConfig, spec: RunSpec) -> sources.DataFiles:
    """The checked files of --data (the validation path's left out), or the standard library's."""
    if not cfg.trainer.data:
        root, files = stdlib_files()
        found = sources.DataFiles(root, text=files)
    else:
        leave_out = {Path(spec.data.validation).resolve()} if spec.data.validation else set()
        found = sources.find_files(cfg.trainer.data, leave_out)
    sources.check_files(found, cfg.trainer.text_field)
    return found
