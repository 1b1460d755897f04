"""Attacks by admitted peers (docs/security.md, issue 24), each performed by a real process against a real
swarm on loopback, and shown to fail while the run goes on."""

from __future__ import annotations

import math
import re
import signal
import subprocess
import time

import pytest
from helpers.calls import books_balance, info, settled_infos
from helpers.specs import SMALL
from helpers.swarm import PEER, ROOT

from dht.identity import Identity
from peer.cli.demo import loopback_join

# a run far from its end (training.total_steps), so that only a false claim could end it
SPEC = {**SMALL, "name": "attacked", "training": {**SMALL["training"], "total_steps": 100_000}}
HELPERS = ROOT / "tests" / "helpers"
# how a call that failed the TLS handshake (the server could not prove the name the caller pinned) reads
_HANDSHAKE = re.compile(r"verification|handshake|UNAUTHENTICATED|certificate", re.IGNORECASE)


def _identity(workdir, name: str) -> str:
    identity = Identity.generate()
    identity.save(workdir / f"{name}.pem")
    return identity.peer_id


def _owner(swarm, command: str, *more: str) -> subprocess.CompletedProcess:
    """`peer coordinator COMMAND ...` (revoke PEER, pardon PEER, invite), as the run's owner does it."""
    args = [*PEER, "coordinator", command, *more, "--spec", "run.toml", "--identity", "coordinator.pem"]
    return subprocess.run(args, cwd=swarm.workdir, capture_output=True, text=True, timeout=60, check=False)


def _hostile(swarm, name: str, jump: int, noise: float):
    """A stage-0 server that claims `jump` steps past its partners, its weights noised (tests/helpers/hostile.py)."""
    args = [str(HELPERS / "hostile.py"), str(jump), str(noise), *loopback_join(swarm.maddr, name, "--stage", "0")]
    return swarm.start(name, args, python=True)


@pytest.mark.slow
def test_a_peer_cannot_impersonate_take_a_stage_over_or_end_the_run_by_its_claims(swarm):
    """Four admitted peers attack a run of three replicas at stage 0 and one at stage 1, while a trainer trains:
    - an impostor announces stage 1's endpoint as its own (item 1): callers pin the owner of the record they
      chose, so calls through its record fail the handshake and blame it, never the honest server;
    - a peer admitted as a trainer announces a stage-1 server (item 5): no reader counts the record;
    - a server that claims a step 10^6 past its partners (past total_steps), with noised weights (items 2 and
      3): no majority backs the claim, so nobody loads its state, routes to it, or stops because of it;
    - a server that claims 2 steps past them (within server.max_resync_jump), with noised weights (item 2):
      a replica behind it soon after it arrived loads its state, finds weights no 3 steps could reach, refuses
      it, and distrusts it; one that asks only hundreds of steps later may take it (a lurker's looser bound).
    The honest replicas step on, and the trainer does all its micro-batches."""
    names = ("s0a", "s0b", "s0c", "s1", "impostor", "pretender", "far", "near")
    ids = {name: _identity(swarm.workdir, name) for name in names}
    swarm.coordinator(SPEC)
    placed = (("s0a", 0), ("s0b", 0), ("s0c", 0), ("s1", 1))
    honest = {name: swarm.server(name, stage) for name, stage in placed}
    endpoints = {name: swarm.endpoint(peer) for name, peer in honest.items()}
    trainer = swarm.trainer("t", ["--seed", "0"])  # keeps the stages stepping until the end
    deadline = time.monotonic() + 90
    while info(endpoints["s0a"]).epoch < 2:
        assert time.monotonic() < deadline and trainer.proc.poll() is None, trainer.output()[-3000:]
        time.sleep(0.3)
    started_at = info(endpoints["s0a"]).epoch

    impostor = swarm.start(
        "impostor",
        [str(HELPERS / "impostor.py"), swarm.maddr, "impostor.pem", "1", endpoints["s1"], "600", "server"],
        python=True,
    )
    # admitted as a trainer only, it announces a stage-1 server (item 5): nobody may count that record
    pretender = swarm.start(
        "pretender",
        [str(HELPERS / "impostor.py"), swarm.maddr, "pretender.pem", "1", "127.0.0.1:9", "600", "trainer"],
        python=True,
    )
    impostor.wait_for(r"IMPOSTOR up", 60)
    pretender.wait_for(r"IMPOSTOR up", 60)
    far, near = _hostile(swarm, "far", 1_000_000, 0.5), _hostile(swarm, "near", 2, 0.5)
    far.wait_for(r"HOSTILE at (\d+)", 120)
    near.wait_for(r"HOSTILE at (\d+)", 120)
    # a trainer that starts now trains its whole run under the attack
    late = swarm.trainer("late", ["--seed", "1", "--max-micro-batches", "200"])
    assert late.wait(300) == 0, late.output()[-3000:]
    assert len([e for e in swarm.log("late") if e["type"] == "micro_batch"]) == 200
    assert trainer.proc.poll() is None, trainer.output()[-3000:]  # nor did the first one stop at total_steps
    failed = [e for name in ("t", "late") for e in swarm.log(name) if e["type"] == "call" and "error" in e]
    # no call to an honest server failed its handshake (a slow moment of a replica on 2 busy cores may time a call
    # out, and the trainer then tries another: that is no blame the impostor caused)
    honest_ids = (ids["s0a"], ids["s0b"], ids["s0c"], ids["s1"])
    honest_failed = [
        (e["stage"], e["method"], e["peer"][-6:], e["error"][:160]) for e in failed if e["peer"] in honest_ids
    ]
    assert not [f for f in honest_failed if _HANDSHAKE.search(f[3])], honest_failed
    # the impostor's record was chosen (its throughput is far above the honest one's) and its calls failed
    assert any(e["peer"] == ids["impostor"] for e in failed), failed[:5]
    assert not any(e["peer"] == ids["pretender"] for e in failed), failed[:5]  # never even tried
    # and the calls to stage 1 went to the honest server all along: it kept its ground (never banned or revoked)
    assert info(endpoints["s1"]).state == "serving"

    outputs = honest["s0a"].output() + honest["s0b"].output() + honest["s0c"].output()
    assert not re.search(r"Loaded the state of stage 0 \(step \d{6,}\)", outputs), outputs[-3000:]
    # the believable liar (2 steps ahead, noised weights) is refused when an honest replica asks for its state soon
    # after it arrived; one that lurks for hundreds of steps first is not: the reach bound grows with the steps the
    # two may have drifted apart since they last stepped together, or since it was first seen (issue 49, H1's
    # remainder; docs/security.md, what is not defended). Seen here: the honest replicas, stepping every 0.2 s,
    # first asked it at step 608 and took its state. What is asserted is what holds: the run goes on (above).
    steps = [info(endpoints[name]).epoch for name in ("s0a", "s0b", "s0c")]
    assert all(started_at < step < 100_000 for step in steps), steps


