"""The coordinator's admission files: invite codes and revocations (RUN.invites.json, RUN.revoked.json
beside its identity key). `peer coordinator invite` / `revoke` write them, the running coordinator
(peer.coordinator.authority) re-reads them; this module imports nothing heavy, so those commands answer at once.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import time
from pathlib import Path

from dht.identity import Identity, default_identity_path
from peer.config import RunSpec

PEER_ROLES = ("server", "experts", "trainer", "relay")  # what a joining peer may ask for (not coordinator)


def beside_key(configured: str, identity: Identity, spec: RunSpec, suffix: str) -> Path:
    """A coordinator's file: `configured`, or RUN.SUFFIX beside its identity key."""
    if configured:
        return Path(configured)
    return Path(identity.path or ".").resolve().parent / f"{spec.name}.{suffix}"


def admission_notice(spec: RunSpec, identity: Identity) -> list[str]:
    """What a coordinator says of its admission when it starts: who may join, and how to invite (or a warning)."""
    mode = spec.admission.mode
    how = {
        "open": "anyone who asks",
        "allowlist": f"the {len(spec.admission.allowlist)} peer(s) of admission.allowlist",
        "invite": "peers with an invite code",
    }[mode]
    lines = [f"Admission: {mode} ({how}); every peer needs a credential from this coordinator."]
    default = not identity.path or Path(identity.path).resolve() == default_identity_path().resolve()
    key = "" if default else f" --identity {identity.path}"
    if mode == "invite":
        lines.append(
            f"Invite peers with: peer coordinator invite --spec RUN_SPEC{key} [--uses N] "
            "(it prints the code each passes to peer join with --invite)"
        )
    if mode == "open":
        lines.append(
            "Open admission: any stranger who joins is admitted, and one hostile peer can still stall or skew some "
            "steps (docs/security.md, what is not defended); for a run strangers may join, use admission.mode = "
            "invite (the default)."
        )
    return lines


def invites_file(identity: Identity, spec: RunSpec) -> Path:
    return beside_key("", identity, spec, "invites.json")


def revoked_file(identity: Identity, spec: RunSpec) -> Path:
    return beside_key("", identity, spec, "revoked.json")


# ---- the files `peer coordinator invite` and `revoke` write -----------------------------------
def locked_update(path: Path, change) -> dict:
    """Read-modify-write a JSON file under a lock (the CLI and the coordinator both write it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = read_json(path)
        change(data)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
        return data


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


MAX_INVITE_USES = 10_000  # peers one code may admit (`peer coordinator invite --uses`)


def create_invite(path: Path, roles: list[str], valid_hours: float, uses: int = 1) -> str:
    """A new invite code `ID.SECRET` that admits up to `uses` peers (each its own key), stored in `path`."""
    bad = [r for r in roles if r not in PEER_ROLES]
    if not roles or bad:
        raise ValueError(f"--roles: must be some of {', '.join(PEER_ROLES)}, got {roles}")
    if not 1 <= uses <= MAX_INVITE_USES:
        raise ValueError(f"--uses: must be 1 to {MAX_INVITE_USES}, got {uses}")
    secret, made = secrets.token_urlsafe(18), []
    entry = {"secret": secret, "roles": roles, "uses": uses, "created": time.time()}
    entry["expires"] = time.time() + valid_hours * 3600

    def add(data):
        invites = data.setdefault("invites", {})
        invite_id = secrets.token_hex(4)
        while invite_id in invites:  # an id taken already: another (never an earlier code overwritten)
            invite_id = secrets.token_hex(4)
        invites[invite_id] = entry
        made.append(invite_id)

    locked_update(path, add)
    return f"{made[0]}.{secret}"


def invite_takers(entry: dict) -> list[str]:
    """The peer ids an invite admitted so far (a code of one use kept one id as a string)."""
    taken = entry.get("used_by")
    return [taken] if isinstance(taken, str) else [t for t in taken or [] if isinstance(t, str)]


def invite_taken(entry: dict, invite_id: str) -> str:
    """Why an invite admits no new peer ("" if it does): all its uses taken, or expired."""
    uses = entry.get("uses", 1)
    if len(invite_takers(entry)) >= uses:
        return f"invite {invite_id} was used already" + (f" (by {uses} peers)" if uses > 1 else "")
    if time.time() > entry.get("expires", 0):
        return f"invite {invite_id} expired"  # (a peer it admitted keeps renewing)
    return ""


def take_invite(path: Path, invite_id: str, peer_id: str) -> str:
    """Bind one more peer to an invite, under the file's lock (two joiners may race for its last use); why not
    ("" once `peer_id` is one of its takers)."""
    why = []

    def change(data):
        entry = data.get("invites", {}).get(invite_id)
        if not isinstance(entry, dict):
            why.append(f"invite {invite_id} is no longer valid")  # taken out of the file meanwhile
        elif peer_id not in invite_takers(entry):
            if problem := invite_taken(entry, invite_id):
                why.append(problem)
            else:
                entry["used_by"] = [*invite_takers(entry), peer_id]

    locked_update(path, change)
    return why[0] if why else ""


def pardon(path: Path, peer_id: str) -> bool:
    """Take `peer_id` off the revocation file (the run owner's appeal); False if it was not there. Spot checks it
    failed before now no longer count toward revoking it again."""
    removed = []

    def change(data):
        if data.setdefault("revoked", {}).pop(peer_id, None) is not None:
            removed.append(peer_id)
        data.setdefault("pardoned", {})[peer_id] = time.time()

    locked_update(path, change)
    return bool(removed)


def revoke(path: Path, peer_id: str, reason: str) -> bool:
    """Add `peer_id` to the revocation file; False if it was there already."""
    added = []

    def change(data):
        revoked = data.setdefault("revoked", {})
        if peer_id not in revoked:
            revoked[peer_id] = {"reason": reason, "time": time.time()}
            added.append(peer_id)

    locked_update(path, change)
    return bool(added)
