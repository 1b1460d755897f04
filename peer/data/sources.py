"""A trainer's data files, read as a stream of documents through the `datasets` library.

`--data PATH` is a file or a directory of: text files (any suffix; a file is a document, a big one is
cut at lines into documents of about 1 MB), JSON lines (`.jsonl`, `.ndjson`, `.json`: field
`text`, or `--text-field`), `.parquet`, `.arrow`, and directories written by
`datasets.Dataset.save_to_disk`. Hidden files and directories (`.git/`) and binary files are left
out. Nothing is read whole: each format streams (an `IterableDataset` sharded by file), so a 10 GB
corpus needs neither 10 GB of memory nor a pass over it before the first micro-batch.

A file that cannot be used at all (unreadable, not JSON from its first line, a parquet without the
field as a string column) is one CorpusError naming it. A bad document further in (a broken JSON
line, a line without the field, a null) is skipped and counted, and the first few are logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from peer.data.corpus import CorpusError, is_text

logger = logging.getLogger(__name__)
JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
DOCUMENT_CHARS = 1 << 20  # a longer text file is cut into documents of about this many characters, at lines
SAID_PER_FILE = 3  # bad documents logged per file (all are counted)


@dataclass
class DataFiles:
    """The files of `--data`, by format."""

    root: Path
    text: list[Path] = field(default_factory=list)
    json: list[Path] = field(default_factory=list)
    parquet: list[Path] = field(default_factory=list)
    arrow: list[Path] = field(default_factory=list)
    saved: list[Path] = field(default_factory=list)  # datasets.save_to_disk directories
    binary: int = 0  # files left out as binary

    def all(self) -> list[Path]:
        return [*self.text, *self.json, *self.parquet, *self.arrow, *self.saved]

    def fingerprint(self) -> str:
        """A hash of the files' names, sizes and times: a saved stream position holds only for the same data."""
        h = hashlib.sha256()
        for path in sorted(self.all()):
            stat = path.stat()
            h.update(f"{path.relative_to(self.root)}:{stat.st_size}:{int(stat.st_mtime)}\n".encode())
        return h.hexdigest()[:16]

    def describe(self) -> str:
        kinds = [(len(self.text), "text"), (len(self.json), "JSON lines"), (len(self.parquet), "parquet")]
        kinds += [(len(self.arrow), "arrow"), (len(self.saved), "saved dataset")]
        said = ", ".join(f"{n} {kind}" for n, kind in kinds if n)
        return said + (f"; {self.binary} binary left out" if self.binary else "")


def is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() and (path / "state.json").is_file()


def find_files(path: str, leave_out: set[Path] = frozenset()) -> DataFiles:
    """The data files under `path` (a file or a directory), by format; CorpusError when there are none."""
    where = Path(path)
    if not where.exists():
        raise CorpusError(f"data {path}: no such file or directory")
    files = DataFiles(where if where.is_dir() else where.parent)
    if (where.is_file() or is_saved_dataset(where)) and where.resolve() not in leave_out:
        _add(files, where)
    for dirpath, dirnames, filenames in os.walk(where) if where.is_dir() and not is_saved_dataset(where) else ():
        here = Path(dirpath)
        kept = [d for d in dirnames if not d.startswith(".") and (here / d).resolve() not in leave_out]
        saved = sorted(d for d in kept if is_saved_dataset(here / d))
        files.saved += [here / d for d in saved]
        dirnames[:] = sorted(d for d in kept if d not in saved)
        for name in sorted(filenames):
            if not name.startswith(".") and (here / name).resolve() not in leave_out:
                _add(files, here / name)
    if not files.all():
        raise CorpusError(f"data {path}: no text, JSON lines, parquet, arrow or saved dataset files there")
    return files


def _add(files: DataFiles, path: Path) -> None:
    suffix = path.suffix.lower()
    if path.is_dir():
        files.saved.append(path)
    elif suffix in JSON_SUFFIXES:
        files.json.append(path)
    elif suffix == ".parquet":
        files.parquet.append(path)
    elif suffix == ".arrow":
        files.arrow.append(path)
    elif is_text(path):
        files.text.append(path)
    else:
        files.binary += 1


# ---- checks before any training ------------------------------------------------------------
def check_files(files: DataFiles, text_field: str) -> None:
    """CorpusError naming the first file that cannot be used at all: unreadable, not JSON lines from its
    first line on, or without `text_field` as a string column."""
    for path in files.text:
        _readable(path)
    for path in files.json:
        _check_json(path, text_field)
    for path in [*files.parquet, *files.arrow]:
        _check_columns(path, _schema(path), text_field)
    for path in files.saved:
        datasets = import_datasets()
        try:
            features = datasets.load_from_disk(str(path)).features
        except Exception as e:  # noqa: BLE001 - any failure to read is the user's to fix, in one line
            raise CorpusError(f"{path}: cannot be read as a saved dataset ({first_line(e)})") from None
        if text_field not in features or getattr(features[text_field], "dtype", "") not in ("string", "large_string"):
            raise CorpusError(
                f"{path}: no string column {text_field!r} (columns: {', '.join(features)}); see --text-field"
            )


def _readable(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise CorpusError(f"{path}: cannot be read ({e.strerror})") from None


def _check_json(path: Path, text_field: str) -> None:
    _readable(path)
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if line.lstrip().startswith("["):
                raise CorpusError(f"{path}:{number}: a JSON array; JSON lines (one object per line) are streamed")
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}:{number}: not JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                found = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise CorpusError(f"{path}:{number}: no string field {text_field!r} (found: {found}); see --text-field")
            return
    raise CorpusError(f"{path}: empty (no JSON line)")


