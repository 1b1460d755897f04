"""Claims a peer cannot back: the step most replicas agree on, and state whose weights no step could reach
(the real-process attacks are in tests/test_attacks.py)."""

from __future__ import annotations

import pytest
import torch

from peer.config import RunSpec
from peer.model.part_state import OutOfReach
from peer.model.runtime import StageRuntime
from peer.swarm.consensus import agreed, backed, credible_limit


def test_the_agreed_step_is_the_one_at_least_half_the_replicas_reached():
    assert agreed([]) == 0
    assert agreed([7]) == 7
    assert agreed([5, 6]) == 6  # of two, the one behind does not hold the other back
    assert agreed([5, 6, 6]) == 6
    assert agreed([5, 5, 1000]) == 5  # one far claim among three moves nothing
    assert agreed([5, 5, 7, 1000]) == 7
    assert agreed([5, 5, 5, 1000, 1000]) == 5
    assert credible_limit([5, 5, 1000], 4) == 9


def test_a_step_is_backed_when_more_than_half_the_replicas_reached_it():
    assert backed([]) == 0
    assert backed([7]) == 7
    assert backed([5, 10**9]) == 5  # of two, one alone is half: its own word
    assert backed([5, 6, 10**9]) == 6
    assert backed([5, 5, 10**9, 10**9]) == 5


def spec() -> RunSpec:
    model = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}
    return RunSpec.from_dict({"model": model, "stages": {"num_stages": 2}, "training": {"lr": 1e-3}})


def _stepped(steps: int) -> StageRuntime:
    rt = StageRuntime(spec(), 1)
    x, y = torch.randn(2, 8, 32), torch.randint(0, 256, (2, 8))
    for i in range(steps):
        rt.backward(f"m{i}", x, None, y)
        rt.apply_step(*rt.take_gradients(), i + 1, ["me"], {"me": (1, i + 1)})
    return rt


def test_a_state_is_taken_only_within_reach_of_the_steps_it_claims():
    behind, ahead = _stepped(2), _stepped(2)
    x, y = torch.randn(2, 8, 32), torch.randint(0, 256, (2, 8))
    for i in range(2):  # two honest steps more: within reach
        ahead.backward(f"n{i}", x, None, y)
        ahead.apply_step(*ahead.take_gradients(), 1, ["me"], {"me": (1, 3 + i)})
    metadata, tensors = ahead.snapshot()
    behind.check_reach(metadata, tensors, per_step=4.0)
    # the same claim with weights moved further than 3 steps of lr 1e-3 could: refused, naming the parameter
    poisoned = {k: t + 0.05 if k.startswith("param/") else t for k, t in tensors.items()}
    with pytest.raises(OutOfReach, match=r"more than 3 steps could .*server.max_update_per_step"):
        behind.check_reach(metadata, poisoned, per_step=4.0)
    # a replica with no trained state of its own (a joiner) has nothing to compare with
    StageRuntime(spec(), 1).check_reach(metadata, poisoned, per_step=4.0)


def test_a_transfer_is_led_by_the_parameters_most_donors_held_then_by_those_that_stepped_in_a_group():
    from types import SimpleNamespace as NS

    from dht.records import ServerRecord
    from peer.server.transfer_lead import lead_first

    def donor(owner: str, throughput: float) -> ServerRecord:
        r = ServerRecord(stage=0, endpoint=f"{owner}:1", epoch=5, throughput=throughput)
        r.owner = owner
        return r

    def said(owner: str, values: list[float], members: list[str]) -> NS:
        return NS(
            history=[NS(epoch=4, values=[1.0, 1.0], members=[owner, "x"]), NS(epoch=5, values=values, members=members)]
        )

    group, apart = [2.0, 4.0], [2.5, 6.0]
    fast, b, c = donor("fast", 100.0), donor("b", 1.0), donor("c", 2.0)
    # the fastest holds other parameters than the two others: outvoted, and left out of the transfer
    infos = [
        said("fast", apart, ["fast", "b", "c"]),
        said("b", group, ["fast", "b", "c"]),
        said("c", group, ["b", "c"]),
    ]
    assert lead_first([fast, b, c], infos, 5, 1e-6) == [c, b]
    # one against one: the one that stepped alone (nobody answered its invitation) does not lead, however fast
    infos = [said("fast", apart, ["fast"]), said("b", group, ["b", "x"])]
    assert lead_first([fast, b], infos, 5, 1e-6) == [b]
    # nobody said what it held then: the fastest leads, all of them send
    assert lead_first([b, fast], [None, NS(history=[])], 5, 1e-6) == [fast, b]


