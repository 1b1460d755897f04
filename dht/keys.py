"""Every DHT key and subkey format Swarmtrain uses, in one place."""

from __future__ import annotations

SIGNED_SUBKEY_PREFIX = "swt:"  # subkeys of signed records: this prefix, then the owner's peer id


def signed_subkey(peer_id: str) -> str:
    return SIGNED_SUBKEY_PREFIX + peer_id


def owner_of_subkey(subkey: object) -> str | None:
    """The peer id a signed subkey names, or None when the subkey is not one of ours."""
    if isinstance(subkey, str) and subkey.startswith(SIGNED_SUBKEY_PREFIX):
        return subkey[len(SIGNED_SUBKEY_PREFIX) :]
    return None


def kind_of(key: str) -> str:
    """A key's kind, without the run, coordinator, peer, stage or expert it names: "stage/servers",
    "admission/revoked", "spec" (what DHT traffic is counted by)."""
    parts = key.split("/")
    if parts[:2] == ["swarmtrain", "coordinator"]:
        return "/".join(parts[3:])
    if parts[:2] == ["swarmtrain", "run"]:
        named = {"stage": 1, "expert": 1, "peer": 1}  # these are followed by what they name
        kept, skip = [], 0
        for part in parts[3:]:
            if skip:
                skip -= 1
                continue
            kept.append(part)
            skip = named.get(part, 0)
        return "/".join(kept)
    return "other"


def spec_key(coordinator_peer_id: str) -> str:
    """The run spec a coordinator publishes (one subkey: the coordinator's own)."""
    return f"swarmtrain/coordinator/{coordinator_peer_id}/spec"


def servers_key(run_id: str, stage: int) -> str:
    """Announcements of the servers of one stage, a subkey per server."""
    return f"swarmtrain/run/{run_id}/stage/{stage}/servers"


def expert_key(run_id: str, expert: str) -> str:
    """Announcements of the hosts of one expert ("layer.index"), a subkey per host."""
    return f"swarmtrain/run/{run_id}/expert/{expert}/servers"


def trainers_key(run_id: str) -> str:
    """Announcements of the run's trainers, a subkey per trainer."""
    return f"swarmtrain/run/{run_id}/trainers"


def books_key(run_id: str) -> str:
    """The coordinator's books of the run: samples the trainers completed against what each stage accounts."""
    return f"swarmtrain/run/{run_id}/books"


def relays_key(run_id: str) -> str:
    """Offers of peers that relay for unreachable ones (peer.net.relay), a subkey per relay."""
    return f"swarmtrain/run/{run_id}/relays"


def credential_requests_key(run_id: str) -> str:
    """Peers' requests for a credential (signed by the requester, who is not admitted yet), a subkey each."""
    return f"swarmtrain/run/{run_id}/admission/requests"


def credential_key(run_id: str, peer_id: str) -> str:
    """The coordinator's answer to one peer's credential request (its certificate, or why not)."""
    return f"swarmtrain/run/{run_id}/admission/peer/{peer_id}"


def revocations_key(run_id: str) -> str:
    """The coordinator's list of revoked peers."""
    return f"swarmtrain/run/{run_id}/admission/revoked"


def proofs_key(run_id: str) -> str:
    """Replicas' proofs that a partner signed two different averages of one slice (dht.records.LieProofs), a subkey
    per replica."""
    return f"swarmtrain/run/{run_id}/admission/proofs"


def reports_key(run_id: str) -> str:
    """Trainers' reports of servers whose answers their spot checks found wrong, a subkey per trainer."""
    return f"swarmtrain/run/{run_id}/admission/reports"
