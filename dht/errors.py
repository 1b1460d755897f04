"""The failures a user can act on.

A `UserError`'s message says what is wrong and where (a field, a file, an address) in one line;
the `peer` command prints it and exits with code 2, without a traceback. Everything else is a
bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input or an unusable environment: the message is for the user, in one line."""


class DHTStartError(UserError, RuntimeError):
    """The DHT node could not start or reach its initial peers; the message says what to check."""