def _schema(path: Path):
    import pyarrow as pa  # lazy: only parquet and arrow need it
    import pyarrow.parquet as pq

    try:
        if path.suffix.lower() == ".parquet":
            return pq.read_schema(path)
        with pa.memory_map(str(path)) as source:
            try:
                return pa.ipc.open_stream(source).schema
            except pa.ArrowInvalid:
                return pa.ipc.open_file(source).schema
    except (OSError, pa.ArrowException) as e:
        raise CorpusError(f"{path}: cannot be read ({first_line(e)})") from None


def _check_columns(path: Path, schema, text_field: str) -> None:
    import pyarrow as pa  # lazy: only parquet and arrow need it

    strings = [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
    if text_field not in strings:
        raise CorpusError(
            f"{path}: no string column {text_field!r} (string columns: {', '.join(strings) or 'none'}); "
            "see --text-field"
        )


def first_line(e: BaseException) -> str:
    """An exception's message in one line (its type's name when it has none)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# ---- the stream ----------------------------------------------------------------------------
def documents(files: DataFiles, text_field: str):
    """All documents of `files` as one `datasets.IterableDataset` with a column `text` (None: a bad document)."""
    datasets = import_datasets()
    features = datasets.Features({"text": datasets.Value("string")})
    parts = []
    if files.text:
        parts.append(_generated(datasets, _text_documents, files.text, features))
    if files.json:
        parts.append(_generated(datasets, _json_documents, files.json, features, text_field))
    # parquet and arrow by record batch, through our generator too: datasets' own streaming readers of them
    # sleep 5 s at the end of every pass (an arrow thread-shutdown workaround), a stall each epoch
    if files.parquet:
        parts.append(_generated(datasets, _parquet_documents, files.parquet, features, text_field))
    if files.arrow:
        parts.append(_generated(datasets, _arrow_documents, files.arrow, features, text_field))
    for path in files.saved:
        saved = datasets.load_from_disk(str(path))
        parts.append(_text_column(saved.to_iterable_dataset(num_shards=max(1, len(saved.cache_files))), text_field))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def import_datasets():
    """The `datasets` module (a second's import, so only when needed), set for local files only."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never ask the Hub: data is files on this machine
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets  # lazy: a second's import

    datasets.disable_progress_bars()
    return datasets


def _generated(datasets, generator, paths: list[Path], features, *args):
    kwargs = {"paths": [str(p) for p in paths], "args": list(args)}  # lists are sharded: one shard a file
    return datasets.IterableDataset.from_generator(generator, features=features, gen_kwargs=kwargs)


def _text_column(dataset, text_field: str):
    import datasets  # lazy: a second's import

    dataset = dataset.select_columns([text_field])
    dataset = dataset if text_field == "text" else dataset.rename_column(text_field, "text")
    return dataset.cast_column("text", datasets.Value("string"))  # large_string too: one type to concatenate


def _text_documents(paths: list[str], args: list):
    """A text file's documents: the whole file, or pieces of about DOCUMENT_CHARS cut at lines."""
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                piece, size = [], 0
                for line in f:
                    piece.append(line)
                    size += len(line)
                    if size >= DOCUMENT_CHARS:
                        yield {"text": "".join(piece)}
                        piece, size = [], 0
                if piece:
                    yield {"text": "".join(piece)}
        except OSError as e:
            logger.warning("%s: cannot be read (%s); left out", path, e.strerror)
            yield {"text": None}


def _parquet_documents(paths: list[str], args: list):
    """The text column of parquet files, a record batch at a time (nulls give None: skipped)."""
    import pyarrow.parquet as pq  # lazy: only parquet needs it

    (text_field,) = args
    for path in paths:
        try:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=[text_field]):
                yield from ({"text": text} for text in batch.column(0).to_pylist())
        except OSError as e:
            logger.warning("%s: cannot be read further (%s); the rest left out", path, first_line(e))
            yield {"text": None}


def _arrow_documents(paths: list[str], args: list):
    """The text column of arrow IPC files (stream or file format), a record batch at a time."""
    import pyarrow as pa  # lazy: only arrow files need it

    (text_field,) = args
    for path in paths:
        try:
            with pa.memory_map(path) as source:
                try:
                    reader = pa.ipc.open_stream(source)
                    batches = iter(reader)
                except pa.ArrowInvalid:
                    reader = pa.ipc.open_file(source)
                    batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
                for batch in batches:
                    yield from ({"text": text} for text in batch.column(text_field).to_pylist())
        except (OSError, pa.ArrowException) as e:
            logger.warning("%s: cannot be read further (%s); the rest left out", path, first_line(e))
            yield {"text": None}


def _json_documents(paths: list[str], args: list):
    """Each JSON line's text field; a line that is not JSON, or has no string field, gives None (skipped)."""
    (text_field,) = args
    for path in paths:
        said = 0
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    text, problem = _json_text(line, text_field)
                    if problem and said < SAID_PER_FILE:
                        said += 1
                        logger.warning("%s:%d: %s; skipped", path, number, problem)
                    yield {"text": text}
        except OSError as e:
            logger.warning("%s: cannot be read (%s); left out", path, e.strerror)
            yield {"text": None}


def _json_text(line: str, text_field: str) -> tuple[str | None, str]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e.msg})"
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        return None, f"no string field {text_field!r}"
    # a lone surrogate ("\\ud83d" in scraped JSON) is no text a tokenizer takes: replaced, as bad bytes are
    return text.encode("utf-8", "replace").decode("utf-8"), ""


def held_out(text: str, fraction: float) -> bool:
    """Whether a document belongs to the held-out fraction: by a hash of its text, the same on every peer."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 1_000_000 < fraction * 1_000_000
