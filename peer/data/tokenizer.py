"""The byte-level tokenizer every run trains with today, as a Hugging Face `tokenizers` model.

Token id b is byte b (0..255), the way peer.data.corpus feeds the model. Saved as tokenizer.json
(a byte-level BPE with no merges, GPT-2's byte-to-character map) so that
`AutoTokenizer.from_pretrained` loads an exported model's tokenizer and `encode`/`decode` are the
identity on bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

BYTES = 256


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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # lazy: only export and generate need it

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
