"""Rounds of the replicas' own all-reduce (peer.server.allreduce): real gRPC servers and calls on loopback, the
members in one test process (tests/test_allreduce_faults.py runs them as processes and kills them).

Replicas of one part that expect different groups never step apart: every member that steps holds the same
average from the same members; a member that sends poison or the wrong size is left out; a member that dies
mid-round is gone from the step, and the survivors step without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from dht.identity import Identity
from peer.config import RunSpec
from peer.net.client import StageClient
from peer.server.averaging import GradientAverager
from peer.server.robust import aggregate, fixed_weights
from protocols import averaging_pb2
from protocols.averaging_frames import first_header
from protocols.failures import Reason

SPEC = {"averaging": {"request_timeout": 0.5, "averaging_timeout": 6.0, "group_timeout": 2.0, "read_timeout": 1.0}}


class _Member:
    """One replica's averager with its own gRPC server (the Averaging service alone) on the shared loop."""

    def __init__(self, averager: GradientAverager, identity: Identity):
        self.averager, self.identity, self.server, self.endpoint = averager, identity, None, ""
        self.peer_id = identity.peer_id

    async def Average(self, frames, context):
        header = await first_header(frames, 5.0)
        async for frame in self.averager.allreduce.serve(header, frames, ""):
            yield frame

    async def start(self) -> None:
        self.server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(self.Average)
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("swarmtrain.Averaging", {"Average": handler}),)
        )
        self.endpoint = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()


