"""The software's version, as peers announce it in their records and checkpoints carry it."""

from __future__ import annotations

import functools
from importlib import metadata

DISTRIBUTION = "swarmtrain"


@functools.cache  # it cannot change while the process runs, and asking importlib takes milliseconds
def software_version() -> str:
    """The installed distribution's version; "unknown" when run from a source tree that was never installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"
