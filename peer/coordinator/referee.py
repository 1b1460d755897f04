"""The coordinator's own check of a server that trainers reported, before it revokes it.

A report (dht.records.SpotCheckReport) is a trainer's word, and a trainer's key costs nothing in open
admission: two throwaway keys that claim work done could report every honest server. So the reports
only make the coordinator look: it asks the reported server and up to security.probe_partners other
replicas of its stage the same request a spot check sends (a training forward of random inputs under a fresh
uid; on the last stage a dry backward, whose loss and gradients are compared), and revokes only when none of
the others that answered at the reported one's step agrees with it and two of them agree with each other.
Two partners picked at random once let two hostile servers that answer alike (four keys, with two reporters)
get an honest one revoked while honest partners were there to vouch for it. When it cannot tell (fewer than
two others answering at its step, the reported one does not answer), nobody is revoked: the trainers that
caught the server keep it banned, and the reports are looked at again later.

The requests come from the coordinator's key: a server that answers wrong only to others is not
revoked by this (docs/security.md), but no honest server is revoked on reports alone.
"""

from __future__ import annotations

import asyncio
import itertools
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
        asked = [accused, *self.rng.sample(others, min(len(others), max(2, self.cfg.security.probe_partners)))]
        client = StageClient.for_server(self.cfg.server, self.dht.security)
        try:
            answers = await self._at_one_step(client, stage, [records[pid] for pid in asked], asked)
        finally:
            await client.close()
        if isinstance(answers, str):
            return None, answers
        (theirs, epoch), tol = answers, self.cfg.trainer.spot_check_tolerance
        mine, partners = theirs[0], theirs[1:]
        if any(agree(mine, other, tol) for other in partners):
            return False, f"its answer to the coordinator's probe at step {epoch} agrees with its partners'"
        if not any(agree(a, b, tol) for a, b in itertools.combinations(partners, 2)):
            return None, f"the {len(partners)} other replicas of stage {stage} disagree too at step {epoch}"
        return True, (
            f"its answer to the coordinator's probe at step {epoch} differs from all {len(partners)} partners', "
            "two of which agree"
        )

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
        """(answers, step): the accused's (first) answer to one probe and those of its partners that answered at
        its step, once two of them did; asked again while fewer did (one just stepped), up to
        security.probe_tries times (also while a partner that answered is at another step: a hostile pair that
        always answers at its step must not outvote honest partners that just stepped); a string saying why not if
        the accused does not answer or too few partners meet it (a partner that does not answer, or answers at
        another step in the last try, counts for neither side)."""
        sec, said = self.cfg.security, ""
        for attempt in range(sec.probe_tries):
            request, payloads = self._probe(stage)
            tries = [
                self._ask(client, r.endpoint, pid, request, payloads) for r, pid in zip(records, pids, strict=True)
            ]
            answers = await asyncio.gather(*tries, return_exceptions=True)
            if isinstance(answers[0], BaseException):
                return f"{pids[0]} did not answer the coordinator's probe"
            epoch, answered = answers[0][1], [x for x in answers[1:] if not isinstance(x, BaseException)]
            met = [a for a, e in answered if e == epoch]
            # every partner that answered, at its step (else asked again: one just stepped), or the last try's
            if len(met) >= 2 and (len(met) == len(answered) or attempt == sec.probe_tries - 1):
                return [answers[0][0], *met], epoch
            said = f"{len(met)} of its {len(pids) - 1} partners answered the coordinator's probe at its step {epoch}"
            await asyncio.sleep(sec.probe_wait)
        return f"{said}, in {sec.probe_tries} tries"

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