@pytest.mark.slow
def test_records_only_the_coordinator_may_write_count_from_no_server(swarm):
    """Two admitted servers forge the coordinator's own record kinds for stage 1, which nobody serves yet: one
    says the stage was trained to step 10^6 (a first server would wait for a state nobody holds, for ever), the
    other that a checkpoint of it at step 10^6 is served at a dead address (a joiner would try to load it, for
    ever), both that the coordinator takes the last server's handover. Readers check such records by owner:
    stage 1's first server starts from the seed as the run's first server does, and a trainer trains through it."""
    swarm.coordinator(SPEC)
    s0 = swarm.server("s0", 0)
    forgers = [
        swarm.start(
            f"forger-{state}",
            [str(HELPERS / "impostor.py"), swarm.maddr, f"{state}.pem", "1", "127.0.0.1:9", "600", "server"]
            + [state, "1000000"],
            python=True,
        )
        for state in ("trained", "archive")
    ]
    for forger in forgers:
        forger.wait_for(r"IMPOSTOR up", 60)
    s1 = swarm.server("s1", 1)
    swarm.endpoint(s1)
    swarm.endpoint(s0)
    assert "was trained to step" not in s1.output(), s1.output()[-3000:]
    assert "Loaded the state" not in s1.output(), s1.output()[-3000:]
    trainer = swarm.trainer("t", ["--seed", "0", "--max-micro-batches", "24"])
    assert trainer.wait(120) == 0, trainer.output()[-3000:]
    assert len([e for e in swarm.log("t") if e["type"] == "micro_batch"]) == 24
    assert all(forger.proc.poll() is None for forger in forgers)  # still forging all along


def _trained_beside_a_liar(swarm, mode: str, micro_batches: int):
    """A run whose stage 0 has an honest server and one of tests/helpers/liar.py's MODE, stage 1 an honest one;
    a trainer is asserted to do all `micro_batches` through them; returns it."""
    swarm.coordinator(SPEC)
    s0, s1 = swarm.server("s0", 0), swarm.server("s1", 1)
    liar = swarm.start(
        "liar", [str(HELPERS / "liar.py"), mode, *loopback_join(swarm.maddr, "liar", "--stage", "0")], python=True
    )
    for server in (s0, s1, liar):
        swarm.endpoint(server)
    trainer = swarm.trainer("t", ["--seed", "0", "--max-micro-batches", str(micro_batches)])
    assert trainer.wait(240) == 0, trainer.output()[-3000:]
    done = len([e for e in swarm.log("t") if e["type"] == "micro_batch"])
    assert done == micro_batches, trainer.output()[-3000:]
    return trainer


@pytest.mark.slow
def test_one_record_of_a_far_training_step_ends_no_trainer(swarm):
    """One of stage 0's two replicas serves honestly but announces a training step of 10^9 (past
    training.total_steps) beside its true epoch (tests/helpers/liar.py `far`): of two replicas, half. The run's
    end needs more than half of a part's replicas (peer.swarm.consensus.backed), and a record's training step
    no further than its epoch allows: the trainer does all its micro-batches, through both replicas."""
    _trained_beside_a_liar(swarm, "far", 100)


@pytest.mark.slow
def test_a_server_that_puts_the_fault_on_its_callers_is_banned_not_believed(swarm):
    """One of stage 0's two replicas refuses every forward and backward as the caller's fault (INVALID_ARGUMENT,
    tests/helpers/liar.py `blame`). A trainer believes that only when a second replica says it too: it bans the
    liar like any server that failed, and does every micro-batch on the honest one."""
    ids = {name: _identity(swarm.workdir, name) for name in ("liar",)}
    trainer = _trained_beside_a_liar(swarm, "blame", 40)
    refused = [e for e in swarm.log("t") if e["type"] == "call" and "INVALID_ARGUMENT" in e.get("error", "")]
    assert refused and all(e["peer"] == ids["liar"] for e in refused), refused[:3]
    assert "refused our" not in trainer.output()


@pytest.mark.slow
def test_a_joiner_is_not_held_by_a_donor_that_never_sends_while_another_does(swarm):
    """One of stage 0's two replicas serves and steps honestly, but every GetState it gets hangs
    (tests/helpers/liar.py `mute`). A joiner loading from both, with shard deadlines of 10 minutes, asks the
    honest one for the hung shard once it is overdue (server.state_patience, peer.server.shard_fetch) and serves
    the stage's step in well under those minutes, never the seed's weights."""
    _trained_beside_a_liar(swarm, "mute", 40)
    ends = {peer.name: swarm.endpoint(peer) for peer in swarm.peers if peer.name in ("s0", "liar")}
    deadline = time.monotonic() + 60
    while len({info(e).epoch for e in ends.values()}) > 1:  # both at one step: both are donors
        assert time.monotonic() < deadline, {name: info(e).epoch for name, e in ends.items()}
        time.sleep(0.2)
    step = info(ends["s0"]).epoch
    assert step >= 2
    slow = ["--set", "server.state_load_timeout=600", "--set", "server.state_shard_floor=600"]
    joiner = swarm.server("b", 0, slow)
    joined = joiner.wait_for(r"Serving stage 0 at (\S+) from step (\d+)", 120)
    assert int(joined.group(2)) == step, joiner.output()[-3000:]
    assert re.search(r"Loaded the state of stage 0 \(step \d+\) from 2 peers", joiner.output()), joiner.output()
    assert "starting from the run's seed" not in joiner.output()
    liar = next(peer for peer in swarm.peers if peer.name == "liar")
    liar.wait_for("a hung GetState ended", 30)  # it was asked, and the joiner gave its call up (not a deadline)


@pytest.mark.slow
def test_a_joiner_is_not_held_by_a_lead_that_never_says_its_step(swarm):
    """One of stage 0's two replicas serves and steps honestly and announces the highest throughput, so it leads
    every transfer, but fails every Info (tests/helpers/liar.py `silent`): the step a transfer is pinned to is its
    lead's own answer. A joiner tried that lead again at each failure and never loaded; now a lead that does not
    say its step makes the transfer unloadable, tried from it alone once, then it is struck as a donor: the
    joiner loads from the honest replica."""
    _trained_beside_a_liar(swarm, "silent", 40)
    joiner = swarm.server("b", 0)
    joiner.wait_for(r"Loaded the state of stage 0 \(step \d+\) from 1 peer", 120)
    assert "did not say its step" in joiner.output(), joiner.output()[-3000:]
    assert "starting from the run's seed" not in joiner.output()