def test_a_state_comes_in_shards_from_the_donors_that_answer_and_a_donor_that_hangs_is_outrun():
    """peer.server.shard_fetch: each donor sends a shard at a time; a shard a donor hangs on is asked of an idle
    donor once it is overdue, the first answer kept and the hung call cancelled; a failed donor's shards go to the
    others; only when every donor failed does the transfer fail; shards already in are not asked again."""
    import asyncio

    from peer.server.shard_fetch import ShardFetch

    async def transfer(behaviour: dict, shards: int, have: dict | None = None):
        asked, cancelled, have = [], [], {} if have is None else have

        async def fetch(donor: str, shard: int):
            asked.append((donor, shard))
            try:
                if behaviour[donor] == "hang":
                    await asyncio.Event().wait()
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                cancelled.append((donor, shard))
                raise
            if behaviour[donor] == "fail":
                raise ConnectionError(f"{donor} failed")
            if behaviour[donor] == "cut":
                raise asyncio.CancelledError  # as a gRPC call whose channel closed under it
            return donor, shard

        fetch_ = ShardFetch(list(behaviour), list(range(shards)), fetch, have, patience=0.2, longest=1.0)
        await asyncio.wait_for(fetch_.run(), 30)  # a hang never outrun fails here, not forever
        return have, fetch_, asked, cancelled

    have, fetch_, asked, cancelled = asyncio.run(transfer({"hangs": "hang", "b": "ok"}, 4))
    assert sorted(have) == [0, 1, 2, 3] and all(donor == "b" for donor, _ in have.values())
    assert asked[0] == ("hangs", 0) and ("b", 0) in asked and cancelled == [("hangs", 0)]
    assert fetch_.outrun == {0} and fetch_.sent == {1} and not fetch_.failed
    have, fetch_, asked, _ = asyncio.run(transfer({"fails": "fail", "b": "ok", "c": "ok"}, 6))
    assert sorted(have) == list(range(6)) and {donor for donor, _ in have.values()} == {"b", "c"}
    assert set(fetch_.failed) == {0} and [a for a in asked if a[0] == "fails"] == [("fails", 0)]
    have, fetch_, _, _ = asyncio.run(transfer({"cut": "cut", "b": "ok"}, 3))  # its shard is not lost
    assert sorted(have) == [0, 1, 2] and set(fetch_.failed) == {0}
    with pytest.raises(ConnectionError):
        asyncio.run(transfer({"a": "fail", "b": "fail"}, 3))
    have, _, asked, _ = asyncio.run(transfer({"a": "ok", "b": "ok"}, 3, {1: ("earlier", 1)}))
    assert have[1] == ("earlier", 1) and sorted(shard for _, shard in asked) == [0, 2]


def test_a_replica_left_serving_while_its_partner_restarts_is_not_a_majority_for_the_run_s_end():
    """Of stage 0's two replicas, one restarts (its record says joining, at step 0) while the other claims the run's
    last step: counted over the part's live replicas, the claim is half, not more: the run's step does not move."""
    import asyncio
    from types import SimpleNamespace as NS

    from dht.records import ServerRecord
    from peer.config import PeerConfig
    from peer.swarm.router import Router

    def record(epoch: int, state: str) -> ServerRecord:
        return ServerRecord(stage=0, endpoint="h:1", throughput=1.0, epoch=epoch, step=epoch, state=state)

    found = {"liar": record(10**6, "serving"), "restarting": record(0, "joining")}

    async def aget(key, kind):  # the one slot's records, as a DHT read finds them
        return dict(found)

    cfg = PeerConfig()
    router = Router(NS(aget=aget), "run", 2, cfg.trainer, cfg.network)  # two stages: each read holds both
    for _ in range(3):
        asyncio.run(router.refresh())
    assert router.max_epoch == 0 and not router.reached(1000)
    found["restarting"] = record(7, "serving")  # back, at the step it loaded: still half
    asyncio.run(router.refresh())
    assert router.max_epoch == 7


