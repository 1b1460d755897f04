"""An averaging owner that sends members different averages of its slice (peer.server.slice_word): members step only
when every other member's confirm names their digests, so an owner's two signed digests are caught and nobody steps
apart. Before, the members stepped different means under one step number, and the replicas' weights split for good
(spot checks then found two honest replicas answering differently)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_averaging import SPEC, _averagers, _three_rounds

from dht.records import LieProofs, SignedDigest
from peer.config import RunSpec
from peer.server.slice_word import new_digest, proves_a_lie, statement
from protocols import averaging_pb2
from protocols.averaging_frames import message_frame, parse_frame, piece_frame


def _equivocating_owner(member, victim: str, how: str):
    """`member`'s owner side sends `victim` other averages of its slice (each value + 1), with a verdict that signs
    their digest ("signed"), or with the digest of what it sent the others ("unsigned"): the lie of its verdict is
    then seen at once. `victim`'s confirm to the others is honest: it is what `victim` got."""
    allreduce = member.averager.allreduce
    honest = allreduce.serve

    async def serve(header, frames, caller):
        lying = header.sender.peer_id == victim
        digest = new_digest()
        async for frame in honest(header, frames, caller):
            kind, body = parse_frame(frame)
            if lying and kind == "piece":
                values = allreduce.codec.decode(body, len(body) // 4) + 1.0
                encoded = allreduce.codec.encode(values)
                digest.update(encoded)
                frame = piece_frame(encoded)
            elif lying and kind == "verdict" and body.ok and how == "signed":
                nonces = [c.nonce for c in body.gathered]
                group, me = list(header.group), member.peer_id
                prefix = statement(allreduce.header_base, header.epoch, header.attempt, group, me, nonces)
                body.digest = digest.digest()
                body.signature = member.identity.sign(prefix + body.digest)
                frame = message_frame(averaging_pb2.AverageFrame(verdict=body))
            yield frame

    allreduce.serve = serve


@pytest.mark.parametrize("how", ["signed", "unsigned"])
def test_an_owner_that_sends_members_different_averages_is_caught_and_nobody_steps_apart(how):
    """Member 2 owns a slice and sends member 1 other averages of it than member 0. With its signature on both
    ("signed"), members 0 and 1 see two digests it signed in each other's confirms: neither steps, and both leave it
    out at once. Without ("unsigned"), member 1 finds its verdict's digest is not that of the pieces it got and does
    not step. Either way the next round of members 0 and 1 steps without it, bit-equal."""
    spec = RunSpec.from_dict(SPEC)
    with _averagers(3, spec) as (members, servers):
        ids = [pid for pid, _ in members]
        _equivocating_owner(servers[2], ids[1], how)
        results = _three_rounds(members, 3)
        # nobody honest steps an average apart: with two signed digests neither steps; member 1, which got pieces
        # its owner's verdict does not name, does not step (member 0 may step the average it and owner 2's verdict
        # agree on, if member 1's slice was out when it found the lie: which comes first is a race)
        assert results[1] is None and (how == "unsigned" or results[0] is None), results
        if how == "signed":
            assert all(a.allreduce.failures.left_out(ids[2]) for _, a in members[:2])  # proven: out at once
            _check_proofs([a.allreduce.proofs for _, a in members[:2]], ids[2])
        assert all(not a.allreduce.failures.left_out(ids[j]) for j, (_, a) in enumerate(members[:2]) for j in (0, 1))
        expected = [[p for p in ids if not a.allreduce.failures.left_out(p)] for _, a in members[:2]] + [ids]
        if how == "unsigned":
            expected = [ids[:2], ids[:2], ids]
        results = _three_rounds(members, 4, expected=expected)
    assert results[0] is not None and results[1] is not None, results
    assert results[0].members == results[1].members == ids[:2]
    assert torch.equal(results[0].gradients[0], results[1].gradients[0])
    assert torch.equal(results[0].gradients[0], torch.full((300,), 2.0))


def _check_proofs(kept, liar: str) -> None:
    """Each honest member kept a proof the coordinator accepts (its two signatures), and nothing else passes as one:
    another run, one digest twice, a signature changed, another peer named, bad hex, a round's nonces changed."""
    assert all(len(proofs) == 1 for proofs in kept), kept
    lie = kept[0][0]
    assert lie.liar == liar and proves_a_lie(lie, "test") and proves_a_lie(kept[1][0], "test")
    assert LieProofs.model_validate_json(LieProofs(proofs=[lie]).model_dump_json()).proofs[0] == lie
    one_digest = [lie.words[0], lie.words[0]]
    other_signature = [lie.words[0], SignedDigest(digest=lie.words[1].digest, signature=lie.words[0].signature)]
    for change in (
        {"run_id": "other"},
        {"words": one_digest},
        {"words": other_signature},
        {"liar": lie.group[0]},
        {"nonces": [n[::-1] for n in lie.nonces]},
        {"nonces": ["zz"] * len(lie.nonces)},
        {"epoch": lie.epoch + 1},
    ):
        assert not proves_a_lie(lie.model_copy(update=change), "test"), change
    with pytest.raises(ValueError):
        LieProofs(proofs=[lie] * 17)  # at most 16 a record: what the coordinator checks is bounded


def test_a_member_whose_confirm_names_a_digest_never_signed_is_caught():
    """Member 2 tells the others (its confirm) a digest of member 0's slice that member 0 never signed: a lie only
    member 2 can have told (the confirm came on its own call). Nobody steps the attempt; members 0 and 1 leave member
    2 out at once, and step without it."""
    spec = RunSpec.from_dict(SPEC)
    with _averagers(3, spec) as (members, servers):
        ids = [pid for pid, _ in members]
        allreduce = servers[2].averager.allreduce
        honest = allreduce.serve

        async def serve(header, frames, caller):
            async for frame in honest(header, frames, caller):
                kind, body = parse_frame(frame)
                if kind == "confirm" and body.ok:
                    body.digests[0] = bytes(32)
                    frame = message_frame(averaging_pb2.AverageFrame(confirm=body))
                yield frame

        allreduce.serve = serve
        results = _three_rounds(members, 3)
        assert results[0] is None and results[1] is None, results
        assert all(a.allreduce.failures.left_out(ids[2]) for _, a in members[:2])
        assert not any(a.allreduce.proofs for _, a in members)  # its word on its own call: nothing anyone can check
        results = _three_rounds(members, 4, expected=[ids[:2], ids[:2], ids])
    assert results[0] is not None and results[1] is not None, results
    assert torch.equal(results[0].gradients[0], results[1].gradients[0])


def test_an_owner_s_signature_from_an_earlier_round_at_the_same_step_frames_nobody():
    """A round at step 3 ends, then another round at step 3 runs (the first one's mean was refused, say), with
    other gradients. Member 2 names in its confirm what owner 0 signed in the first round: without the members'
    nonces in what owners sign, that signature would hold for the second round's statement too, and members would
    leave the honest owner 0 out as a proven liar. The nonces make it another statement: member 2 is the liar."""
    spec = RunSpec.from_dict(SPEC)
    with _averagers(3, spec) as (members, servers):
        ids = [pid for pid, _ in members]
        allreduce, honest, seen = servers[2].averager.allreduce, servers[2].averager.allreduce.serve, []

        async def serve(header, frames, caller):
            async for frame in honest(header, frames, caller):
                kind, body = parse_frame(frame)
                if kind == "confirm" and body.ok:
                    if not seen:
                        seen.append((body.digests[0], body.signatures[0]))  # owner 0's word, first round
                    else:
                        body.digests[0], body.signatures[0] = seen[0]
                        frame = message_frame(averaging_pb2.AverageFrame(confirm=body))
                yield frame

        allreduce.serve = serve
        assert all(r is not None for r in _three_rounds(members, 3))
        for _, a in members:
            a.unstep(3)  # as if its mean were refused: the next round at step 3 is a new one
        results = _three_rounds(members, 3, values=(2.0, 4.0, 6.0))
        assert results[0] is None and results[1] is None, results
        assert all(a.allreduce.failures.left_out(ids[2]) for _, a in members[:2])
        assert not any(a.allreduce.failures.left_out(ids[0]) for _, a in members[1:])


def _rewriting_owner(member, rewrite):
    """`member`'s owner side passes every frame through `rewrite(header, kind, body)`, which returns the frame."""
    allreduce = member.averager.allreduce
    honest = allreduce.serve

    async def serve(header, frames, caller):
        async for frame in honest(header, frames, caller):
            kind, body = parse_frame(frame)
            yield rewrite(header, kind, body) or frame

    allreduce.serve = serve


def test_a_verdict_signed_over_another_order_of_the_members_frames_nobody():
    """Owner 2 signs, for member 1 alone, a statement with the members' contributions in another order (a digest
    that checks under that order and under no other). Had member 1 taken it, members 0 and 1 would each have found a
    digest in the other's confirm that its owner never signed under the group's order, and left each other out as
    proven liars. A verdict whose contributions are not the group's, in its order, is refused as it comes: owner 2 is
    the one lost, nobody honest is left out, and no proof is made. Whether member 1 then gives the round up or goes
    on with member 0 alone is a race (had its own slice been averaged when the verdict came?): if it steps, it
    steps what member 0 steps, the mean of the two honest members' gradients."""
    spec = RunSpec.from_dict(SPEC)
    with _averagers(3, spec) as (members, servers):
        ids = [pid for pid, _ in members]
        owner = servers[2]

        def reorder(header, kind, body):
            if kind != "verdict" or not body.ok or header.sender.peer_id != ids[1]:
                return None
            gathered = list(body.gathered)[::-1]
            del body.gathered[:]
            body.gathered.extend(gathered)
            nonces, group = [c.nonce for c in gathered], list(header.group)
            prefix = statement(
                owner.averager.allreduce.header_base, header.epoch, header.attempt, group, ids[2], nonces
            )
            body.signature = owner.identity.sign(prefix + body.digest)
            return message_frame(averaging_pb2.AverageFrame(verdict=body))

        _rewriting_owner(owner, reorder)
        results = _three_rounds(members, 3)
        if results[1] is not None:  # it lost owner 2 before its own slice went out: on with member 0, without it
            assert results[0] is not None and torch.equal(results[0].gradients[0], results[1].gradients[0]), results
            assert torch.equal(results[1].gradients[0], torch.full((300,), 2.0)), results
        assert not any(a.allreduce.failures.left_out(ids[j]) for _, a in members[:2] for j in (0, 1))
        assert not any(a.allreduce.proofs for _, a in members)


def test_a_member_that_says_it_does_not_step_holds_nobody_back_and_is_not_struck():
    """Member 2's confirm says it does not step (what an honest member says when a liar failed its attempt alone,
    after its slice went out). It binds nobody: members 0 and 1, whose confirms agree, step the same average; nobody is
    counted a false word for it."""
    spec = RunSpec.from_dict(SPEC)
    with _averagers(3, spec) as (members, servers):
        ids = [pid for pid, _ in members]

        def not_stepping(header, kind, body):
            if kind == "confirm":
                return message_frame(averaging_pb2.AverageFrame(confirm=averaging_pb2.Confirm(ok=False, reason="x")))
            return None

        _rewriting_owner(servers[2], not_stepping)
        results = _three_rounds(members, 3)
        assert results[0] is not None and results[1] is not None, results
        assert torch.equal(results[0].gradients[0], results[1].gradients[0])
        for _, a in members[:2]:
            a.allreduce.failures.check({ids[2]: 3}, 3)  # at the step it did not take: no false word
            assert not a.allreduce.failures._failed, a.allreduce.failures._failed


def test_a_member_that_told_others_it_does_not_step_does_not_step():
    """Owner 2 holds its averages back until members 0 and 1 have told each other that they do not step (their own
    sides had not every verdict within 3 read timeouts), then sends member 1 other averages than member 0, each with
    its signature, and names to each, in its confirm, the digest that one got. Members 0 and 1 skipped each other's
    digests on the word that neither steps, so both must keep that word: before, both stepped, apart."""
    spec = RunSpec.from_dict(SPEC)  # read_timeout 1 s: a confirm waits 3 s; a first piece is awaited 4 s
    with _averagers(3, spec) as (members, servers):
        ids = [pid for pid, _ in members]
        member = servers[2]
        allreduce, honest = member.averager.allreduce, member.averager.allreduce.serve

        async def serve(header, frames, caller):
            lying, digest, first, prefix = header.sender.peer_id == ids[1], new_digest(), True, None
            async for frame in honest(header, frames, caller):
                kind, body = parse_frame(frame)
                if kind == "piece" and first:
                    first = False
                    await asyncio.sleep(3.4)  # past the others' confirms, within their wait for our first piece
                if lying and kind == "piece":
                    encoded = allreduce.codec.encode(allreduce.codec.decode(body, len(body) // 4) + 1.0)
                    digest.update(encoded)
                    frame = piece_frame(encoded)
                elif lying and kind == "verdict" and body.ok:
                    nonces, group = [c.nonce for c in body.gathered], list(header.group)
                    prefix = statement(allreduce.header_base, header.epoch, header.attempt, group, ids[2], nonces)
                    body.digest, body.signature = digest.digest(), member.identity.sign(prefix + digest.digest())
                    frame = message_frame(averaging_pb2.AverageFrame(verdict=body))
                elif lying and kind == "confirm" and body.ok and prefix is not None:
                    body.digests[2], body.signatures[2] = (
                        digest.digest(),
                        member.identity.sign(prefix + digest.digest()),
                    )
                    frame = message_frame(averaging_pb2.AverageFrame(confirm=body))
                yield frame

        allreduce.serve = serve
        results = _three_rounds(members, 3)
    assert results[0] is None and results[1] is None, results