@pytest.mark.slow
def test_a_joiner_does_not_load_a_step_its_lead_alone_says_it_reached(swarm):
    """One of stage 0's two replicas leads every transfer (the highest throughput) and answers Info one step past
    its own, with a sound state of that step: its own parameters moved a little (tests/helpers/liar.py `relabel`).
    The other replica, asked for a second opinion, is behind that step, so nobody vouched for it: it was loaded
    all the same (only replicas at that step were asked), and a lead could take each joiner a step further on its
    word alone. Now such a state is refused, the lead struck, and the joiner loads the honest replica's state."""
    _trained_beside_a_liar(swarm, "relabel", 40)
    ends = {peer.name: swarm.endpoint(peer) for peer in swarm.peers if peer.name in ("s0", "liar")}
    deadline = time.monotonic() + 60
    while info(ends["s0"]).epoch != info(ends["liar"]).epoch - 1:  # one step: the liar, the faster, leads
        assert time.monotonic() < deadline, {name: info(e).epoch for name, e in ends.items()}
        time.sleep(0.2)
    joiner = swarm.server("b", 0)
    joined = joiner.wait_for(r"Loaded the state of stage 0 \(step (\d+)\) from", 120)
    liar = next(peer for peer in swarm.peers if peer.name == "liar")
    assert "LIAR sent step" in liar.output(), liar.output()[-3000:]
    step, honest = int(joined.group(1)), ends["s0"]
    held = {h.epoch: list(h.values) for h in info(honest).history}  # the trainer is done: nobody steps now
    assert step in held, f"the joiner loaded step {step}, which the honest replica never reached: {sorted(held)}"
    mine = {h.epoch: list(h.values) for h in info(swarm.endpoint(joiner)).history}
    assert mine[step] == pytest.approx(held[step], rel=1e-6), step  # the liar's state of its step differs
    assert "donor's word alone" in joiner.output(), joiner.output()[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["freeze", "hang", "ahead"])
def test_a_replica_alone_ahead_of_two_others_is_not_followed(swarm, mode):
    """A third replica of stage 0 claims one step past the honest two (tests/helpers/liar.py): `freeze`, in its
    records and answers, and it fails every GetState; `hang`, the same, but every GetState hangs; `ahead`, only in
    its answers to Round invitations. Of three replicas, a step one of them alone is at is its own word
    (peer.server.replica_belief `_backed_only`): the honest two neither wait for it nor load its state, not even
    once (with a sound state, each load would have let it claim a step further: they would never step, go back
    to the weights it sent, or be led to the run's last step); they step on together."""
    swarm.coordinator(SPEC)
    honest = {name: swarm.server(name, 0) for name in ("s0a", "s0b")}
    endpoints = {name: swarm.endpoint(peer) for name, peer in honest.items()}
    liar, trainer = _liar_beside(swarm, mode)
    _honest_step_on(endpoints, honest["s0a"], trainer)
    outputs = honest["s0a"].output() + honest["s0b"].output()
    assert "is alone at step" in outputs, outputs[-3000:]
    assert "could not load the state" not in outputs, outputs[-3000:]
    assert "accumulated samples, of old weights, are dropped" not in outputs, outputs[-3000:]
    _never_apart(endpoints)


def _liar_beside(swarm, mode: str):
    """Start stage 1, the liar of `mode` at stage 0 and a trainer; return (liar, trainer) once the liar lies."""
    swarm.endpoint(swarm.server("s1", 1))
    liar = swarm.start(
        "liar", [str(HELPERS / "liar.py"), mode, *loopback_join(swarm.maddr, "liar", "--stage", "0")], python=True
    )
    swarm.endpoint(liar)
    trainer = swarm.trainer("t", ["--seed", "0"])
    liar.wait_for(r"HOSTILE at (\d+)" if mode != "ahead" else r"LIAR ahead", 120)
    return liar, trainer


def _honest_step_on(endpoints: dict, watched, trainer, steps: int = 10, timeout: float = 120) -> None:
    """Poll until every honest replica (`endpoints`) made `steps` steps past where the least advanced was; the
    trainer alive meanwhile."""
    started_at = min(info(e).epoch for e in endpoints.values())
    deadline = time.monotonic() + timeout
    while min(info(e).epoch for e in endpoints.values()) < started_at + steps:
        now = {name: info(e).epoch for name, e in endpoints.items()}
        assert time.monotonic() < deadline, (started_at, now, watched.output()[-3000:])
        assert trainer.proc.poll() is None, trainer.output()[-3000:]
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.parametrize("lie", ["stepped", "stepped-ahead"])
def test_a_member_that_says_it_stepped_every_round_freezes_no_stage(swarm, lie):
    """A third replica of stage 0 answers every partner's Average call that it already stepped that round
    (tests/helpers/liar.py `stepped`), which a member must believe at the time, and never is ahead. Its partners
    check the word at the next invitation (a replica that stepped is ahead, and believed so); after
    averaging.max_failed_rounds false ones in a row it is left out of their rounds for a while, and the honest two
    step on together. `stepped-ahead` answers that next invitation a step ahead, alone (not followed): as false
    (before, that word was taken as kept)."""
    swarm.coordinator(SPEC)
    honest = {name: swarm.server(name, 0) for name in ("s0a", "s0b")}
    swarm.endpoint(swarm.server("s1", 1))
    endpoints = {name: swarm.endpoint(peer) for name, peer in honest.items()}
    liar = swarm.start(
        "liar", [str(HELPERS / "liar.py"), lie, *loopback_join(swarm.maddr, "liar", "--stage", "0")], python=True
    )
    swarm.endpoint(liar)
    trainer = swarm.trainer("t", ["--seed", "0"])
    honest["s0a"].wait_for(r"already stepped", 120)  # the liar is in the honest replicas' rounds
    _honest_step_on(endpoints, honest["s0a"], trainer)
    outputs = honest["s0a"].output() + honest["s0b"].output()
    # `stepped-ahead` may be left out, or stay alone ahead and out of their rounds: its word counted false either way
    said = "left out of this replica's rounds" if lie == "stepped" else "round(s) in a row failed on its word"
    assert said in outputs, outputs[-3000:]
    _never_apart(endpoints)


def _never_apart(endpoints: dict) -> None:
    """At every recent step both honest replicas made, they made the same one (their fingerprints agree)."""
    histories = [{h.epoch: tuple(h.values) for h in info(e).history} for e in endpoints.values()]
    common = set(histories[0]) & set(histories[1])
    assert common and all(histories[0][k] == histories[1][k] for k in common), sorted(common)


