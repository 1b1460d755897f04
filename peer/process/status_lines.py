"""What a peer tells the person who started it: plain lines on its standard output ("Serving stage 0 at ...").

Library modules say them with `say`, through the logger STATUS_LOGGER, never with print(). The `peer`
command (peer.cli.main) sends that logger's records to stdout as bare lines, in order with its own;
the demo, the benchmarks and the tests read them there. Without that setup (a module used from
Python), they are ordinary INFO records of that logger.
"""

from __future__ import annotations

import logging
import sys

STATUS_LOGGER = "peer.status_lines"


def say(message: str) -> None:
    """One status line for the person watching this peer."""
    logging.getLogger(STATUS_LOGGER).info(message)


def show_status_lines(stream=None) -> logging.Handler:
    """Send status lines to `stream` (default: this process's stdout now) as bare lines, instead of wherever
    an earlier call sent them; the handler."""
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    lines = logging.getLogger(STATUS_LOGGER)
    for old in list(lines.handlers):
        lines.removeHandler(old)
    lines.addHandler(handler)
    lines.setLevel(logging.INFO)
    lines.propagate = False  # not again, dated, through the root's handler on stderr
    return handler
