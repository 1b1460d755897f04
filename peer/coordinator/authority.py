"""The coordinator as the run's certificate authority: who is admitted, credentials, revocations.

Peers ask through the DHT (peer.net.security); the coordinator reads the requests every
`security.requests_period` s, decides by the run spec's `admission.mode`, and answers each under the peer's
own key. Invite codes and revocations live in files beside the coordinator's identity key
(RUN.invites.json, RUN.revoked.json), written by `peer coordinator invite` / `revoke` and re-read
by the running coordinator (every `security.reports_period` s), which publishes the revocation list every
half `admission.refresh` (at most as often as it looks).
Trainers' spot-check reports count toward revoking a server (`admission.revoke_after_reports`); the coordinator
revokes it only once its own probe finds its answers wrong (peer.coordinator.referee). A replica's proof that a
peer signed two different averages of one slice (dht.records.LieProofs) revokes that peer at once: the coordinator
checks both signatures itself (peer.server.slice_word.proves_a_lie).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hmac
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.serialization import load_der_public_key

from dht import keys
from dht.credential import CredentialError, RunAuthority, invite_mac, ownership_proof
from dht.identity import Identity
from dht.node import SwarmDHT
from dht.records import CredentialGrant, CredentialRequest, LieProofs, RevocationList, SpotCheckReport, TrainerRecord
from peer.config import PeerConfig, RunSpec
from peer.coordinator.admission_files import PEER_ROLES, invite_taken, invite_takers, read_json, revoke, take_invite
from peer.coordinator.referee import Referee
from peer.net.security import revocation_periods
from peer.process.status_lines import say
from peer.server.slice_word import proves_a_lie

logger = logging.getLogger(__name__)
GRANT_STORES = 8  # answers stored in the DHT at once
ANSWERED_KEPT = 8192  # requests remembered as answered (and peers as admitted), newest kept


# ---- the running authority ----------------------------------------------------------------
class Authority:
    """Answers credential requests, publishes revocations, acts on spot-check reports (a thread)."""

    def __init__(self, spec: RunSpec, cfg: PeerConfig, identity: Identity, dht: SwarmDHT, invites: Path, revoked: Path):
        self.spec, self.cfg, self.identity, self.dht = spec, cfg, identity, dht
        self.admission = spec.admission
        self.ca = RunAuthority(identity, spec.name)
        self.invites_path, self.revoked_path = invites, revoked
        self.revoked: dict[str, dict] = {}
        self.pardoned: dict[str, float] = {}  # peer id -> when its owner pardoned it (the revocation file's)
        self._answered: OrderedDict[tuple[str, str], float] = OrderedDict()  # (peer, nonce) answered
        self._admitted: OrderedDict[str, float] = OrderedDict()  # peers given a credential: their renewals go first
        self._lock = threading.Lock()
        self.issued = self.refused = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # stores grants a few at a time, for the life of the authority (not a pool per pass)
        self._grant_pool = concurrent.futures.ThreadPoolExecutor(GRANT_STORES, thread_name_prefix="grant")
        self._published = -math.inf  # monotonic time the list was last stored; never yet
        self._revoked_mtime = -1.0
        self._unsaid: list[str] = []  # revocations and pardons read from the file, said once the list is published
        self._requests_stamp: tuple | None = None  # what the coordinator's own DHT node held of them, last pass
        self._requests_due = self._reports_due = 0.0  # monotonic: the next full read of requests, of reports
        self.referee = Referee(spec, cfg, dht)  # probes a reported server before it is revoked
        self._probed: dict[str, float] = {}  # reported peer -> when (monotonic) it may be probed again
        self._requests_every = 0.0  # s between full reads of requests now: grows at rest (security.requests_*)
        self._arrived = False  # a record came under the requests key since the last pass (SwarmDHT.touched)
        self._proofs_due = 0.0  # monotonic: the next read of replicas' proofs (at once when one arrives)
        self._proofs_read: dict[str, float] = {}  # reporter -> its proofs record's time, as last checked
        self._proofs_seen: dict[tuple, float] = {}  # a proof's round -> when this coordinator first saw it

    # ---- the coordinator's own credential ------------------------------------------------------
    def issue_own(self, security) -> tuple[str, str]:
        """peer.net.security's `issue` for the coordinator: its own authority signs it."""
        nonce = os.urandom(16)
        public = security.key.public_key()
        proof = ownership_proof(self.identity, public, nonce)
        cert = self.ca.issue(
            self.identity.peer_id, public, ("coordinator",), nonce, proof, self.admission.credential_ttl
        )
        return _pem(cert), self.ca.pem().decode()

    # ---- deciding ------------------------------------------------------------------------------
    def decide(self, peer_id: str, request: CredentialRequest) -> tuple[str, str]:
        """(certificate PEM, "") or ("", why not) for one request."""
        if peer_id in self.revoked:
            return "", f"peer {peer_id} was revoked ({self.revoked[peer_id].get('reason', 'no reason given')})"
        roles = tuple(request.roles)
        bad = [r for r in roles if r not in PEER_ROLES]
        if not roles or bad:
            return "", f"roles must be some of {', '.join(PEER_ROLES)}, got {list(roles)}"
        try:
            tls_der, nonce = bytes.fromhex(request.tls_key), bytes.fromhex(request.nonce)
            tls_key, proof = load_der_public_key(tls_der), bytes.fromhex(request.proof)
        except (ValueError, TypeError, UnsupportedAlgorithm) as e:  # a key of an algorithm or curve it has not
            return "", f"malformed request: {e}"
        mode = self.admission.mode
        if mode == "allowlist" and peer_id not in self.admission.allowlist:
            return "", f"peer {peer_id} is not on the run's allowlist (admission.allowlist)"
        problem, take = self._check_invite(peer_id, request, tls_der, nonce, roles) if mode == "invite" else ("", "")
        if problem:
            return "", problem
        try:
            cert = self.ca.issue(peer_id, tls_key, roles, nonce, proof, self.admission.credential_ttl)
        except CredentialError as e:
            return "", str(e)
        if take and (problem := take_invite(self.invites_path, take, peer_id)):  # a use is spent on a sound request
            return "", problem  # only (its last use went to another peer meanwhile)
        return _pem(cert), ""

    def _check_invite(self, peer_id: str, request: CredentialRequest, tls_der: bytes, nonce: bytes, roles):
        """(why not, or "", and the invite to take once the credential is issued: "" when none is due)."""
        invites = read_json(self.invites_path).get("invites", {})
        used = {i: e for i, e in invites.items() if isinstance(e, dict) and peer_id in invite_takers(e)}
        take = ""
        if used and (not request.invite or request.invite in used):  # a renewal or a rejoin: its invite's roles
            allowed = {r for e in used.values() for r in e.get("roles", [])}
        else:
            entry = invites.get(request.invite)
            if not request.invite or not isinstance(entry, dict):
                return (
                    "this run admits peers by invite: pass one with --invite CODE (from `peer coordinator invite`)",
                    "",
                )
            mac = invite_mac(entry["secret"], peer_id, tls_der, nonce).encode()
            if not hmac.compare_digest(mac, str(request.invite_mac).encode("utf-8", "replace")):
                return f"invite {request.invite}: the code is wrong", ""
            if problem := invite_taken(entry, request.invite):
                return problem, ""
            allowed, take = set(entry.get("roles", [])), request.invite
        extra = [r for r in roles if r not in allowed]
        return (f"the invite admits roles {sorted(allowed)}, not {extra}", "") if extra else ("", take)

    # ---- the loop ------------------------------------------------------------------------------
    def start(self) -> None:
        """Two loops on threads of their own: credential requests, and revocations with spot-check reports, so a
        flood of requests (throwaway keys in open mode) delays no revocation."""
        self._threads = [
            threading.Thread(target=self._loop, args=(period, steps, rest, touched), name=name, daemon=True)
            for name, period, steps, rest, touched in (
                (
                    "authority-requests",
                    self.cfg.security.requests_period,
                    (self.answer_requests,),
                    self.cfg.security.requests_rest_period,
                    self.dht.touched(keys.credential_requests_key(self.spec.name)),
                ),
                (
                    "authority-revocations",
                    self.cfg.security.reports_period,
                    (self.follow_revocations, self.read_reports, self.read_proofs),
                    0.0,
                    None,
                ),
            )
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        if (touched := self.dht.touched(keys.credential_requests_key(self.spec.name))) is not None:
            touched.set()  # its loop waits on this: it ends now
        self._grant_pool.shutdown(wait=False, cancel_futures=True)

    def _loop(self, period: float, steps, rest: float = 0.0, touched=None) -> None:
        """Run `steps` every `period` s; with `rest`, passes in which no step says it was busy (returns True) grow
        apart, doubling up to `rest` s, and a busy one makes them `period` apart again; with `touched` (an event
        set when a record reaches this coordinator's DHT node: dht.node.SwarmDHT.touched), a pass comes at once."""
        wait = period
        while not self._pause(wait, touched):
            busy = False
            for step in steps:
                try:
                    busy = bool(step()) or busy
                except Exception as e:  # one step of the authority's loop must not end it: tried again next period
                    logger.warning("authority: %s failed: %s", step.__name__, e)
                    busy = True
            wait = period if busy or rest <= period else min(2 * wait, rest)

    def _pause(self, seconds: float, touched) -> bool:
        """Wait `seconds`, or until `touched` is set (then `_arrived`); whether the authority was stopped."""
        if touched is None:
            return self._stop.wait(seconds)
        if touched.wait(seconds):
            self._arrived = True
        touched.clear()
        return self._stop.is_set()

    def answer_requests(self) -> bool:
        """Answer up to admission.max_pending requests not answered yet, renewals of admitted peers first. Decided
        one by one (an invite is used once), the grants are stored a few at a time (a slow store holds no other).

        A pass reads the network only when the coordinator's own DHT node holds something new under the requests
        key (a record arrived there, its validator says, and dht.node.SwarmDHT.local_stamp changed: no network), or
        security.requests_read_period has passed since the last read (a request stored on other nodes only, in a swarm larger than the DHT's replication). Whether the pass
        saw anything new (the next pass comes sooner then)."""
        key = keys.credential_requests_key(self.spec.name)
        arrived, self._arrived = self._arrived, False
        if not arrived and time.monotonic() < self._requests_due and self.dht.touched(key) is not None:
            return False  # nothing reached this node (its validator says so) and no read of the network is due
        try:
            stamp = self.dht.local_stamp(key)
        except Exception:  # the DHT process is busy: read the network as before
            stamp = None
        if stamp is not None and stamp == self._requests_stamp and time.monotonic() < self._requests_due:
            return False
        moved = stamp != self._requests_stamp
        requests = self.dht.get(key, CredentialRequest, gated=False)
        waiting = [(pid, r) for pid, r in requests.items() if (pid, r.nonce) not in self._answered]
        sec = self.cfg.security
        # at rest (nothing waiting) the reads of the network grow apart; a request waiting makes them short again
        self._requests_every = min(2 * self._requests_every, sec.requests_rest_read_period) if not waiting else 0.0
        self._requests_every = max(self._requests_every, sec.requests_read_period)
        self._requests_stamp, self._requests_due = stamp, time.monotonic() + self._requests_every
        waiting.sort(key=lambda item: item[0] not in self._admitted)
        answers = [(pid, request, self._grant(pid, request)) for pid, request in waiting[: self.admission.max_pending]]
        if answers:  # most passes have none: no pool then
            list(self._grant_pool.map(lambda answer: self._store_grant(*answer), answers))
        if any((pid, r.nonce) not in self._answered for pid, r in waiting):
            self._requests_due = 0.0  # more than a pass answers, or a grant's store failed: read again next pass
        return moved or bool(waiting)

    def _grant(self, peer_id: str, request: CredentialRequest) -> CredentialGrant:
        try:
            certificate, error = self.decide(peer_id, request)
        except Exception as e:  # a request malformed some other way is refused, and answered: never the whole pass
            logger.exception("a credential request of %s could not be decided", peer_id)
            certificate, error = "", f"malformed request ({type(e).__name__}: {e})"
        grant = CredentialGrant(nonce=request.nonce, certificate=certificate, error=error)
        if certificate:
            grant.authority = self.ca.pem().decode()
            self.issued += 1
        else:
            self.refused += 1
            logger.warning("refused a credential to %s: %s", peer_id, error)
        return grant

    def _store_grant(self, peer_id: str, request: CredentialRequest, grant: CredentialGrant) -> None:
        ttl = self.cfg.security.admission_timeout + 30.0
        if not self.dht.store(keys.credential_key(self.spec.name, peer_id), grant, ttl):
            return  # answered again on the next pass
        with self._lock:
            self._answered[(peer_id, request.nonce)] = time.time()
            while len(self._answered) > ANSWERED_KEPT:
                self._answered.popitem(last=False)
            if grant.certificate:
                self._admitted[peer_id] = time.time()
                while len(self._admitted) > ANSWERED_KEPT:
                    self._admitted.popitem(last=False)

    def follow_revocations(self) -> None:
        with contextlib.suppress(OSError):
            mtime = self.revoked_path.stat().st_mtime
            if mtime != self._revoked_mtime:
                self._revoked_mtime = mtime
                data = read_json(self.revoked_path)
                found, self.pardoned = data.get("revoked", {}), data.get("pardoned", {})
                new, gone = sorted(set(found) - set(self.revoked)), sorted(set(self.revoked) - set(found))
                self.revoked = found
                self._unsaid += [f"Revoked peer {peer}: {found[peer].get('reason', '')}" for peer in new]
                self._unsaid += [f"Pardoned peer {peer}: it may take part again" for peer in gone]
                if new or gone:
                    self._published = -math.inf
        if self.dht.gate is not None and self.dht.gate.revoked != frozenset(self.revoked):
            self.dht.gate.revoked = frozenset(self.revoked)  # the coordinator's own gate: its list, first hand
        ttl, every = revocation_periods(self.spec, self.cfg)
        if time.monotonic() - self._published >= every:  # unchanged, stored again (a change resets `_published`)
            record = RevocationList(peers=sorted(self.revoked), updated=time.time())
            if self.dht.store(keys.revocations_key(self.spec.name), record, ttl):
                self._published = time.monotonic()
                for words in self._unsaid:  # said once published: what starts from now on reads it
                    say(words)
                self._unsaid = []
            elif self._unsaid:
                logger.warning("the revocation list was not stored in the DHT; trying again")

    def read_reports(self) -> None:
        """Revoke a server reported by admission.revoke_after_reports trainers (only trainers' reports are read:
        dht.records), each with admission.min_reporter_samples samples done, of checks failed within
        admission.report_ttl and after any pardon of that server by the run's owner."""
        needed = self.admission.revoke_after_reports
        if needed <= 0:
            return
        key = keys.reports_key(self.spec.name)
        touched = self.dht.touched(key)  # set when a report reaches this coordinator's own node: read at once
        if time.monotonic() < self._reports_due and not (touched is not None and touched.is_set()):
            return
        if touched is not None:
            touched.clear()
        reports = self.dht.get(key, SpotCheckReport)
        if not reports:  # none (no trainer checks now): read again in coordinator.rest_period, or on a new one
            self._reports_due = time.monotonic() + self.cfg.coordinator.rest_period
            return
        done = {pid: r.samples for pid, r in self.dht.get(keys.trainers_key(self.spec.name), TrainerRecord).items()}
        self.follow_revocations()  # the revocation file read when it changed: its pardons are current
        pardoned = self.pardoned
        oldest = time.time() - self.admission.report_ttl
        reporters: dict[str, set[str]] = {}
        for trainer, report in reports.items():
            if done.get(trainer, 0) < self.admission.min_reporter_samples:
                continue  # a key that has not trained (a throwaway) reports nothing
            for peer in report.wrong:
                # the reporter's word on when: never later than now (a time in the future outlived pardons and ttl)
                caught = min(report.caught.get(peer, report.updated), time.time())
                if caught >= max(oldest, float(pardoned.get(peer, 0.0))):
                    reporters.setdefault(peer, set()).add(trainer)
        for peer, who in reporters.items():
            if len(who) >= needed and peer not in self.revoked and peer != self.identity.peer_id:
                self._judge(peer, len(who))
        self.follow_revocations()

    def read_proofs(self) -> None:
        """Revoke a peer that signed two different averages of one slice, on one replica's proof
        (dht.records.LieProofs): both signatures are checked here (peer.server.slice_word.proves_a_lie), so no
        replica's word is taken. A proof this coordinator first saw before the run owner pardoned the liar counts no
        more (by when it saw it, not by the reporter's word on when; after a restart, a proof stored again counts)."""
        key = keys.proofs_key(self.spec.name)
        touched = self.dht.touched(key)
        if time.monotonic() < self._proofs_due and not (touched is not None and touched.is_set()):
            return
        if touched is not None:
            touched.clear()
        self._proofs_due = time.monotonic() + self.cfg.coordinator.rest_period
        records = self.dht.get(key, LieProofs) or {}
        if len(self._proofs_read) > ANSWERED_KEPT or len(self._proofs_seen) > ANSWERED_KEPT:
            self._proofs_read.clear(), self._proofs_seen.clear()
        for reporter, record in records.items():
            if self._proofs_read.get(reporter) == record.updated:
                continue  # checked as it is
            self._proofs_read[reporter] = record.updated
            for lie in record.proofs:
                liar = lie.liar
                # when this coordinator first saw it, revoked or not: a pardon voids what was seen before it
                seen = self._proofs_seen.setdefault((liar, lie.stage, lie.expert, lie.epoch, *lie.nonces), time.time())
                if liar in self.revoked or liar == self.identity.peer_id or seen < float(self.pardoned.get(liar, 0.0)):
                    continue
                if not proves_a_lie(lie, self.spec.name):
                    continue
                why = f"it signed two different averages of its slice at step {lie.epoch} (proof from {reporter})"
                revoke(self.revoked_path, liar, why)
                logger.warning("authority: revoked %s: %s", liar, why)
                self.follow_revocations()

    def _judge(self, peer: str, reporters: int) -> None:
        """Revoke a server that enough trainers reported only if the coordinator's own probe finds it wrong
        (peer.coordinator.referee: a report is a trainer's word); one it could not judge, or found right, is
        probed again after security.probe_again s."""
        if time.monotonic() < self._probed.get(peer, 0.0):
            return
        wrong, why = self.referee.verdict(peer)
        if wrong:
            revoke(self.revoked_path, peer, f"spot checks of {reporters} trainer(s) found its answers wrong, and {why}")
            self._probed.pop(peer, None)
            return
        if len(self._probed) >= ANSWERED_KEPT:
            self._probed.clear()
        self._probed[peer] = time.monotonic() + self.cfg.security.probe_again
        logger.warning("authority: %d trainer(s) reported %s; not revoked: %s", reporters, peer, why)


def _pem(cert) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()