@pytest.mark.slow
def test_a_server_that_never_says_it_stepped_what_it_took_stalls_no_trainer(swarm):
    """A replica of stage 0 serves and steps, but says in its records and answers that none of the backwards it
    took is stepped (tests/helpers/liar.py `hoard`): the trainer would keep every receipt of it until its receipt
    budget (trainer.max_receipt_mb, small here) is full, and then wait forever. A receipt left unstepped while the
    stage went trainer.max_unstepped_steps on is replayed on another replica, and the server avoided."""
    swarm.coordinator(SPEC)
    honest = swarm.server("s0a", 0)
    swarm.endpoint(swarm.server("s1", 1))
    endpoint = swarm.endpoint(honest)
    liar = swarm.start(
        "liar", [str(HELPERS / "liar.py"), "hoard", *loopback_join(swarm.maddr, "liar", "--stage", "0")], python=True
    )
    swarm.endpoint(liar)
    # (with trainer.max_unstepped_steps=0 the trainer stalled at stage 0's step 9)
    budget = ["--set", "trainer.max_receipt_mb=0.05", "--set", "trainer.max_unstepped_steps=4"]
    budget += ["--set", "trainer.unstepped_grace=5"]
    trainer = swarm.trainer("t", ["--seed", "0", *budget])
    started_at = info(endpoint).epoch
    deadline = time.monotonic() + 120
    while info(endpoint).epoch < started_at + 20:
        assert time.monotonic() < deadline, (started_at, info(endpoint).epoch, trainer.output()[-3000:])
        assert trainer.proc.poll() is None, trainer.output()[-3000:]
        time.sleep(0.5)
    assert "kept unstepped" in trainer.output(), trainer.output()[-3000:]


@pytest.mark.slow
def test_a_state_no_honest_replica_holds_is_refused_and_its_donor_never_asked_again(swarm):
    """Stage 0's only server gives a state whose Adam second moments are negative and whose step counts are 0
    (tests/helpers/rotten.py): a joiner that loaded it would turn its weights to NaN at its next step. The
    joiner refuses it, naming the tensor, distrusts its donor for good, and waits for a state it can take
    instead of serving; the run trains on through the rotten server meanwhile."""
    ids = {name: _identity(swarm.workdir, name) for name in ("rotten", "s1", "n0")}
    swarm.coordinator(SPEC)
    rotten = swarm.start(
        "rotten", [str(HELPERS / "rotten.py"), *loopback_join(swarm.maddr, "rotten", "--stage", "0")], python=True
    )
    s1 = swarm.server("s1", 1)
    swarm.endpoint(rotten)
    swarm.endpoint(s1)
    trainer = swarm.trainer("t", ["--seed", "0", "--max-micro-batches", "16"])
    assert trainer.wait(120) == 0, trainer.output()[-3000:]
    joiner = swarm.server("n0", 0)
    refused = joiner.wait_for(r"refused the state of (\S+): (.*)", 120)
    assert refused.group(1).rstrip(":") == ids["rotten"], refused.group(0)
    assert "exp_avg_sq" in refused.group(2) and "negative" in refused.group(2), refused.group(0)
    more = swarm.trainer("more", ["--seed", "1", "--max-micro-batches", "16"])
    assert more.wait(120) == 0, more.output()[-3000:]
    assert "Loaded the state" not in joiner.output() and "Serving stage 0 at" not in joiner.output()
    assert joiner.proc.poll() is None, joiner.output()[-3000:]


@pytest.mark.parametrize(
    "rot",
    [
        pytest.param("--weights", id="other-weights"),
        pytest.param("--moments", id="stalling-moments", marks=pytest.mark.slow),
        pytest.param("", id="rotten-optimizer", marks=pytest.mark.slow),
        pytest.param("--metadata", id="lying-metadata", marks=pytest.mark.slow),
    ],
)
def test_the_coordinator_checkpoints_no_state_that_one_replica_alone_vouches_for(swarm, rot):
    """Stage 0 has two replicas; one gives, to whoever asks for its state, either other weights than it trains with
    or its weights with second moments 1e6 times its own (each with a fingerprint recomputed to match: a state
    that checks out on its own), or a rotten optimizer state, or its honest tensors with metadata that says it
    stepped -1 samples (tests/helpers/rotten.py), and announces far more throughput, so that the coordinator asks
    it first. Every
    checkpoint's stage 0 is the honest replica's, whose parameters the other replica held at that step too; the
    coordinator says why it took not the first one's."""
    from peer.coordinator import checkpoint

    ids = {name: _identity(swarm.workdir, name) for name in ("rotten", "s0b", "s1")}
    root = swarm.workdir / "checkpoints"
    every = ["--set", "coordinator.checkpoint_every_steps=2", "--set", "coordinator.checkpoint_every_minutes=0"]
    swarm.coordinator(SPEC, extra=["--checkpoints", str(root), *every])
    for name, stage in (("s0b", 0), ("s1", 1)):  # the honest replica first: the other loads its state from it
        swarm.endpoint(swarm.server(name, stage))
    args = [*([rot] if rot else []), *loopback_join(swarm.maddr, "rotten", "--stage", "0")]
    rotten = swarm.start("rotten", [str(HELPERS / "rotten.py"), *args, "--set", "server.throughput=1e6"], python=True)
    swarm.endpoint(rotten)
    trainer = swarm.trainer("t", ["--seed", "0", "--max-micro-batches", "24"])
    assert trainer.wait(180) == 0, trainer.output()[-3000:]
    deadline = time.monotonic() + 60
    while not any(checkpoint.read_manifest(p)["step"] >= 4 for p in checkpoint.complete(root)):
        assert time.monotonic() < deadline, swarm.peers[0].output()[-3000:]
        time.sleep(0.5)
    refused = swarm.peers[0].wait_for(rf"the state of stage 0 from \S+ \({ids['rotten']}\) is not taken: (.*)", 30)
    why = {"": "exp_avg_sq", "--metadata": "samples_stepped is -1, not a count"}.get(rot, "held the same parameters")
    assert why in refused.group(1), refused.group(0)
    for path in checkpoint.complete(root):
        manifest = checkpoint.read_manifest(path)
        assert manifest["parts"]["stage 0"]["peer"] == ids["s0b"], (path, manifest["parts"]["stage 0"])
        _, tensors = checkpoint.load_part(path, manifest, "stage 0")
        assert all(float(t.min()) >= 0 for n, t in tensors.items() if n.endswith("exp_avg_sq"))


def _beside_a_rotten_third(swarm, rot: str) -> dict[str, str]:
    """A run whose stage 0 has two honest replicas and a third, `rotten.py ROT`, that claims the most throughput
    (so it leads a joiner's transfer), trained one step (12 micro-batches) and settled; the endpoints by name."""
    swarm.coordinator(SPEC)
    endpoints = {name: swarm.endpoint(swarm.server(name, stage)) for name, stage in (("s0a", 0), ("s0b", 0), ("s1", 1))}
    args = [rot, *loopback_join(swarm.maddr, "rotten", "--stage", "0"), "--set", "server.throughput=1e6"]
    endpoints["rotten"] = swarm.endpoint(swarm.start("rotten", [str(HELPERS / "rotten.py"), *args], python=True))
    trainer = swarm.trainer("t", ["--seed", "0", "--max-micro-batches", "12"])
    assert trainer.wait(120) == 0, trainer.output()[-3000:]
    settled_infos([endpoints[name] for name in ("s0a", "s0b", "rotten")])  # one step: the fastest leads a transfer
    return endpoints


