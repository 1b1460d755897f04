"""Where a backward may already be held: the one server it goes to again (peer.trainer.calls).

A server that added a backward and then gave no answer (frozen just after adding it, its answer lost) holds it:
sent to another replica, it would be counted twice. Asked again, the server answers it again without adding it (it
knows the uids it added), or adds it now. So a backward that got no answer of the server's own (a deadline that
passed, a broken stream; a refusal with a reason added nothing) goes to that server only:

- while the server's record has not been refreshed since then, it is frozen (or gone): the backward waits, until the
  record expires and the server is taken for lost (one that thaws after that drops its accumulator): then the
  backward counts anywhere;
- once it shows it lives (its record refreshed since, by the clocks' 1 s tolerance, or a good answer to another
  call), it gets one more try, with the longest deadline (trainer.request_timeout) within the bound. Refused with
  a reason (busy, late, at another step), it is asked again when its failure ban ends. Failed otherwise (no answer
  again, a wrong answer, or one that says the fault is ours), it withholds what it took, or cannot serve it: it is
  avoided for trainer.max_ban s, whatever it answers meanwhile, and the backward goes to another replica;
- trainer.unanswered_wait bounds the whole, but never below a record's longest life (a frozen server is waited for
  until it is lost); a server still not lost then is avoided too. The stage's only routable replica is never
  avoided (that would stall the stage for nothing).

A leaving server (its answer or record says so) is asked too: it still answers a backward it added, adding nothing,
and refuses any other as leaving (then the backward goes anywhere); its refusal as leaving shows it lives.

Still counted twice: an honest server that freezes again during its one more try for longer than it (and its
record lives on); one that refuses every ask with a reason until the bound; one that added the backward, stepped it
and left before it was asked again (gone, it answers nothing).

A killed start's journal names the server it sent a backward to and got no answer from (peer.trainer.trainer): that
one is insisted on while it lives and serves that stage, however long it is banned or behind."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Insist:
    pid: str  # the server that may hold the backward
    since: float  # time.time() it gave no answer (the call's start, for a journal's)
    journal: bool = False  # named by a killed start's journal: insisted on while it lives
    retried: bool = False  # its one more try went out (and has not been refused with a reason since)
    alive: bool = False  # it showed it lives since it gave no answer (its record refreshed, or another answer)
    refused: bool = False  # a try was refused with a reason: the next waits for its failure ban to end