@contextlib.contextmanager
def _averagers(count: int, spec: RunSpec):
    """`count` replicas of one part: (peer id, averager) each, served on loopback; all stopped afterwards."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    identities = sorted((Identity.generate() for _ in range(count)), key=lambda identity: identity.peer_id)
    members = [_Member(GradientAverager(spec), identity) for identity in identities]  # member i owns slice i
    endpoints = {}
    try:
        for m in members:
            asyncio.run_coroutine_threadsafe(m.start(), loop).result(10)
            endpoints[m.peer_id] = m.endpoint
        for m in members:
            client = StageClient(1 << 20, 1 << 28)
            header = averaging_pb2.AverageHeader(run_id="test")
            m.averager.allreduce.bind(
                loop, client, m.identity, endpoints.get, header, lambda: _EPOCH[0], lambda p: True
            )
            m.averager.loop = loop
        yield [(m.peer_id, m.averager) for m in members], members
    finally:
        for m in members:
            if m.server is not None:
                asyncio.run_coroutine_threadsafe(m.server.stop(0), loop).result(10)
            m.averager.shutdown()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


_EPOCH = [0]  # the epoch every test member is at (the replica's runtime epoch, in a real peer)


@pytest.fixture(scope="module", params=["mean", "median"])
def replicas(request):
    """Three replicas of one part; each aggregate in turn."""
    spec = RunSpec.from_dict({"averaging": {**SPEC["averaging"], "aggregate": request.param}})
    with _averagers(3, spec) as (r, _):
        yield r


def _rounds(replicas, epoch: int, expectations: list[list[int]], values=(0.0, 1.0, 2.0), samples=(1, 2, 3)):
    """Each replica i runs one round at `epoch` expecting replicas `expectations[i]`, all at once (each on a thread
    of its own, as a replica's round thread), with gradients of `values[i]` everywhere from `samples[i]` samples."""
    ids = [pid for pid, _ in replicas]
    _EPOCH[0] = epoch
    with ThreadPoolExecutor(len(replicas)) as pool:
        futures = [
            pool.submit(
                averager.average,
                [torch.full((64,), float(values[i])), torch.full((8, 8), float(values[i]))],
                samples[i],  # the mean is weighted by them
                epoch,
                [ids[j] for j in expectations[i]],
            )
            for i, (_, averager) in enumerate(replicas)
        ]
        return [f.result(timeout=60) for f in futures]


def _agree(results) -> None:
    """Every member that stepped holds the same average from the same members."""
    stepped = [r for r in results if r is not None]
    for r in stepped[1:]:
        assert r.members == stepped[0].members
        assert all(torch.equal(a, b) for a, b in zip(r.gradients, stepped[0].gradients, strict=True))


def _aggregate(replicas) -> str:
    return replicas[0][1].cfg.aggregate


def test_a_whole_group_averages_by_samples(replicas):
    results = _rounds(replicas, 1, [[0, 1, 2]] * 3)
    assert all(r is not None for r in results), results
    mean = (0 * 1 + 1 * 2 + 2 * 3) / 6 if _aggregate(replicas) == "mean" else 1.0  # the median counts each once
    for r in results:
        assert r.group_size == 3 and r.group_samples == 6
        assert sorted(r.members) == sorted(pid for pid, _ in replicas)
        assert torch.allclose(r.gradients[0], torch.full((64,), mean))
        assert torch.allclose(r.gradients[1], torch.full((8, 8), mean))


def test_a_member_that_claims_many_samples_weighs_a_capped_claim_and_moves_the_median_not_at_all(replicas):
    """Replica 2 sends 40 everywhere (within the norm check's bound) and claims 10^9 samples. Its weight is
    what it gathered, capped at averaging.max_weight_ratio (8) times the lower median claim: the mean is
    33.8, not 40; the median is the honest middle."""
    results = _rounds(replicas, 9, [[0, 1, 2]] * 3, values=(0.5, 1.0, 40.0), samples=(1, 2, 10**9))
    assert all(r is not None for r in results), results
    expected = (0.5 * 1 + 1.0 * 2 + 40.0 * 16) / 19 if _aggregate(replicas) == "mean" else 1.0
    for r in results:
        assert r.group_samples == 3 + 10**9  # what the members said they hold; only the weights are capped
        assert torch.allclose(r.gradients[0], torch.full((64,), expected))


def test_replicas_that_expect_different_groups_never_step_apart(replicas):
    # replica 2 missed replica 0's answer: it expects a group of 2, the others one of 3. The attempts meet in a
    # group its members agree on: {1, 2} (0 is not in 2's), or {0, 1} (0 takes 2's word that 0 is not in its group
    # as 2's alone, and goes on without 2); never two groups at one step
    ids = [pid for pid, _ in replicas]
    results = _rounds(replicas, 2, [[0, 1, 2], [0, 1, 2], [1, 2]])
    _agree(results)
    stepped = {i for i, r in enumerate(results) if r is not None}
    assert stepped in (set(), {1, 2}, {0, 1}), results
    assert all(results[i].members == [ids[j] for j in sorted(stepped)] for i in stepped)
    # and the next round, with views that agree again, averages as usual
    results = _rounds(replicas, 3, [[0, 1, 2]] * 3)
    assert all(r is not None and r.group_size == 3 for r in results), results
    _agree(results)


def test_a_group_steps_only_if_no_member_expected_someone_else(replicas):
    # 0 and 1 expect each other; 2 saw 0 join its round too and expects it: only {0, 1} may step (the group its
    # members agree on), and 2 has nobody to step with
    ids = [pid for pid, _ in replicas]
    results = _rounds(replicas, 4, [[0, 1], [0, 1], [0, 2]])
    stepped = {i for i, r in enumerate(results) if r is not None}
    assert stepped in (set(), {0, 1}), results
    _agree(results)
    for i in stepped:
        assert sorted(results[i].members) == sorted([ids[0], ids[1]])


def test_every_member_ends_with_bit_equal_averages_over_many_pieces():
    """Tensors of many pieces (a piece is 4096 elements here) and a lossy codec: each owner encodes its averaged
    pieces once and takes its own copy from the same bytes, so all members hold the very same values."""
    spec = RunSpec.from_dict(
        {"averaging": {**SPEC["averaging"], "piece_bytes": 16384}, "compression": {"averaging": "int8"}}
    )
    generator = torch.Generator().manual_seed(5)
    with _averagers(3, spec) as (members, _):
        ids = [pid for pid, _ in members]
        grads = [[torch.randn(10_000, generator=generator), torch.randn(77, 3, generator=generator)] for _ in ids]
        _EPOCH[0] = 1
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(a.average, grads[i], 1 + i, 1, ids) for i, (_, a) in enumerate(members)]
            results = [f.result(timeout=60) for f in futures]
    assert all(r is not None and r.group_size == 3 for r in results), results
    _agree(results)
    exact = [sum((1 + i) * g[k] for i, g in enumerate(grads)) / 6 for k in range(2)]
    for got, want in zip(results[0].gradients, exact, strict=True):
        assert (got - want).abs().max() < 0.05 * want.abs().max()  # int8's rounding, twice