@pytest.mark.parametrize(
    "rot",
    [
        pytest.param("--weights", id="other-weights"),
        pytest.param("--moments", id="stalling-moments", marks=pytest.mark.slow),  # 18 s: the README suite's time
    ],
)
def test_a_joiner_loads_no_state_that_the_part_s_other_replicas_did_not_hold(swarm, rot):
    """Stage 0 has three replicas; the third (tests/helpers/rotten.py) gives joiners other weights than it trains
    with, or its weights with second moments 1e6 times its own (which would stall the joiner's learning for
    thousands of steps), with a fingerprint recomputed to match, and announces the most throughput, so that a
    joiner taking its state from one donor takes it from that one. The joiner asks the two others whether they
    held that state at that step (the fingerprint covers the moments); they did not: it refuses the state,
    distrusts its donor, and loads the honest one."""
    ids = {name: _identity(swarm.workdir, name) for name in ("rotten", "s0a", "s0b", "s1", "n0")}
    endpoints = _beside_a_rotten_third(swarm, rot)
    joiner = swarm.server("n0", 0, ["--set", "server.state_donors=1"])
    refused = joiner.wait_for(r"refused the state of (\S+): (.*)", 120)
    assert refused.group(1).rstrip(":") == ids["rotten"], refused.group(0)
    assert "other replicas held other parameters" in refused.group(2), refused.group(0)
    joiner.wait_for(r"Loaded the state of stage 0 \(step (\d+)\)", 60)
    mine, theirs = info(swarm.endpoint(joiner)), info(endpoints["s0a"])
    assert mine.epoch == theirs.epoch, (mine.epoch, theirs.epoch)  # nobody trains now: both hold that step
    assert list(mine.history[-1].values) == pytest.approx(list(theirs.history[-1].values), rel=1e-6)


@pytest.mark.slow
def test_a_co_donor_that_spoils_every_transfer_keeps_no_joiner_out(swarm):
    """Stage 0 has three replicas; the third (tests/helpers/rotten.py --missing) says the honest fingerprint, claims
    the most throughput (so it leads a joiner's transfer), and leaves a tensor out of every part of its state it
    sends. The joiner's transfer fails; it tries the lead alone once, which fails too, bans it as a donor for a
    while (server.donor_ban) and loads the honest replicas' state (before, it tried the same donors for ever)."""
    endpoints = _beside_a_rotten_third(swarm, "--missing")
    joiner = swarm.server("n0", 0)
    joiner.wait_for(r"once more from its lead alone", 120)
    joiner.wait_for(r"Loaded the state of stage 0 \(step (\d+)\)", 60)
    mine, theirs = info(swarm.endpoint(joiner)), info(endpoints["s0a"])
    assert mine.epoch == theirs.epoch, (mine.epoch, theirs.epoch)
    assert list(mine.history[-1].values) == pytest.approx(list(theirs.history[-1].values), rel=1e-6)


@pytest.mark.slow
def test_a_replica_that_poisons_its_averaging_rounds_never_gets_its_mean_stepped(swarm):
    """Item 6: an admitted replica of stage 0 sends gradients of 1e4 everywhere to every round, and steps the
    poisoned mean itself. The two honest replicas refuse each such mean (its norm is far above those they
    took), so no step of theirs ever counts it; the poisoner, a step ahead, is not a donor (its step holds a
    group they refused), and once caught it is out of their rounds. They step on, and the trainer trains.
    (A round it joined with no samples is no poison: its values weigh 0, and the honest ones step that mean.)"""
    ids = {name: _identity(swarm.workdir, name) for name in ("s0a", "s0b", "s1", "poisoner")}
    swarm.coordinator(SPEC)
    honest = {name: swarm.server(name, stage) for name, stage in (("s0a", 0), ("s0b", 0), ("s1", 1))}
    endpoints = {name: swarm.endpoint(peer) for name, peer in honest.items()}
    trainer = swarm.trainer("t", ["--seed", "0"])
    deadline = time.monotonic() + 90
    while info(endpoints["s0a"]).epoch < 6:  # the honest replicas know what a mean looks like by now
        assert time.monotonic() < deadline and trainer.proc.poll() is None, trainer.output()[-3000:]
        time.sleep(0.3)
    args = [str(HELPERS / "poisoner.py"), "1e4", *loopback_join(swarm.maddr, "poisoner", "--stage", "0")]
    poisoner = swarm.start("poisoner", args, python=True)
    poisoner.wait_for(r"POISONER sent step \d+ with [1-9]", 120)
    late = swarm.trainer("late", ["--seed", "1", "--max-micro-batches", "150"])
    assert late.wait(300) == 0, late.output()[-3000:]
    assert len([e for e in swarm.log("late") if e["type"] == "micro_batch"]) == 150

    outputs = honest["s0a"].output() + honest["s0b"].output()
    assert "refused the mean of the averaging group" in outputs, outputs[-3000:]
    # a round's step is the next one; a round it brought no samples to weighs its values at 0 (nothing to refuse)
    poisoned = {
        int(m[0]) + 1 for m in re.findall(r"POISONER sent step (\d+) with (\d+)", poisoner.output()) if m[1] != "0"
    }
    assert poisoned, poisoner.output()[-3000:]
    for name in ("s0a", "s0b"):
        history = info(endpoints[name]).history
        stepped = [step for step in history if ids["poisoner"] in step.members and step.epoch in poisoned]
        assert history and not stepped, (name, [step.epoch for step in stepped], sorted(poisoned))
        assert all(math.isfinite(v) and abs(v) < 1e6 for step in history for v in step.values)
    steps = [info(endpoints[name]).epoch for name in ("s0a", "s0b")]
    assert min(steps) > 10, steps


