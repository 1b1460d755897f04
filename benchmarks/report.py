"""How every benchmark ends: its figures as one `key=value ...` line, last, whatever happened.

    from report import Figures, run  # or: from benchmarks.report import ...

    def body(args, figures: Figures) -> None:
        figures["ratio"] = ...        # fill in as the figures come; what is measured stays measured

    if __name__ == "__main__":
        run(parser, body)

`run` parses the arguments, makes SIGTERM and SIGHUP stop the benchmark as Ctrl+C does (so its
`finally` blocks stop what it started; peer.process.lifetime.interrupt_on_signals), runs `body`, and
prints the figures gathered so far as the last line with `status=ok`, `status=failed` (an
exception: its traceback goes to stderr first; exit status 1) or `status=interrupted` (exit 130).
A benchmark that is off its goal still ends with `status=ok`: its figures say how far off.

`workdir` gives a benchmark that writes logs its directory: the one the user named (kept), or a
temporary one that is removed after a run that succeeded and kept, named on stderr, after one
that did not.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

from peer.process.lifetime import interrupt_on_signals

STATUS_KEY = "status"


class Figures(dict):
    """The benchmark's figures, in the order they were set."""

    def line(self, status: str) -> str:
        return " ".join(f"{k}={_text(v)}" for k, v in {**self, STATUS_KEY: status}.items())


def _text(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace(" ", "_") or "-"


def add_quick(parser: argparse.ArgumentParser, what: str) -> None:
    """The `--quick` flag: `what` says what the small version of the comparison is."""
    parser.add_argument("--quick", action="store_true", help=f"a few-second version of the same comparison: {what}")


def add_workdir(parser: argparse.ArgumentParser, what: str = "logs") -> None:
    """The `--workdir` flag: where the benchmark keeps its `what`, or a temporary directory kept only on failure."""
    parser.add_argument(
        "--workdir", default="", help=f"keep {what} here (default: a temporary directory, kept only if the run fails)"
    )


@contextlib.contextmanager
def workdir(given: str | None, prefix: str) -> Iterator[Path]:
    """The benchmark's directory for its logs: `given` (kept), or a temporary one, kept only if the run fails."""
    if given:
        path = Path(given).resolve()
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix=prefix)).resolve()
    try:
        yield path
    except BaseException:
        print(f"logs kept in {path}", file=sys.stderr)
        raise
    shutil.rmtree(path, ignore_errors=True)


def run(parser: argparse.ArgumentParser, body: Callable[[argparse.Namespace, Figures], None]) -> None:
    args = parser.parse_args()
    interrupt_on_signals()
    figures, status, code = Figures(), "ok", 0
    try:
        body(args, figures)
    except KeyboardInterrupt:
        status, code = "interrupted", 130
    except SystemExit as e:
        if e.code not in (0, None):
            print(e.code if isinstance(e.code, str) else f"exit {e.code}", file=sys.stderr)
            status, code = "failed", e.code if isinstance(e.code, int) else 1
    except Exception:
        traceback.print_exc()
        status, code = "failed", 1
    sys.stdout.flush()
    print(figures.line(status), flush=True)
    sys.exit(code)
