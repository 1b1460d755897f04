"""The software's version, as peers announce it in their records and checkpoints carry it."""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "swarmtrain"


def software_version() -> str:
    """The installed distribution's version; "unknown" when run from a source tree that was never installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"