@pytest.mark.slow
def test_a_replica_cannot_raise_the_norm_bound_round_by_round(swarm):
    """Fourth read, finding 6: a third replica of stage 0 sends its honest gradients 1.5x larger each round (and
    says their true norm). Against a reference of the last means taken, which trailed its newest by 1.5^8 = 26x,
    under the 100x bound, it was never refused until float overflow. The reference is the lower median of the
    members' own norms, which the two honest ones hold: they refuse its mean once it is about 100x theirs (its
    scale in the hundreds: ~660, its 16th round, in the first run), and step on."""
    swarm.coordinator(SPEC)
    honest = {name: swarm.server(name, stage) for name, stage in (("s0a", 0), ("s0b", 0), ("s1", 1))}
    endpoints = {name: swarm.endpoint(peer) for name, peer in honest.items()}
    swarm.trainer("t", ["--seed", "0"])
    args = [str(HELPERS / "poisoner.py"), "--ratchet", "1.5", *loopback_join(swarm.maddr, "poisoner", "--stage", "0")]
    poisoner = swarm.start("poisoner", args, python=True)
    refused = re.compile(r"refused the mean of the averaging group for step (\d+)")
    deadline = time.monotonic() + 180
    while not (caught := [m for name in ("s0a", "s0b") for m in refused.findall(honest[name].output())]):
        assert time.monotonic() < deadline, poisoner.output()[-3000:]
        time.sleep(0.3)
    sent = {
        int(m[0]): float(m[1]) for m in re.findall(r"POISONER sent step (\d+) .* at scale (\S+)", poisoner.output())
    }
    # refused at a scale in the hundreds: not at once (a bound that refused every round would), and not never
    assert 10 <= sent.get(int(caught[0]), math.inf) < 1e4, (caught, sent)
    at = min(info(endpoints[name]).epoch for name in ("s0a", "s0b"))
    deadline = time.monotonic() + 90
    while min(info(endpoints[name]).epoch for name in ("s0a", "s0b")) < at + 5:  # they step on
        assert time.monotonic() < deadline, honest["s0a"].output()[-3000:]
        time.sleep(0.3)


@pytest.mark.slow
def test_an_owner_that_sends_members_different_averages_splits_no_replicas(swarm):
    """Fourth read, finding 5: a third replica of stage 0, as the owner of its slice, sends one partner averages 1.01x
    the true ones and the other the true ones, each with a verdict signing what that one got
    (tests/helpers/liar.py `split`). Before, both stepped what they got: two honest replicas with different weights
    at one step, for good, which spot checks then blamed on one of them. Now each member's confirm shows the other
    the liar's signature on another digest: nobody steps such a round, the liar is left out at once, the honest
    two step on together, with the same weights, and their proof (the liar's two signatures) gets it revoked."""
    ids = {name: _identity(swarm.workdir, name) for name in ("s0a", "s0b", "s1", "liar")}
    swarm.coordinator(SPEC)
    honest = {name: swarm.server(name, stage) for name, stage in (("s0a", 0), ("s0b", 0), ("s1", 1))}
    endpoints = {name: swarm.endpoint(peer) for name, peer in honest.items()}
    swarm.trainer("t", ["--seed", "0"])
    args = [str(HELPERS / "liar.py"), "split", *loopback_join(swarm.maddr, "liar", "--stage", "0")]
    liar = swarm.start("liar", args, python=True)
    deadline = time.monotonic() + 180
    while "signed two different averages" not in (outputs := honest["s0a"].output() + honest["s0b"].output()):
        assert time.monotonic() < deadline and liar.proc.poll() is None, liar.output()[-3000:]
        time.sleep(0.3)
    split = {int(step) for step in re.findall(r"LIAR split step (\d+)", liar.output())}
    assert split, liar.output()[-3000:]
    # the replicas' proof (its two signatures) reaches the coordinator, which checks it and revokes the liar alone
    swarm.peers[0].wait_for(rf"authority: revoked {ids['liar']}: it signed two different averages", 60)
    liar.wait_for(r"credential was revoked", 60)
    assert not any(f"revoked {ids[name]}" in swarm.peers[0].output() for name in ("s0a", "s0b", "s1"))
    at = min(info(endpoints[name]).epoch for name in ("s0a", "s0b"))
    deadline = time.monotonic() + 120
    while min(info(endpoints[name]).epoch for name in ("s0a", "s0b")) < at + 5:  # they step on, without it
        assert time.monotonic() < deadline, outputs[-3000:]
        time.sleep(0.3)
    histories = {name: info(endpoints[name]).history for name in ("s0a", "s0b")}
    for name, history in histories.items():  # a round's step is the next one: none of those it split was stepped
        stepped = [step.epoch for step in history if ids["liar"] in step.members and step.epoch - 1 in split]
        assert not stepped, (name, stepped, sorted(split))
    by_epoch = {name: {s.epoch: s for s in history} for name, history in histories.items()}
    together = [  # steps the two took in one group: the same weights after each
        e
        for e in sorted(by_epoch["s0a"].keys() & by_epoch["s0b"].keys())
        if by_epoch["s0a"][e].members == by_epoch["s0b"][e].members
    ]
    assert together, histories
    for e in together:
        assert list(by_epoch["s0a"][e].values) == pytest.approx(list(by_epoch["s0b"][e].values), rel=1e-6), e


@pytest.mark.slow
def test_a_revoked_peer_counts_nowhere_from_the_first_second(swarm):
    """Item 7: with a revocation list read only every 60 s (admission.refresh), a replica that is revoked while
    stopped (it cannot leave by itself; its record lingers) is still left out at once by what starts after the
    revocation: `peer status` does not show it, and a joining server loads its state from the other replica
    only (it read the list before choosing donors)."""
    ids = {name: _identity(swarm.workdir, name) for name in ("s0a", "s0b", "s0c", "s1")}
    swarm.coordinator({**SPEC, "admission": {"mode": "open", "refresh": 60.0}})
    servers = {name: swarm.server(name, stage) for name, stage in (("s0a", 0), ("s0b", 0), ("s1", 1))}
    endpoints = {name: swarm.endpoint(peer) for name, peer in servers.items()}
    trainer = swarm.trainer("t", ["--seed", "0"])
    deadline = time.monotonic() + 90
    while info(endpoints["s0a"]).epoch < 2:
        assert time.monotonic() < deadline and trainer.proc.poll() is None, trainer.output()[-3000:]
        time.sleep(0.3)
    servers["s0b"].signal(signal.SIGSTOP)
    revoked = _owner(swarm, "revoke", ids["s0b"])
    assert revoked.returncode == 0, revoked.stderr
    swarm.peers[0].wait_for(rf"Revoked peer {ids['s0b']}", 30)

    status = subprocess.run(
        [*PEER, "status", swarm.maddr], cwd=swarm.workdir, capture_output=True, text=True, timeout=120, check=False
    )
    assert status.returncode == 0, status.stderr
    assert endpoints["s0a"] in status.stdout and endpoints["s0b"] not in status.stdout, status.stdout

    started = time.monotonic()
    joiner = swarm.server("s0c", 0)
    loaded = joiner.wait_for(r"Loaded the state of stage 0 \(step \d+\) from (\d+) peer", 90)
    assert loaded.group(1) == "1", joiner.output()[-3000:]
    assert time.monotonic() - started < 45, joiner.output()[-3000:]  # no wait on the stopped, revoked donor
    servers["s0b"].signal(signal.SIGCONT)