def test_a_backward_counts_its_caller_s_samples_only_when_it_added_them():
    """A stage server counts a caller's samples (its row in the run's books, `ServerRecord.counted`, which caps
    what that trainer's word on its completed samples is worth) for a backward that added them: a retry of a uid
    already added is answered again with the first addition's number and counts nothing, so a key that sends
    one micro-batch over and over vouches for it once; a dry backward counts nothing. Leaving, the server still
    answers a backward it added, and refuses any other as leaving (peer.server.stage)."""
    import asyncio
    from collections import OrderedDict
    from types import SimpleNamespace as NS

    from peer.net.guard import CALLER
    from peer.net.refusal import Refused
    from peer.server.stage import StageServer

    server = NS(runtime=StageRuntime(spec(), 1), leaving=False, counted_by=OrderedDict())
    server.cfg, server._drop_if_expired, server._maybe_step = NS(server=NS(max_counted_callers=8)), int, int
    server._backward_job = lambda *a: StageServer._backward_job(server, *a)
    server._count_caller = lambda *a: StageServer._count_caller(server, *a)

    async def run_torch(job, *args):
        return job(*args)

    server.run_torch = run_torch
    x, y = torch.randn(2, 8, 32), torch.randint(0, 256, (2, 8))

    def backward(uid: str, count: bool = True) -> int:
        CALLER.set("trainer")
        return asyncio.run(StageServer.backward(server, uid, x, None, y, None, count))[3]

    assert backward("a") == 1 and server.counted_by == {"trainer": 2}
    assert backward("a") == 1 and server.counted_by == {"trainer": 2}  # the retry: nothing counted
    assert backward("b", count=False) == 0 and server.counted_by == {"trainer": 2}
    assert backward("b") == 2 and server.counted_by == {"trainer": 4}
    server.leaving = True
    assert backward("a") == 1 and server.counted_by == {"trainer": 4}  # leaving, it answers what it added
    with pytest.raises(Refused, match="leaving"):
        backward("c")


def test_a_state_of_a_step_no_other_replica_reached_is_its_donor_s_word_alone():
    """A transfer's lead may answer Info one step past its record (an honest donor that just stepped): the state of
    that step is loaded only if another replica vouches for it (its recent steps hold these parameters at that
    step), or none of the part's others could say (gone, or the step is beyond what they recall). When every other
    replica that answered is behind that step, and no donor's record holds it, it is the donor's word alone and is
    refused (StateError: a lead
    that answered a step ahead each time was loaded unchecked, and led each next load a step further)
    (peer.server.replica_state `_second_opinion`)."""
    import asyncio
    from types import SimpleNamespace as NS

    from dht.records import ServerRecord
    from peer.model.part_state import StateError
    from peer.server.replica_state import StateTransfer

    def record(owner: str, epoch: int) -> ServerRecord:
        r = ServerRecord(stage=0, endpoint=f"{owner}:1", epoch=epoch, throughput=1.0, state="serving")
        r.owner = owner
        return r

    fingerprint = [1.0, 2.0]

    class Loader(StateTransfer):
        def __init__(self, others: dict):  # owner -> (its record's step, its Info's, the steps it recalls with these)
            self.peers = {owner: record(owner, at) for owner, (at, _, _) in others.items()}
            self.cfg = NS(server=NS(second_opinions=4), network=NS(dht_request_timeout=1.0))
            self.spec, self.part = NS(compression=NS(averaging="none")), NS(expert="")

            async def info(endpoint, timeout, expert, peer):
                _, epoch, steps = others[peer]
                return NS(epoch=epoch, history=[NS(epoch=s, values=fingerprint) for s in steps])

            self.client = NS(info=info)

        def _credible(self, records):
            return records

    def check(others: dict, epoch: int = 6, lead_at: int = 5) -> None:
        metadata = {"epoch": epoch, "fingerprint": fingerprint, "donors": ["lead"]}
        asyncio.run(Loader(others)._second_opinion(metadata, [record("lead", lead_at)]))

    check({"b": (5, 6, [5, 6])})  # another replica holds these parameters at 6: vouched
    check({})  # nobody else to ask
    with pytest.raises(StateError, match="donor's word alone"):
        check({"b": (5, 5, [4, 5]), "c": (5, 5, [5])})  # both behind: the lead alone says 6, past its record's 5
    check({"b": (5, 5, [4, 5]), "c": (6, 6, [6])})  # one of them reached it with these parameters
    # a step a donor's record holds: one replica saying it is behind vetoes nothing (a hostile one would get the
    # honest donor struck)
    check({"b": (5, 5, [4, 5])}, lead_at=6)
    # an answer behind the replica's own record is no word: the lead alone says 6
    with pytest.raises(StateError, match="donor's word alone"):
        check({"b": (6, 4, [4]), "c": (5, 5, [5])})