def test_a_member_that_dies_mid_round_is_left_out_and_the_survivors_step():
    """Member 3's server is gone (refused connections): the others detect it on their first call, run the round
    again without it, and step the mean of the three, counting exactly their samples."""
    spec = RunSpec.from_dict(SPEC)
    with _averagers(4, spec) as (members, servers):
        ids = [pid for pid, _ in members]
        loop = members[0][1].loop
        asyncio.run_coroutine_threadsafe(servers[3].server.stop(0), loop).result(10)
        _EPOCH[0] = 2
        with ThreadPoolExecutor(3) as pool:
            futures = [
                pool.submit(a.average, [torch.full((300,), float(i))], 10, 2, ids)
                for i, (_, a) in enumerate(members[:3])
            ]
            results = [f.result(timeout=60) for f in futures]
    assert all(r is not None for r in results), results
    _agree(results)
    assert results[0].members == ids[:3] and results[0].group_samples == 30
    assert torch.equal(results[0].gradients[0], torch.full((300,), 1.0))


@pytest.mark.parametrize("poison", ["nan", "size"])
def test_a_member_that_sends_poison_or_the_wrong_size_is_left_out(poison):
    """Member 2 sends NaN (or claims another size of tensors): the owners leave it out and the other two step."""
    spec = RunSpec.from_dict(SPEC)
    with _averagers(3, spec) as (members, _):
        ids = [pid for pid, _ in members]
        _EPOCH[0] = 3
        grads = [[torch.full((300,), 1.0)], [torch.full((300,), 3.0)], [torch.full((300,), 5.0)]]
        if poison == "nan":
            grads[2] = [torch.full((300,), float("nan"))]
        else:
            grads[2] = [torch.full((301,), 5.0)]
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(a.average, grads[i], 1, 3, ids) for i, (_, a) in enumerate(members)]
            results = [f.result(timeout=60) for f in futures]
    assert results[0] is not None and results[1] is not None, results
    assert results[2] is None
    _agree(results)
    assert results[0].members == ids[:2] and torch.equal(results[0].gradients[0], torch.full((300,), 2.0))


def test_a_call_from_outside_the_group_or_for_another_part_is_refused():
    """An Average call whose sender is not in its own group, that names another run, or another step: a gRPC status
    with the reason of protocols.failures, before any piece is read; the owner's round is not touched."""
    from peer.net.refusal import Refused

    spec = RunSpec.from_dict(SPEC)
    with _averagers(2, spec) as (members, servers):
        allreduce, loop = members[0][1].allreduce, members[0][1].loop
        stranger = averaging_pb2.Contribution(peer_id="stranger", samples=5)

        async def serve(header):
            async for _ in allreduce.serve(header, None, ""):
                pass

        def refused(header) -> Refused:
            with pytest.raises(Refused) as e:
                asyncio.run_coroutine_threadsafe(serve(header), loop).result(10)
            return e.value

        outside = averaging_pb2.AverageHeader(run_id="test", epoch=0, group=[members[0][0]], sender=stranger)
        e = refused(outside)
        assert e.code == grpc.StatusCode.PERMISSION_DENIED and e.reason == Reason.NOT_ADMITTED
        other = averaging_pb2.AverageHeader(run_id="other", epoch=0, group=[members[0][0], "stranger"], sender=stranger)
        assert refused(other).reason == Reason.WRONG_RUN


