"""The coordinator's own check of a server that trainers reported, before it revokes it.

A report (dht.records.SpotCheckReport) is a trainer's word, and a trainer's key costs nothing in open
admission: two throwaway keys that claim work done could report every honest server. So the reports
only make the coordinator look: it asks the reported server and two other replicas of its stage, at
one step, the same request a spot check sends (a training forward of random inputs under a fresh uid;
on the last stage a dry backward, whose loss and gradients are compared), and revokes only when the
two others agree with each other and the reported one agrees with neither. When it cannot tell (fewer
than two other replicas, one does not answer, they never meet at one step), nobody is revoked: the
trainers that caught the server keep it banned, and the reports are looked at again later.

The requests come from the coordinator's key: a server that answers wrong only to others is not
revoked by this (docs/security.md), but no honest server is revoked on reports alone.
"""

from __future__ import annotations

import asyncio
import random
import secrets

import torch

from dht import keys
from dht.records import ServerRecord
from peer.config import PeerConfig, RunSpec
from peer.net.client import StageClient
from peer.swarm.answers import agree, answer_of
from peer.swarm.consensus import credible_limit
from protocols import codec, stage_pb2, tensor_pb2

PROBE_ROWS = 2  # sequences in a probe


class Referee:
    def __init__(self, spec: RunSpec, cfg: PeerConfig, dht):
        self.spec, self.cfg, self.dht = spec, cfg, dht
        self.rng = random.Random()

    def verdict(self, accused: str) -> tuple[bool | None, str]:
        """(True: its answers are wrong, False: right, None: cannot tell; and why), from a thread of the
        coordinator's (a loop of its own for the calls)."""
        return asyncio.run(self._verdict(accused))

    async def _verdict(self, accused: str) -> tuple[bool | None, str]:
        found = await self._stage_of(accused)
        if found is None:
            return None, "it serves no stage now"
        stage, records = found
        others = [pid for pid in records if pid != accused]
        if len(others) < 2:
            return None, f"stage {stage} has {len(others)} other replica(s) to compare it with, not two"
        asked = [accused, *self.rng.sample(others, 2)]
        client = StageClient.for_server(self.cfg.server, self.dht.security)
        try:
            answers = await self._at_one_step(client, stage, [records[pid] for pid in asked], asked)
        finally:
            await client.close()
        if isinstance(answers, str):
            return None, answers
        (theirs, epoch), tol = answers, self.cfg.trainer.spot_check_tolerance
        if not agree(theirs[1], theirs[2], tol):
            return None, f"the two other replicas of stage {stage} disagree too at step {epoch}"
        if agree(theirs[0], theirs[1], tol) or agree(theirs[0], theirs[2], tol):
            return False, f"its answer to the coordinator's probe at step {epoch} agrees with its partners'"
        return True, f"its answer to the coordinator's probe at step {epoch} differs from two partners that agree"

    async def _stage_of(self, accused: str) -> tuple[int, dict[str, ServerRecord]] | None:
        """The stage the accused serves and its credible serving replicas there (by their records)."""
        for stage in range(self.spec.stages.num_stages):
            records = await self.dht.aget(keys.servers_key(self.spec.name, stage), ServerRecord)
            serving = {pid: r for pid, r in records.items() if r.state == "serving" and not r.expert}
            if accused in serving:
                limit = credible_limit((r.epoch for r in serving.values()), self.cfg.server.max_resync_jump)
                return stage, {pid: r for pid, r in serving.items() if r.epoch <= limit}
        return None

    async def _at_one_step(self, client, stage: int, records: list[ServerRecord], pids: list[str]):
        """(answers, step) of the replicas to one probe, asked again while they answer at different steps (one
        just stepped), up to security.probe_tries times; a string saying why not if they never meet or one
        does not answer."""
        sec = self.cfg.security
        for _ in range(sec.probe_tries):
            request, payloads = self._probe(stage)
            tries = [
                self._ask(client, r.endpoint, pid, request, payloads) for r, pid in zip(records, pids, strict=True)
            ]
            answers = await asyncio.gather(*tries, return_exceptions=True)
            failed = [pid for pid, a in zip(pids, answers, strict=True) if isinstance(a, BaseException)]
            if failed:
                return f"{', '.join(failed)} did not answer the coordinator's probe"
            if len({epoch for _, epoch in answers}) == 1:
                return [a for a, _ in answers], answers[0][1]
            await asyncio.sleep(sec.probe_wait)
        return f"the replicas never answered at one step in {sec.probe_tries} tries"

    async def _ask(self, client, endpoint: str, pid: str, request, payloads) -> tuple[object, int]:
        again = type(request)()
        again.CopyFrom(request)
        again.uid = f"{secrets.token_hex(6)}-{secrets.randbelow(1 << 16)}"  # a fresh micro-batch for each
        timeout, limit = self.cfg.security.probe_timeout, self.cfg.server.max_tensor_elements
        if isinstance(again, stage_pb2.BackwardRequest):
            response, returned = await client.backward(endpoint, again, payloads, timeout=timeout, peer=pid)
        else:
            response, returned = await client.forward(endpoint, again, payloads, timeout=timeout, peer=pid)
        return answer_of(response, returned, limit), int(response.epoch)

    def _probe(self, stage: int):
        """A request as a trainer's would be at `stage`: random token ids (stage 0) or hidden states; the last
        stage gets targets and a dry backward (nothing is added to its accumulator)."""
        model = self.spec.model
        seq = min(32, model.max_seq_len)
        if stage == 0:
            inputs = torch.randint(0, model.vocab_size, (PROBE_ROWS, seq), dtype=torch.int32)
        else:
            inputs = torch.randn(PROBE_ROWS, seq, model.hidden_size)
        if stage == self.spec.stages.num_stages - 1:
            targets = torch.randint(0, model.vocab_size, (PROBE_ROWS, seq), dtype=torch.int32)
            request = stage_pb2.BackwardRequest(
                run_id=self.spec.name,
                stage=stage,
                targets=codec.encode(targets),
                output_codec=tensor_pb2.NONE,
                dry=True,
            )
        else:
            request = stage_pb2.ForwardRequest(
                run_id=self.spec.name, stage=stage, output_codec=tensor_pb2.NONE, train=True
            )
        request.inputs.CopyFrom(codec.encode(inputs))
        return request, {}