@pytest.mark.slow
def test_a_flood_of_credential_requests_delays_neither_joins_nor_revocations(swarm):
    """Item 10: 400 throwaway keys each ask for a credential (valid requests, as anyone may send in open mode),
    more than the coordinator looks at in one pass (admission.max_pending 64). Answered requests no longer fill
    every later pass, so an honest server that asks after them is admitted; and a revocation, on a loop of its
    own, is published while the flood is being answered."""
    ids = {name: _identity(swarm.workdir, name) for name in ("s0", "s1")}
    swarm.coordinator({**SPEC, "admission": {"mode": "open", "max_pending": 64}})
    first = swarm.server("s1", 1)
    swarm.endpoint(first)
    flood = swarm.start("flood", [str(HELPERS / "flood.py"), swarm.maddr, "400", "600"], python=True)
    assert int(flood.wait_for(r"FLOOD stored (\d+)", 180).group(1)) >= 300, flood.output()[-2000:]
    started = time.monotonic()
    server = swarm.server("s0", 0)
    swarm.endpoint(server, 120)
    print(f"an honest server was admitted and served {time.monotonic() - started:.1f} s after the flood")
    started = time.monotonic()
    revoked = _owner(swarm, "revoke", ids["s1"])
    assert revoked.returncode == 0, revoked.stderr
    swarm.peers[0].wait_for(rf"Revoked peer {ids['s1']}", 30)
    first.wait_for(r"credential was revoked", 60)
    print(f"the revoked server learnt it {time.monotonic() - started:.1f} s after the revoke command")


def test_malformed_credential_requests_stop_no_admission(swarm):
    """A stranger (no credential needed to ask for one) stores requests that are well-formed records but malformed
    for the coordinator: a TLS key of a curve nobody supports, a non-ASCII invite MAC for a real invite, a key that
    is not DER. Each is refused with its reason, and invited peers are admitted after them (one such request used
    to end every pass of the coordinator's admission: no join or renewal while it lived, the run over within a
    credential's life)."""
    swarm.coordinator({**SPEC, "admission": {}})  # invite, the default
    made = _owner(swarm, "invite", "--uses", "2")
    assert made.returncode == 0, made.stderr
    code = re.search(r"--invite (\S+)", made.stdout).group(1)
    args = [str(HELPERS / "flood.py"), swarm.maddr, "9", "600", "--malformed", code.split(".")[0]]
    flood = swarm.start("flood", args, python=True)
    # (a store the DHT did not confirm in time may have landed all the same: what counts is what the coordinator says)
    assert int(flood.wait_for(r"FLOOD stored (\d+)", 120).group(1)) > 0, flood.output()[-2000:]
    coordinator = swarm.peers[0]
    for why in ("is not supported", "malformed request", "the code is wrong"):
        coordinator.wait_for(rf"refused a credential to \S+: .*{why}", 60)
    for name, stage in (("s0", 0), ("s1", 1)):
        swarm.endpoint(swarm.server(name, stage, ["--invite", code]), 120)


@pytest.mark.slow
@pytest.mark.parametrize("dodge", ["dodge", "lag"])
def test_spot_checks_catch_a_wrong_last_stage_and_a_dodger_and_only_real_trainers_report(swarm, dodge):
    """Item 8: spot checks look like work (a training forward under a fresh uid, a dry backward) and cover the last
    stage, whose loss and gradients are compared: a last stage that sends wrong gradients is caught by the trainer,
    reported, and revoked. A stage-0 server that answers every forward as if a step later, or earlier (so that the
    old checks, which compared only answers of one step, never compared it; a step earlier passed the later ones,
    which counted only a step ahead as a dodge) and wrongly is asked again while the steps differ:
    it is caught wrong, or dodges three times in a row and is dropped; either way the trainer stops using it.
    A key admitted as a trainer that has trained nothing reports an honest server: it is not counted. And the
    run's owner pardons the revoked server: the list drops it, and its old reports do not bring it back."""
    names = ("s0a", "s0b", "dodger", "s1a", "s1b", "wrong", "reporter")
    ids = {name: _identity(swarm.workdir, name) for name in names}
    swarm.coordinator({**SPEC, "admission": {"mode": "open", "revoke_after_reports": 1, "refresh": 2.0}})
    honest = {name: swarm.server(name, stage) for name, stage in (("s0a", 0), ("s0b", 0), ("s1a", 1), ("s1b", 1))}
    for peer in honest.values():
        swarm.endpoint(peer)
    liars = {
        "dodger": (dodge, 0, ["--set", "server.perturb_outputs=0.5"]),
        "wrong": ("last", 1, []),
    }
    started = {}
    for name, (mode, stage, extra) in liars.items():
        args = [str(HELPERS / "liar.py"), mode, *loopback_join(swarm.maddr, name, "--stage", str(stage), *extra)]
        started[name] = swarm.start(name, args, python=True)
        swarm.endpoint(started[name])
    reporter = swarm.start(
        "reporter", [str(HELPERS / "reporter.py"), swarm.maddr, "reporter.pem", ids["s1a"], "600"], python=True
    )
    reporter.wait_for(r"REPORTER up", 60)
    # a spot check of 30 % of forwards and backwards (5 % by default): caught sooner, the same path
    trainer = swarm.trainer("t", ["--seed", "0", "--set", "trainer.spot_check=0.3"])
    swarm.peers[0].wait_for(rf"Revoked peer {ids['wrong']}: spot checks", 240)
    dodger = (
        rf"{ids['dodger']}\) answered wrong|{ids['dodger']} answered at another step than its partner 3 times in a row"
    )
    trainer.wait_for(dodger, 240)
    caught = [e for e in swarm.log("t") if e["type"] == "spot_check"]
    assert caught and {e["wrong"] for e in caught} <= {ids["wrong"], ids["dodger"]}, caught
    assert f"Revoked peer {ids['s1a']}" not in swarm.peers[0].output()  # the throwaway reporter counted for nothing
    pardoned = _owner(swarm, "pardon", ids["wrong"])
    assert pardoned.returncode == 0 and "Pardoned" in pardoned.stdout, pardoned.stderr
    swarm.peers[0].wait_for(rf"Pardoned peer {ids['wrong']}", 30)
    # the trainer's report of it stays in the DHT (re-sent with each announcement), and the coordinator reads the
    # reports 5 times a second: for 5 s, they must not revoke it again (what it failed came before the pardon)
    window = time.monotonic() + 5
    while time.monotonic() < window:
        assert swarm.peers[0].output().count(f"Revoked peer {ids['wrong']}") == 1
        time.sleep(0.2)
    trainer.signal(signal.SIGTERM)


