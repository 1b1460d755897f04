"""Rounds of real hivemind averagers (real DHT nodes, p2p daemons, all-reduce) in one test process.

Replicas of one stage that expect different groups must never step apart: a round steps only a
group that holds every replica one of its members expected, and no group outgrows what one of
its members expects (hivemind's key manager fails such a member mid-round).
"""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers.processes import hivemind_sockets, remove_stale_sockets

from dht.identity import Identity
from dht.node import SwarmDHT
from peer.config import RunSpec
from peer.server.averaging import GradientAverager, group_bits, whole_group_missing
from peer.server.hivemind_averager import round_loss
from peer.server.replica_round import MATCHMAKING_STAGGER
from peer.server.robust import aggregate, fixed_weights

SPEC = {"averaging": {"min_matchmaking_time": 1.0, "request_timeout": 0.5, "averaging_timeout": 6.0}}


@contextlib.contextmanager
def _averagers(count: int, spec: RunSpec, prefix: str):
    """`count` replicas of one part: (peer id, averager) each, on as many DHT nodes; all stopped afterwards."""
    dhts, averagers, sockets = [], [], hivemind_sockets()
    try:
        for _ in range(count):
            initial = dhts[0].visible_maddrs()[:1] if dhts else []
            dhts.append(SwarmDHT(Identity.generate(), initial, ["/ip4/127.0.0.1/tcp/0"], [], 30.0, 5.0))
        template = [torch.zeros(64), torch.zeros(8, 8)]
        averagers = [GradientAverager(dht, prefix, template, spec) for dht in dhts]
        yield [(dht.peer_id, averager) for dht, averager in zip(dhts, averagers, strict=True)]
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
        remove_stale_sockets(sockets)  # hivemind's averagers leave their client sockets in /tmp


@pytest.fixture(scope="module", params=["mean", "median"])
def replicas(request):
    """Three replicas of one part on three DHT nodes; each aggregate in turn."""
    with _averagers(
        3, RunSpec.from_dict({"averaging": {**SPEC["averaging"], "aggregate": request.param}}), "groups"
    ) as r:
        yield r


def _staggered(rank: int, fn, *args):
    """As replicas do (peer.server.replica_round.MATCHMAKING_STAGGER): entering matchmaking at one instant, two can
    each take the other for its leader."""
    time.sleep(MATCHMAKING_STAGGER * rank)
    return fn(*args)


def _rounds(replicas, epoch: int, expectations: list[list[int]], values=(0.0, 1.0, 2.0), samples=(1, 2, 3)):
    """Each replica i runs one round at `epoch` expecting replicas `expectations[i]`, all at once, with
    gradients of `values[i]` everywhere from `samples[i]` samples."""
    ids = [pid for pid, _ in replicas]
    with ThreadPoolExecutor(len(replicas)) as pool:
        futures = [
            pool.submit(
                _staggered,
                i,
                averager.average,
                [torch.full((64,), values[i]), torch.full((8, 8), values[i])],
                samples[i],  # the mean is weighted by them
                epoch,
                [ids[j] for j in expectations[i]],
            )
            for i, (_, averager) in enumerate(replicas)
        ]
        return [f.result(timeout=60) for f in futures]


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
    # replica 2 missed replica 0's answer: it expects a group of 2, the others one of 3. Before,
    # a group of 2 could form with it (and replica 1 step alone or with nobody), or replica 2
    # failed inside hivemind ("Sample larger than population") while the others stepped
    results = _rounds(replicas, 2, [[0, 1, 2], [0, 1, 2], [1, 2]])
    assert results == [None, None, None]
    # and the next round, with views that agree again, averages as usual
    results = _rounds(replicas, 3, [[0, 1, 2]] * 3)
    assert all(r is not None and r.group_size == 3 for r in results), results


def test_a_group_steps_only_if_no_member_expected_someone_else(replicas):
    # 0 and 1 expect each other; 2 saw 0 join its round too and expects it: whatever groups form,
    # only {0, 1} may step (it holds all its members expect), and 2 has nobody to step with
    ids = [pid for pid, _ in replicas]
    results = _rounds(replicas, 4, [[0, 1], [0, 1], [0, 2]])
    stepped = {i for i, r in enumerate(results) if r is not None}
    assert stepped in (set(), {0, 1}), results
    for i in stepped:
        assert sorted(results[i].members) == sorted([ids[0], ids[1]])


def test_group_keys_and_the_verdict():
    assert group_bits(5, 3) != group_bits(5, 2) and group_bits(5, 3) != group_bits(6, 3)
    assert len(group_bits(70000, 1000)) == len(group_bits(0, 2))
    infos = [{"expected": ["a", "b"]}, {"expected": ["a", "b", "c"]}]
    assert whole_group_missing(infos, ["a", "b"], 32) == ["c"]
    assert whole_group_missing(infos, ["a", "b", "c"], 32) == []
    assert whole_group_missing(infos, ["a", "b"], 2) == []  # beyond max_group_size groups split by design


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


def test_a_round_that_lost_anything_is_a_failed_round():
    """hivemind reports success for a round whose results came back in part, or whose parts this peer
    reduced without a sender that failed mid-stream; both are failures here (the other side fails too)."""
    from types import SimpleNamespace

    def runner(failed_size=0, banned=()):
        return SimpleNamespace(
            tensor_part_container=SimpleNamespace(failed_size=failed_size), banned_senders=set(banned)
        )

    assert round_loss(None) is None
    assert round_loss(runner()) is None
    assert "only part" in round_loss(runner(failed_size=128))
    assert "without the tensors of ['QmPeer']" in round_loss(runner(banned=["QmPeer"]))


@pytest.fixture(scope="module")
def local_pair():
    """Two replicas in local mode (DiLoCo) whose pseudo-gradients travel as int4, on two DHT nodes."""
    spec = RunSpec.from_dict(
        {"averaging": {**SPEC["averaging"], "mode": "local"}, "compression": {"averaging": "int4", "block_size": 16}}
    )
    with _averagers(2, spec, "local") as pair:
        yield pair


def _local_rounds(pair, deltas, epochs) -> list[torch.Tensor]:
    """Rounds of both replicas of `pair`, each with its pseudo-gradients `deltas[i]` every time; the sum of the
    means replica 0 got."""
    ids = [pid for pid, _ in pair]
    applied = [torch.zeros_like(d) for d in deltas[0]]
    for epoch in epochs:
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(_staggered, i, averager.average, deltas[i], 10, epoch, ids)
                for i, (_, averager) in enumerate(pair)
            ]
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
    assert torch.equal(codec.roundtrip(delta[0]), local_pair[0][1]._rounded(delta, 9)[0][0])
    # rounded the same way without feedback, the 4 rounds would have summed to 4 x the rounded delta: 4 times its
    # rounding error, where the feedback leaves one rounding's worth (the last residual)
    missed = math.sqrt(sum(float(((t - 4 * d) ** 2).sum()) for t, d in zip(applied, delta, strict=True)))
    unfed = math.sqrt(sum(float(((4 * codec.roundtrip(d) - 4 * d) ** 2).sum()) for d in delta))
    assert missed < 0.5 * unfed, (missed, unfed)
