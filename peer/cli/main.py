"""The `peer` command: parse, start the reaper for long-running commands, run the command, one line per error.

Startup is short on purpose: this module and peer.cli.parser import neither torch nor hivemind, so
`peer --help` answers at once; each command (peer.cli.commands) imports what it needs when it runs.
Every failure the user can act on (dht.errors.UserError) is one line on stderr and exit code 2."""

from __future__ import annotations

import logging
import multiprocessing as mp
import sys

from dht.errors import UserError
from peer.cli.commands import COMMANDS
from peer.cli.parser import build_parser, normalize_argv
from peer.config import ConfigError
from peer.process.grpc_env import tune_grpc
from peer.process.lifetime import start_reaper
from peer.process.status_lines import show_status_lines

LONG_RUNNING = ("coordinator", "join", "demo", "status")  # commands whose children the reaper watches


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("peer").setLevel(logging.INFO)
    show_status_lines()  # the runtime's status lines (peer.process.status_lines) on stdout, bare


def main(argv: list[str] | None = None) -> int:
    tune_grpc()  # before anything imports grpc (the commands do)
    args = build_parser().parse_args(normalize_argv(sys.argv[1:] if argv is None else argv))
    if args.command in LONG_RUNNING:
        start_reaper()  # before any child process: everything this command starts ends with it
        mp.set_start_method("fork", force=True)  # hivemind needs fork; gRPC objects are created after its processes
    _setup_logging(args.verbose)
    try:
        return COMMANDS[args.command](args) or 0
    except ConfigError as e:
        print(f"peer {args.command}: configuration error: {e}", file=sys.stderr)
        return 2
    except UserError as e:
        print(f"peer {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        if e.filename is None:
            raise
        print(f"peer {args.command}: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
