"""Tokenizers, as Hugging Face `tokenizers` models: the byte-level default and those a run brings.

The default (`bytes`): token id b is byte b (0..255); documents are separated by a blank line. Saved
as tokenizer.json (a byte-level BPE with no merges, GPT-2's byte-to-character map) so that
`AutoTokenizer.from_pretrained` loads an exported model's tokenizer and `encode`/`decode` are the
identity on bytes.

A run's own: a directory with tokenizer.json (a model directory's, or one `peer tokenizer train`
wrote: byte-level BPE with `<|endoftext|>` between documents and `<|pad|>`). Its fingerprint (a hash
of its canonical JSON) is pinned in the run spec, so every trainer feeds the swarm the same ids.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dht.errors import UserError
from peer.config import ConfigError, RunSpec

BYTES = 256
BYTE_FINGERPRINT = "bytes"  # the byte-level default's fingerprint
EOT = "<|endoftext|>"  # between documents; also the beginning and end of a sequence for transformers
PAD = "<|pad|>"
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class TokenizerError(UserError, ValueError):
    """A tokenizer that cannot be used; the message names the path and the problem."""


def byte_characters() -> list[str]:
    """GPT-2's printable stand-in character for each byte value (tokenizers' ByteLevel alphabet), by byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(BYTES):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(BYTES + extra)
            extra += 1
    return [chars[b] for b in range(BYTES)]


def byte_tokenizer():
    """A `tokenizers.Tokenizer` whose ids are the bytes of the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # lazy: only some commands need it

    vocab = {c: b for b, c in enumerate(byte_characters())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def save_byte_tokenizer(directory: Path, max_length: int) -> list[str]:
    """tokenizer.json and tokenizer_config.json in `directory`; the names of the files written."""
    byte_tokenizer().save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json"]


@dataclass
class TextTokenizer:
    """What the data path needs of a tokenizer: ids of texts, the id between documents, the vocabulary's
    size and the fingerprint the run spec pins."""

    source: str  # "bytes", or the directory it came from
    vocab_size: int
    eot: int | None  # the end-of-text id put between documents; None: the ids of a blank line instead
    fingerprint: str
    _tokenizer: object = field(default=None, repr=False)  # tokenizers.Tokenizer; None: bytes
    _separator: np.ndarray | None = field(default=None, repr=False)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids (int32), without special tokens."""
        if self._tokenizer is None:
            return [np.frombuffer(t.encode("utf-8", "replace"), dtype=np.uint8).astype(np.int32) for t in texts]
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        return [np.asarray(e.ids, dtype=np.int32) for e in encode(texts, add_special_tokens=False)]

    def separator(self) -> np.ndarray:
        """What goes between two documents of a packed stream: the end-of-text id, else a blank line's ids."""
        if self._separator is None:
            between = [self.eot] if self.eot is not None else self.encode_batch(["\n\n"])[0]
            self._separator = np.asarray(between, dtype=np.int32)
        return self._separator

    def save(self, directory: Path, max_length: int) -> list[str]:
        """The tokenizer files, so `AutoTokenizer.from_pretrained(directory)` loads it; their names."""
        if self._tokenizer is None:
            return save_byte_tokenizer(directory, max_length)
        written = []
        for name in FILES:
            if (Path(self.source) / name).is_file():
                shutil.copyfile(Path(self.source) / name, directory / name)
                written.append(name)
        return written


def bytes_tokenizer() -> TextTokenizer:
    return TextTokenizer("bytes", BYTES, None, BYTE_FINGERPRINT)


def fingerprint_of(tokenizer) -> str:
    """A short hash of a `tokenizers.Tokenizer`'s canonical JSON: equal for the same vocabulary, merges and rules."""
    canonical = json.dumps(json.loads(tokenizer.to_str()), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def load_tokenizer(path: str) -> TextTokenizer:
    """The tokenizer of directory (or tokenizer.json) `path`; "" or "bytes": the byte-level default."""
    if path in ("", BYTE_FINGERPRINT):
        return bytes_tokenizer()
    from tokenizers import Tokenizer  # lazy: the byte default needs none

    where = Path(path)
    file = where / "tokenizer.json" if where.is_dir() else where
    if not file.is_file():
        raise TokenizerError(f"tokenizer {path}: no tokenizer.json there (a Hugging Face tokenizers file)")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # a damaged or foreign file: say so in one line
        said = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TokenizerError(f"tokenizer {file}: cannot be read ({said})") from None
    eot = _end_of_text(tokenizer, file.parent)
    return TextTokenizer(str(file.parent), tokenizer.get_vocab_size(True), eot, fingerprint_of(tokenizer), tokenizer)


def _end_of_text(tokenizer, directory: Path) -> int | None:
    """The id between documents: <|endoftext|>, else the eos token its config names (a model directory's
    </s> or <|end_of_text|>); None: none (a blank line's ids go between documents)."""
    names = [EOT]
    for config in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            eos = json.loads((directory / config).read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        names.append(eos.get("content") if isinstance(eos, dict) else eos)
    ids = [tokenizer.token_to_id(name) for name in names if isinstance(name, str)]
    return next((i for i in ids if i is not None), None)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out: Path, max_length: int = 2048) -> TextTokenizer:
    """Train a byte-level BPE of `vocab_size` tokens (with EOT and PAD) on `texts`; save it in `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # lazy: one command

    least = BYTES + 2
    if vocab_size < least:
        raise TokenizerError(f"--vocab-size: {vocab_size} cannot hold the {BYTES} bytes and 2 special tokens ({least})")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    special = {"bos_token": EOT, "eos_token": EOT, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return load_tokenizer(str(out))


def check_vocabulary(tokenizer: TextTokenizer, spec: RunSpec) -> None:
    if tokenizer.vocab_size > spec.model.vocab_size:
        raise ConfigError(
            f"data.tokenizer: {tokenizer.source} has {tokenizer.vocab_size} tokens, more than model.vocab_size "
            f"{spec.model.vocab_size}; set model.vocab_size to at least {tokenizer.vocab_size}"
        )


def pin_tokenizer(spec: RunSpec) -> RunSpec:
    """The coordinator: data.tokenizer's fingerprint into the spec (checked against one already pinned)."""
    d = spec.data
    if not d.tokenizer:
        if d.tokenizer_fingerprint not in ("", BYTE_FINGERPRINT):
            raise ConfigError("data.tokenizer_fingerprint: pinned, but data.tokenizer names no tokenizer")
        return spec
    tokenizer = load_tokenizer(d.tokenizer)
    if d.tokenizer_fingerprint and d.tokenizer_fingerprint != tokenizer.fingerprint:
        raise ConfigError(
            f"data.tokenizer: {d.tokenizer} has fingerprint {tokenizer.fingerprint}, "
            f"but the spec pins {d.tokenizer_fingerprint}"
        )
    check_vocabulary(tokenizer, spec)
    d.tokenizer_fingerprint = tokenizer.fingerprint
    return spec
