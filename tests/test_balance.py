"""Load balancing: the rule (unit tests) and a real server moving to the stage that needs it."""

from __future__ import annotations

import re
import time

import pytest
from helpers.calls import info

from dht.records import ServerRecord
from peer.swarm.balance import plan_move, stage_totals, weakest_stage


def test_moves_only_when_the_bottleneck_rises_by_the_margin():
    # stage 1 is the bottleneck: a server of the crowded stage 0 moves there
    assert plan_move([30.0, 10.0], [3, 1], stage=0, throughput=10.0, margin=0.2) == 1
    # equal stages: moving would lower the bottleneck
    assert plan_move([20.0, 20.0], [2, 2], stage=0, throughput=10.0, margin=0.2) is None
    # a gain below the margin is not worth a move (hysteresis): 10 -> 11
    assert plan_move([21.0, 10.0], [2, 1], stage=0, throughput=1.0, margin=0.2) is None


def test_never_leaves_a_stage_unserved_nor_moves_to_its_own():
    assert plan_move([10.0, 0.0], [1, 0], stage=0, throughput=10.0, margin=0.2) is None
    assert plan_move([30.0, 0.0, 5.0], [3, 0, 1], stage=0, throughput=10.0, margin=0.2) == 1
    for stage in range(2):
        assert plan_move([10.0, 10.0], [2, 2], stage=stage, throughput=5.0, margin=0.0) != stage


def test_no_oscillation_after_a_move():
    totals, counts = [30.0, 10.0], [3, 1]
    target = plan_move(totals, counts, stage=0, throughput=10.0, margin=0.2)
    totals, counts = [20.0, 20.0], [2, 2]  # after the move
    for stage in (0, 1):
        assert plan_move(totals, counts, stage=stage, throughput=10.0, margin=0.2) is None
    assert target == 1


def test_totals_count_joining_and_serving_only():
    def rec(stage, throughput, state):
        return ServerRecord(stage=stage, endpoint="x:1", throughput=throughput, state=state)

    totals, counts = stage_totals(
        [{"a": rec(0, 5, "serving"), "b": rec(0, 7, "leaving")}, {"c": rec(1, 3, "joining"), "d": rec(1, 9, "left")}], 2
    )
    assert totals == [5.0, 3.0] and counts == [1, 1]
    assert weakest_stage(totals) == 1


def test_one_record_neither_outweighs_the_run_nor_keeps_a_stage_served():
    """A record announcing 10^12 samples/s counts server.balance_claim_cap x the run's median claim; and a server leaves its stage
    only if a replica serving it now averaged with it in its last steps, not because a record says one serves."""
    from types import SimpleNamespace

    from peer.config import PeerConfig
    from peer.server.stage import StageServer

    cap = PeerConfig().server.balance_claim_cap

    def rec(stage, throughput, state="serving"):
        return ServerRecord(stage=stage, endpoint="x:1", throughput=throughput, state=state)

    totals, _ = stage_totals([{"a": rec(0, 100), "liar": rec(0, 1e12, "joining")}, {"b": rec(1, 100)}], 2)
    assert totals == [100 + cap * 100, 100]
    server = SimpleNamespace(runtime=SimpleNamespace(history=[SimpleNamespace(members=["me", "a"])]))
    server.dht = SimpleNamespace(peer_id="me")
    assert StageServer._partnered(server, {"a": rec(0, 100), "liar": rec(0, 1e12)})
    assert not StageServer._partnered(server, {"liar": rec(0, 1e12)})  # it never averaged with us
    assert not StageServer._partnered(server, {"a": rec(0, 100, "leaving")})


def test_the_earliest_claim_moves_and_a_later_one_stays():
    def rec(endpoint, stage, claim=None):
        r = ServerRecord(stage=stage, endpoint=endpoint, throughput=100.0)
        if claim is not None:
            r.moving_to, r.moving_since = 1, claim
        return r

    # stage 0: s0 and two free servers that both claimed a move to stage 1 (a at t=5, b at t=6)
    records = [{"s0": rec("s0:1", 0), "a": rec("a:1", 0, 5.0), "b": rec("b:1", 0, 6.0)}, {"s1": rec("s1:1", 1)}]
    for me, claim, expected in (("a:1", 5.0, 1), ("b:1", 6.0, None)):
        totals, counts = stage_totals(records, 2, before=(claim, me))
        assert plan_move(totals, counts, stage=0, throughput=100.0, margin=0.2) == expected
    # a joiner (no claim of its own) counts every claim as done
    assert stage_totals(records, 2) == ([100.0, 300.0], [1, 3])
    # a moves: it leaves stage 0, then joins stage 1 under the same peer id; b withdrew. In between,
    # b must still see a as gone to stage 1, not as gone from the swarm (or it would move too)
    records[0]["a"].state, records[0]["b"].moving_to = "left", -1
    totals, counts = stage_totals(records, 2, before=(7.0, "b:1"))
    assert (totals, counts) == ([200.0, 200.0], [2, 2])
    assert plan_move(totals, counts, stage=0, throughput=100.0, margin=0.2) is None
    records[1]["a"] = rec("a:2", 1)  # its new record, joining: counted once
    records[1]["a"].state = "joining"
    assert stage_totals(records, 2, before=(7.0, "b:1")) == ([200.0, 200.0], [2, 2])


SPEC = {
    "name": "balance",
    "seed": 5,
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128, "max_seq_len": 32},
    "stages": {"num_stages": 2},
    "training": {"micro_batch_size": 4, "seq_len": 32, "target_batch_size": 16, "total_steps": 1000},
}
SAME = ["--set", "server.throughput=100"]  # equal announced speeds: the test does not hang on benchmark noise
FREE = [
    *SAME,
    "--set",
    "server.rebalance=always",
    "--set",
    "server.balance_cooldown=2",
    "--set",
    "server.balance_period=1",
    "--set",
    "server.balance_settle=1",
]


@pytest.mark.slow  # ~35 s of the README suite's 10 minutes on 2 cores; its plan is unit-tested above
def test_a_server_moves_to_the_weak_stage_and_only_one_does(swarm):
    swarm.coordinator(SPEC)
    pinned = [swarm.server("s0", 0, SAME), swarm.server("s1", 1, SAME)]
    for s in pinned:
        swarm.endpoint(s)
    free = [swarm.server("f0", 0, FREE), swarm.server("f1", 0, FREE)]
    for s in free:
        swarm.endpoint(s)
    # a server leaves its stage only once another replica that serves it averaged with it (a record alone does
    # not keep a stage served): the stages train
    swarm.trainer("t", ["--seed", "0"])
    # stage 0 has three servers, stage 1 one: one free server moves, then the stages are even and nobody moves
    deadline = time.monotonic() + 90
    while not any("Moving from stage 0 to stage 1" in s.output() for s in free):
        assert time.monotonic() < deadline, "no server moved to the weak stage"
        time.sleep(1)
    mover = next(s for s in free if "Moving from stage 0 to stage 1" in s.output())
    endpoint = swarm.known(mover.wait_for(r"Serving stage 1 at (\S+) from step", 90).group(1), mover.name)
    assert info(endpoint).stage == 1
    time.sleep(5)  # five balance periods: nobody moves again (an absence is watched for a while, not polled)
    moves = sum(len(re.findall(r"Moving from stage", s.output())) for s in free)
    assert moves == 1, [s.output()[-2000:] for s in free]
    assert "Loaded the state of stage 1" in mover.output()  # from the stage's existing server, not from scratch
