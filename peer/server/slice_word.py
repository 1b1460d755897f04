"""What the members of an averaging attempt hold each other to once the averages are out (peer.server.allreduce).

Each owner signs the digest (BLAKE3) of the averaged pieces it sent: the same bytes to every member, or it signed
two digests of one slice. Each member checks the digest against the pieces it got and the signature against the
owner's peer id, and, once every verdict is in, tells every other member (its confirm) each slice's digest with its
owner's signature. A member steps only when every confirm names its own digests. Where two differ, one of two
things is proven, whoever says it: the slice's owner signed both (it sent members different averages), or the
member that sent the confirm names a digest its owner never signed (the confirm came over that member's own
authenticated call). Either way the liar is known for sure, and nobody steps the attempt."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import blake3
import grpc

from dht.identity import verify
from dht.records import AverageLie, SignedDigest
from protocols import averaging_pb2
from protocols.averaging_frames import parse_frame
from protocols.framing import FramingError

DOMAIN = b"swarmtrain/average-slice/v1\0"
NONCE_BYTES = 16  # of each member's fresh nonce per round (Contribution.nonce)


def new_digest():
    """The running digest (BLAKE3, 32 bytes) of a slice's averaged pieces, updated with each piece's bytes in order:
    every member hashes every byte it gets, so the hash's speed is averaging's cost (3.6 GB/s here against SHA-256's
    1.1)."""
    return blake3.blake3()


def statement(header, epoch: int, attempt: int, group: list[str], owner: str, nonces: list[bytes]) -> bytes:
    """What an owner signs, less the digest itself: the run, the part (`header`'s), the round, the attempt's group, the
    members' nonces for this round (in group order: the round is no other, even at the same step) and the slice. An
    honest owner signs one digest per statement: two of one statement prove it sent two averages."""
    nonce_list = ",".join(bytes(n).hex() for n in nonces)
    fields = (header.run_id, str(header.stage), header.expert, str(epoch), str(attempt), ",".join(group), nonce_list)
    return DOMAIN + "\0".join((*fields, owner)).encode() + b"\0"


def signed_by(owner: str, prefix: bytes, digest: bytes, signature: bytes) -> bool:
    return verify(owner, prefix + digest, signature)


def confirm_of(group: list[str], verdicts: dict[str, averaging_pb2.AverageVerdict]) -> averaging_pb2.Confirm:
    """Our confirm: every slice's digest and signature from its owner's verdict (ours too), in group order."""
    return averaging_pb2.Confirm(
        ok=True, digests=[verdicts[p].digest for p in group], signatures=[verdicts[p].signature for p in group]
    )


@dataclass
class Fault:
    """Why an attempt's confirms fail it: whose word, why, whether the lie is proven (left out at once), and where
    the slice's owner signed two digests, both (digest, signature) pairs: a proof anyone can check (`lie_of`)."""

    whom: str
    why: str
    proven: bool = False
    mine: tuple[bytes, bytes] | None = None
    theirs: tuple[bytes, bytes] | None = None


def confirms_failure(group: list[str], ours, confirms: dict, prefix: Callable) -> Fault | None:
    """The fault of the first of the other members' confirms (sender -> Confirm, or anything else when none came)
    that does not name our digests; None when all do. `prefix(owner)` is the statement of owner's slice. A confirm
    that says its sender does not step (its own attempt failed late, perhaps because another member lied to it alone)
    binds nobody: what we step, it does not, and any two that step have checked each other's digests. Its sender is
    not blamed for it, so a liar cannot get an honest member struck by failing that member alone."""
    missing = None  # a proven lie in a later confirm goes first: one missing must not hide it
    for sender, theirs in confirms.items():
        if isinstance(theirs, averaging_pb2.Confirm) and not theirs.ok:
            continue
        if not isinstance(theirs, averaging_pb2.Confirm):
            missing = missing or Fault(sender, f"no confirm: {getattr(theirs, 'reason', 'none')}")
            continue
        if len(theirs.digests) != len(group) or len(theirs.signatures) != len(group):
            return Fault(sender, f"{sender} confirmed {len(theirs.digests)} slices of {len(group)}", proven=True)
        for i, owner in enumerate(group):
            if theirs.digests[i] == ours.digests[i]:
                continue
            word = (theirs.digests[i], theirs.signatures[i])
            if signed_by(owner, prefix(owner), *word):
                why = f"{owner} signed two different averages of its slice (ours and {sender}'s)"
                return Fault(owner, why, True, (ours.digests[i], ours.signatures[i]), word)
            return Fault(sender, f"{sender} named an average of {owner}'s slice that {owner} never signed", True)
    return missing


def in_group_order(gathered, group: list[str]) -> bool:
    """Whether a verdict's contributions are the group's members, in group order, each with a nonce of its size:
    the statement its owner signed is then the one every member checks (and no bigger)."""
    return [c.peer_id for c in gathered] == list(group) and all(len(c.nonce) == NONCE_BYTES for c in gathered)


def lie_of(header: averaging_pb2.AverageHeader, run, nonces, fault: Fault) -> AverageLie:
    """The proof of an owner's two signed digests of one slice of `run` (an attempt), as the coordinator reads it
    (`proves_a_lie`)."""
    epoch, attempt, group = run.epoch, run.attempt, run.group
    return AverageLie(
        liar=fault.whom,
        run_id=header.run_id,
        stage=header.stage,
        expert=header.expert,
        epoch=epoch,
        attempt=attempt,
        group=list(group),
        nonces=[bytes(n).hex() for n in nonces],
        words=[SignedDigest(digest=d.hex(), signature=s.hex()) for d, s in (fault.mine, fault.theirs)],
        caught=time.time(),
    )


def proves_a_lie(lie: AverageLie, run_id: str) -> bool:
    """Whether `lie` holds two different digests of one slice of `run_id`, each signed by its owner, `lie.liar`."""
    try:
        nonces = [bytes.fromhex(n) for n in lie.nonces]
        words = [(bytes.fromhex(w.digest), bytes.fromhex(w.signature)) for w in lie.words]
    except ValueError:
        return False
    if lie.run_id != run_id or lie.liar not in lie.group or len(nonces) != len(lie.group) or words[0][0] == words[1][0]:
        return False
    header = averaging_pb2.AverageHeader(run_id=lie.run_id, stage=lie.stage, expert=lie.expert)
    prefix = statement(header, lie.epoch, lie.attempt, list(lie.group), lie.liar, nonces)
    return all(signed_by(lie.liar, prefix, digest, signature) for digest, signature in words)


async def read_confirm(call, owner: str, wait: float) -> averaging_pb2.Confirm | str:
    """`owner`'s confirm, the frame after its verdict on our call; why not, if another or none came in `wait` s."""
    try:
        frame = await asyncio.wait_for(call.read(), wait)
    except TimeoutError:
        return f"{owner}: no confirm in {wait:.1f} s"
    if frame is grpc.aio.EOF:
        return f"{owner}: the call ended without a confirm"
    try:
        kind, body = parse_frame(frame)
    except FramingError as e:
        return f"{owner}: {e}"
    return body if kind == "confirm" else f"{owner}: sent a {kind}, not its confirm"