def test_weights_are_capped_claims_and_the_robust_aggregates_ignore_a_minority():
    assert fixed_weights([1, 2, 10**9], 8) == [1, 2, 16]
    assert fixed_weights([0, 100], 8) == [0, 100]  # a member with nothing does not pull the cap to 0
    assert fixed_weights([-5, 3], 0) == [0, 3]  # no cap, but never negative
    parts = [torch.tensor([0.0, 1.0]), torch.tensor([1.0, 2.0]), torch.tensor([2.0, 3.0]), torch.tensor([1e6, -1e6])]
    weights = [1.0, 1.0, 1.0, 1.0]
    assert torch.equal(aggregate(parts, weights, "median"), torch.tensor([1.0, 1.0]))  # the lower middle
    clipped = aggregate(parts, weights, "clipped")
    assert (clipped - torch.tensor([1.0, 2.0])).abs().max() < 1.5  # the poison moved it by at most a radius
    assert torch.allclose(aggregate(parts[:3], [1.0, 2.0, 1.0], "mean"), torch.tensor([1.0, 2.0]))
    assert torch.equal(aggregate(parts, [1.0, 1.0, 1.0, 0.0], "median"), torch.tensor([1.0, 2.0]))  # 0: left out
    assert torch.allclose(aggregate(parts[2:], [1.0, 1.0], "median"), torch.tensor([5e5 + 1, -5e5 + 1.5]))
    assert torch.allclose(aggregate(parts[:2], [1.0, 3.0], "clipped"), torch.tensor([0.75, 1.75]))  # two: the mean
    broken = [*parts[:3], torch.tensor([float("nan"), 0.0])]  # a part with NaN is no honest member's: left out
    assert torch.equal(aggregate(broken, weights, "median"), torch.tensor([1.0, 2.0]))
    assert torch.isfinite(aggregate(broken, weights, "clipped")).all()


@pytest.fixture(scope="module")
def local_pair():
    """Two replicas in local mode (DiLoCo) whose pseudo-gradients travel as int4, on two DHT nodes."""
    spec = RunSpec.from_dict(
        {"averaging": {**SPEC["averaging"], "mode": "local"}, "compression": {"averaging": "int4", "block_size": 16}}
    )
    with _averagers(2, spec) as (pair, _):
        yield pair


def _local_rounds(pair, deltas, epochs) -> list[torch.Tensor]:
    """Rounds of both replicas of `pair`, each with its pseudo-gradients `deltas[i]` every time; the sum of the
    means replica 0 got."""
    ids = [pid for pid, _ in pair]
    applied = [torch.zeros_like(d) for d in deltas[0]]
    for epoch in epochs:
        _EPOCH[0] = epoch
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(averager.average, deltas[i], 10, epoch, ids) for i, (_, averager) in enumerate(pair)]
            results = [f.result(timeout=60) for f in futures]
        assert all(r is not None for r in results), results
        applied = [a + g for a, g in zip(applied, results[0].gradients, strict=True)]
    return applied


def test_local_mode_sends_what_the_codec_rounded_off_in_the_next_round(local_pair):
    """Error feedback: each replica rounds its pseudo-gradient plus what the codec rounded off last time, and keeps
    the new rounding for the next round. Both replicas bring the same pseudo-gradients here, so the mean comes back
    through the codec unchanged and only the way in is seen: 4 rounds then sum to exactly 4 x the pseudo-gradient
    less the last residual, where rounding without feedback would add up 4 times."""
    generator = torch.Generator().manual_seed(3)
    delta = [torch.randn(64, generator=generator), torch.randn(8, 8, generator=generator)]
    codec = local_pair[0][1]._codec
    applied = _local_rounds(local_pair, [delta, delta], range(1, 5))
    for _, averager in local_pair:
        assert averager.residual_epoch == 5 and any(r.abs().max() > 0 for r in averager.residual)
    residual = local_pair[0][1].residual
    for total, d, r in zip(applied, delta, residual, strict=True):
        assert torch.allclose(total, 4 * d - r, atol=1e-5), (total - (4 * d - r)).abs().max()
    # a round at an epoch the residual is not for (the replica loaded another's state meanwhile) sends none
    flat = torch.cat([d.reshape(-1) for d in delta])
    assert torch.equal(codec.roundtrip(flat)[:64], local_pair[0][1]._rounded(delta, 9)[0][0])
    # rounded the same way without feedback, the 4 rounds would have summed to 4 x the rounded delta: 4 times its
    # rounding error, where the feedback leaves one rounding's worth (the last residual)
    missed = math.sqrt(sum(float(((t - 4 * d) ** 2).sum()) for t, d in zip(applied, delta, strict=True)))
    unfed = math.sqrt(float(((4 * codec.roundtrip(flat) - 4 * flat) ** 2).sum()))
    assert missed < 0.5 * unfed, (missed, unfed)


