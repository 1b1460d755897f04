"""Where a backward may already be held: the one server it goes to again (peer.trainer.calls).

A server that added a backward and then gave no answer (frozen just after adding it, its answer lost) holds it:
sent to another replica, it would be counted twice. Asked again, the server answers it again without adding it (it
knows the uids it added), or adds it now. So a backward that got no answer of the server's own (a deadline that
passed, a broken stream; a refusal with a reason added nothing) goes to that server only:

- while the server's record has not been refreshed since then, it is frozen (or gone): the backward waits, until the
  record expires and the server is taken for lost (one that thaws after that drops its accumulator): then the
  backward counts anywhere;
- once its record is refreshed (it lives, and announces), it gets one more try, with the longest deadline
  (trainer.request_timeout). A failure again (no answer, or one that says the fault is ours) means it withholds
  what it took, or cannot serve it: it is avoided for trainer.max_ban s, whatever it answers meanwhile, and the
  backward goes to another replica;
- trainer.unanswered_wait bounds the whole, but never below a record's longest life (a frozen server is waited for
  until it is lost).

A killed start's journal names the server it sent a backward to and got no answer from (peer.trainer.trainer): that
one is insisted on while it lives, however long it is banned or behind."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Insist:
    pid: str  # the server that may hold the backward
    since: float  # time.time() it gave no answer (the call's start, for a journal's)
    journal: bool = False  # named by a killed start's journal: insisted on while it lives
    retried: bool = False  # its one more try (after its record was refreshed) went out
