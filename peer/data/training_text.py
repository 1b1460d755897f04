"""The texts a tokenizer is trained on: every document of some data paths, streamed (peer.data.sources)."""

from __future__ import annotations

from collections.abc import Iterator

from peer.data import sources


def texts_of(paths: list[str], text_field: str, max_bytes: int = 0) -> Iterator[str]:
    """The documents' texts of `paths` in order (checked first: a file it cannot use is named), up to
    `max_bytes` of text (0: all)."""
    found = []
    for path in paths:
        files = sources.find_files(path)
        sources.check_files(files, text_field)
        found.append(files)
    return _texts(found, text_field, max_bytes)


def _texts(found: list[sources.DataFiles], text_field: str, max_bytes: int) -> Iterator[str]:
    taken = 0
    for files in found:
        for row in sources.documents(files, text_field):
            text = row["text"]
            if isinstance(text, str) and text:
                yield text
                taken += len(text)
                if max_bytes and taken >= max_bytes:
                    return