def _judge():
    import collections
    from types import SimpleNamespace

    from peer.config.run import AveragingConfig

    return SimpleNamespace(
        cfg=AveragingConfig(),
        refused_in_a_row=0,
        refused_groups=collections.OrderedDict(),
        references=collections.deque(maxlen=16),
    )


def test_a_mean_that_is_not_finite_is_refused_whatever_its_members_claim():
    """A member that owns a slice of every round can return NaN (or Inf) for it: the group's norm is then NaN,
    which compares False with any bound, so the plausibility check refuses a norm that is not finite first,
    whatever norms the members claimed (none, or ones that would let anything in); a finite mean within the
    bound is taken."""
    from peer.server.averaging import GradientAverager

    for poison in (float("nan"), float("inf")):
        for claims in ([], [2.0, 1e30]):
            averager = _judge()
            mean = [torch.tensor([1.0, poison, 1.0, 1.0])]
            assert not GradientAverager._plausible(averager, mean, 3, ["a", "b"], claims)
            assert averager.refused_groups[4] == ["a", "b"]
    assert GradientAverager._plausible(_judge(), [torch.ones(4)], 3, ["a", "b"], [2.0, 2.0])


def test_one_member_cannot_ratchet_the_norm_bound_up_round_by_round():
    """Fourth read, finding 6: the reference was the median of the last 16 means taken, so a member that made each
    round's mean 1.5x the last was never refused (the median trails the newest by 1.5^8 = 26x, under the 100x
    bound), up to float overflow. The reference is now the lower median of the norms the members with samples
    said they sent: two honest members at norm 1 keep it at 1 whatever the third claims, and the growing mean is
    refused once it passes 100x. A round with one claimant is held to the lower median of the references its
    members stated (each from its last rounds with several and its own norms), not to its word. A claim of 0 refuses the round (as poison does); members without samples, and
    claims absent or not finite numbers >= 0, do not count."""
    from peer.server.averaging import GradientAverager, claimed_norms, stated_references
    from protocols import averaging_pb2

    averager, mean, taken = _judge(), 1.0, 0
    while GradientAverager._plausible(averager, [torch.tensor([mean])], 3, ["a", "b", "c"], [1.0, 1.0, 3 * mean]):
        mean, taken = mean * 1.5, taken + 1
        assert taken < 100, "the bound never held"
    assert 100 < mean <= 150 and averager.refused_in_a_row == 1
    # of two claimants, the lower claim: the other's huge one does not raise it
    assert not GradientAverager._plausible(_judge(), [torch.tensor([150.0])], 3, ["a", "b"], [1.0, 1e9])
    # rounds with two claimants or more add their reference to what a replica states for rounds with one
    assert len(averager.references) == taken
    assert GradientAverager.own_reference(averager) == sorted(averager.references)[taken // 2]
    # one claimant (it alone brought samples: the mean is its vector) is held to the lower median of the
    # references its members stated, not to its own word nor to each replica's own history; its round adds none
    assert not GradientAverager._plausible(averager, [torch.tensor([1e6])], 3, ["a", "b"], [1e6], [1.0, 1e9])
    assert GradientAverager._plausible(averager, [torch.tensor([50.0])], 3, ["a", "b"], [50.0], [1.0, 2.0])
    assert not GradientAverager._plausible(_judge(), [torch.tensor([160.0])], 3, ["a", "b", "c"], [1.0], [1, 1.5, 1e9])
    assert len(averager.references) == taken
    # none stated (every member has fewer than 4 references): the claim (unchecked, as a first round is)
    assert GradientAverager._plausible(_judge(), [torch.tensor([1e6])], 3, ["a", "b"], [1e6], [])
    # a replica that never averaged with two claimants holds its own norms (when it brought samples) as references
    veteran = _judge()
    for norm, samples in ((1.0, 4), (2.0, 8), (1e9, 0), (float("nan"), 4)):
        GradientAverager.remember_own(veteran, norm, samples)
    assert GradientAverager.own_reference(veteran) is None  # 2 references: too few to state one
    for norm, samples in ((1.5, 4), (1.0, 4)):
        GradientAverager.remember_own(veteran, norm, samples)
    assert list(veteran.references) == [1.0, 2.0, 1.5, 1.0]
    assert GradientAverager.own_reference(veteran) == 1.5
    gathered = [
        averaging_pb2.Contribution(peer_id=p, samples=s, norm=n)
        for p, s, n in (("a", 4, 2.0), ("b", 4, float("nan")), ("c", 0, 5.0), ("d", 4, -1.0), ("e", 4, 1e9))
    ]
    gathered.append(averaging_pb2.Contribution(peer_id="f", samples=4))  # said no norm
    assert claimed_norms(gathered) == [2.0, 1e9]
    stating = [
        averaging_pb2.Contribution(peer_id=p, reference=r) for p, r in (("a", 1.5), ("b", float("inf")), ("c", -2.0))
    ]
    assert stated_references([*stating, averaging_pb2.Contribution(peer_id="d")]) == [1.5]
    assert not GradientAverager._plausible(_judge(), [torch.tensor([1e-3])], 3, ["a", "b"], [0.0, 1.0])


def test_members_with_different_histories_judge_a_round_with_one_claimant_alike():
    """A fresh-clone CI run: of three replicas, one had stepped alone (its references were its own norms, about
    1.36) while the two others had averaged (larger ones); a round where one member alone brought samples, of norm
    138, was refused by the first and stepped by the others, and the refuser could then load nobody's state (both
    had stepped the group it refused). Now each member states its reference with its contribution and all judge
    by the lower median of the statements, the same for all."""
    from peer.server.averaging import GradientAverager

    judges = [_judge() for _ in range(3)]
    for judge, norm in zip(judges, (1.36, 150.0, 160.0), strict=True):
        for _ in range(4):
            GradientAverager.remember_own(judge, norm, 8)
    stated = [GradientAverager.own_reference(judge) for judge in judges]
    for mean, expected in ((138.0, True), (2e4, False)):
        verdicts = {
            GradientAverager._plausible(j, [torch.tensor([mean])], 3, ["a", "b", "c"], [mean], stated) for j in judges
        }
        assert verdicts == {expected}, (mean, verdicts)


def _lying_owner(member, verdict_of=None, altered=None):
    """Member `member`'s owner side lies: it answers every Average call with `verdict_of(header)` alone, or serves
    honestly and changes its ok verdicts with `altered(verdict)` (None from it: the call ends without a verdict)."""
    from protocols.averaging_frames import message_frame, parse_frame

    allreduce = member.averager.allreduce
    honest = allreduce.serve

    async def serve(header, frames, caller):
        if verdict_of is not None:
            yield message_frame(averaging_pb2.AverageFrame(verdict=verdict_of(header)))
            return
        async for frame in honest(header, frames, caller):
            kind, body = parse_frame(frame)
            if kind == "verdict" and body.ok:
                if altered(body) is None and altered is _silent:
                    return
                frame = message_frame(averaging_pb2.AverageFrame(verdict=body))
            yield frame

    allreduce.serve = serve


def _silent(verdict):
    """An owner that ends each call once it reduced (every member's slice went out) without its verdict."""


def _three_rounds(members, epoch: int, values=(1.0, 3.0, 5.0), expected=None):
    ids = [pid for pid, _ in members]
    expected = expected or [ids] * len(members)
    _EPOCH[0] = epoch
    with ThreadPoolExecutor(3) as pool:
        futures = [
            pool.submit(a.average, [torch.full((300,), values[i])], 1, epoch, expected[i])
            for i, (_, a) in enumerate(members)
        ]
        return [f.result(timeout=60) for f in futures]


@pytest.mark.parametrize("lie", ["you-are-lost", "not-your-group", "own-step", "misreported", "no-verdict"])
def test_an_owner_whose_verdict_alone_would_end_the_round_is_the_one_left_out(lie):
    """Member 2, as an owner, tells every caller it is lost, or that its group is one without the caller, or fails
    the attempt naming nobody (its own step), or reports member 0's contribution otherwise than member 0 sent it, or
    ends every call without its verdict once it reduced (after the others' slices went out, a member must give the
    round up: that owner's silence is then checked like a `stepped` word): each is its word against what the others know, so it is the one lost, and the other two step without it (before,
    a member named lost or outside the group gave its round up: one such owner froze its stage)."""
    spec = RunSpec.from_dict(SPEC)
    with _averagers(3, spec) as (members, servers):
        ids = [pid for pid, _ in members]
        verdicts = {
            "you-are-lost": lambda h: averaging_pb2.AverageVerdict(ok=False, lost=[h.sender.peer_id], reason="lost"),
            "not-your-group": lambda h: averaging_pb2.AverageVerdict(ok=False, group=[ids[2]], reason="another group"),
            "own-step": lambda h: averaging_pb2.AverageVerdict(ok=False, reason="this replica is at step 9"),
        }

        def misreport(verdict):
            for c in verdict.gathered:
                if c.peer_id == ids[0]:
                    c.samples += 7

        _lying_owner(servers[2], verdicts.get(lie), {"misreported": misreport, "no-verdict": _silent}.get(lie))
        # a member whose own slice was averaged when the lie came gives the round up (another member may hold
        # every ok verdict of it); the liar is then checked like a `stepped` word, and left out after
        # max_failed_rounds rounds in a row that it ended (its partners invite it no more: here, not expected).
        # A member whose slice was not averaged yet loses the liar and goes on, and counts nothing: which of the
        # two counts a round is a race, so both may need twice as many rounds as one
        for _ in range(2 * spec.averaging.max_failed_rounds + 1):
            expected = [[p for p in ids if not a.allreduce.failures.left_out(p)] for _, a in members[:2]] + [ids]
            results = _three_rounds(members, 4, expected=expected)
            if results[0] is not None and results[1] is not None:
                break
            for _, a in members[:2]:
                a.allreduce.failures.check({ids[2]: 4}, 4)  # it answers the next invitation at the same step
    assert results[0] is not None and results[1] is not None, results
    _agree(results[:2])
    assert results[0].members == ids[:2] and torch.equal(results[0].gradients[0], torch.full((300,), 2.0))


def test_an_owner_that_says_it_stepped_and_is_not_ahead_is_left_out_after_max_failed_rounds():
    """Member 2 answers every Average call that it already stepped the round: a member must believe it then (its
    gradients would count twice), and the round fails. At the next invitation a partner that stepped is ahead;
    one that answers at the step it claimed to have left said what was not so, and after averaging.max_failed_rounds
    such rounds in a row it is left out (peer.server.round_failures); one that is ahead is not."""
    spec = RunSpec.from_dict(SPEC)
    with _averagers(3, spec) as (members, servers):
        ids = [pid for pid, _ in members]
        failures = members[0][1].allreduce.failures
        _lying_owner(servers[2], lambda h: averaging_pb2.AverageVerdict(ok=False, stepped=True, reason="stepped"))
        for n in range(spec.averaging.max_failed_rounds + 1):
            results = _three_rounds(members, 6)
            assert results[0] is None and results[1] is None, results
            assert not failures.left_out(ids[2])
            failures.check({ids[1]: 6, ids[2]: 6 + (n == 0)}, 6)  # ahead the first time (true then), at 6 after
        assert failures.left_out(ids[2]) and not failures.left_out(ids[1])
        failures.stepped([ids[2]])  # a round that steps with it clears it
        assert not failures.left_out(ids[2])