@pytest.mark.slow  # 20 s: the README suite is near its 10 minutes
def test_two_keys_that_claim_work_and_report_an_honest_server_do_not_get_it_revoked(swarm):
    """Two keys admitted as trainers (free in open admission) announce 10,000 samples done each and report an
    honest last-stage server, as the coordinator needs (admission.revoke_after_reports = 2). The coordinator
    probes it and two other replicas of its stage with one request at one step (peer.coordinator.referee): its
    answer agrees, so it is not revoked, and it keeps serving a trainer. The books count the honest trainer's
    samples only: the keys' claims are held to what the stages counted of their backwards (none)."""
    ids = {name: _identity(swarm.workdir, name) for name in ("s0", "s1a", "s1b", "s1c", "r1", "r2")}
    swarm.coordinator({**SPEC, "admission": {"mode": "open", "revoke_after_reports": 2, "refresh": 2.0}})
    for name, stage in (("s0", 0), ("s1a", 1), ("s1b", 1), ("s1c", 1)):
        swarm.endpoint(swarm.server(name, stage))
    reporters = [
        swarm.start(
            name, [str(HELPERS / "reporter.py"), swarm.maddr, f"{name}.pem", ids["s1a"], "600", "10000"], python=True
        )
        for name in ("r1", "r2")
    ]
    for reporter in reporters:
        reporter.wait_for(r"REPORTER up", 60)
    judged = swarm.peers[0].wait_for(rf"2 trainer\(s\) reported {ids['s1a']}; not revoked: (.*)", 120)
    assert "agrees with its partners" in judged.group(1), judged.group(0)
    trainer = swarm.trainer("t", ["--seed", "0", "--max-micro-batches", "16"])
    assert trainer.wait(120) == 0, trainer.output()[-3000:]
    assert f"Revoked peer {ids['s1a']}" not in swarm.peers[0].output()
    books_balance(swarm, 16 * SMALL["training"]["micro_batch_size"])


@pytest.mark.slow
def test_a_relay_drops_a_peer_revoked_while_it_carries_it(swarm):
    """Item 7: a relay checked a peer's credential when it attached only. A server carried by the relay is
    revoked and, hostile, does not stop (tests/helpers/liar.py stay): the relay drops it within a refresh and
    a keepalive (its relayed port closes, so nobody reaches it through the relay), and refuses it when it asks
    to attach again."""
    ids = {name: _identity(swarm.workdir, name) for name in ("s0", "s1")}
    swarm.coordinator(
        {**SPEC, "admission": {"mode": "open", "refresh": 2.0}}, extra=["--set", "coordinator.relay=false"]
    )
    relay = swarm.start("r", loopback_join(swarm.maddr, "r", "--role", "relay"))
    relay.wait_for(r"Relaying for peers that cannot be dialled, at", 60)
    swarm.endpoint(swarm.server("s0", 0))
    args = [str(HELPERS / "liar.py"), "stay", *loopback_join(swarm.maddr, "s1", "--stage", "1")]
    hidden = swarm.start("s1", [*args, "--set", "relay.reachability=private"], python=True)
    relayed_at = swarm.endpoint(hidden)
    hidden.wait_for(r"Serving through relay", 30)
    assert info(relayed_at).stage == 1  # reached through the relay

    before = len(relay.output())  # what the relay said before the revocation (a reattach may be in it)
    assert _owner(swarm, "revoke", ids["s1"]).returncode == 0
    deadline = time.monotonic() + 30
    while f"stopped relaying for {ids['s1']}" not in relay.output()[before:]:
        assert time.monotonic() < deadline, relay.output()[-3000:]
        time.sleep(0.2)
    stopped = before + relay.output()[before:].index(f"stopped relaying for {ids['s1']}")
    host, port = relayed_at.rsplit(":", 1)
    deadline = time.monotonic() + 10
    while _accepts(host, int(port)):  # the relayed port closes with the attachment
        assert time.monotonic() < deadline, f"{relayed_at} still accepts connections after the revocation"
        time.sleep(0.2)
    window = time.monotonic() + 3 * 2.0  # its uplink asks again at once, and every keepalive: refused each time
    while time.monotonic() < window:
        after = relay.output()[stopped:].split("\n", 1)[-1]
        assert f"relaying for {ids['s1']}" not in after, after[-2000:]
        time.sleep(0.2)
    hidden.wait_for(r"this peer's credential was revoked", 30)
    assert hidden.proc.poll() is None  # it stays: only the relay's own check dropped it


def _accepts(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test_the_referee_clears_a_server_one_partner_agrees_with():
    """Four keys: two reporters and two servers of the reported one's stage that answer the coordinator's probe
    alike (and wrong). The referee picked two partners at random: when it picked the two hostile ones, they agreed,
    the honest server agreed with neither, and it was revoked though honest partners were there. It now asks up to
    security.probe_partners (4): one partner that agrees with the reported server clears it. A partner that does
    not answer, or answers at another step, counts for neither side; with fewer than two left, it cannot tell."""
    import asyncio

    import torch

    from dht.records import ServerRecord
    from peer.config import PeerConfig, RunSpec
    from peer.coordinator.referee import Referee

    right, wrong = torch.ones(4), torch.full((4,), 3.0)

    class Probed(Referee):
        def __init__(self, answers: dict):  # peer id -> (answer, step), or an exception to raise
            super().__init__(RunSpec(), PeerConfig(), dht=type("D", (), {"security": None})())
            self.answers = answers
            self.cfg.security.probe_wait = 0.0

        async def _stage_of(self, accused):
            return 1, {pid: ServerRecord(stage=1, endpoint=f"{pid}:1", throughput=1.0) for pid in self.answers}

        async def _ask(self, client, endpoint, pid, request, payloads):
            answer = self.answers[pid]
            if isinstance(answer, Exception):
                raise answer
            return answer

    def verdict(**answers) -> tuple:
        return asyncio.run(Probed(answers)._verdict("honest"))

    hostile = {"h1": (wrong, 5), "h2": (wrong, 5)}
    assert verdict(honest=(right, 5), **hostile, o1=(right, 5), o2=(right, 5))[0] is False
    # asked again while an honest partner is at another step; one there at every try, or silent, vouches for nothing
    assert verdict(honest=(right, 5), **hostile, o1=(right, 6), o2=TimeoutError())[0] is True
    assert verdict(honest=(wrong, 5), h1=(right, 5), h2=(right, 5), o1=(right, 5))[0] is True  # a cheater
    assert verdict(honest=(right, 5), h1=(wrong, 5), o1=TimeoutError())[0] is None  # one partner: cannot tell
    assert verdict(honest=(right, 5), h1=(wrong, 5), o1=(3 * wrong, 5))[0] is None  # partners disagree too
