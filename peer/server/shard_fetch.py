"""A part's state fetched in shards from several donors at once (peer.server.replica_state).

Each donor sends one shard at a time: the next one nobody has asked for yet. A donor whose call fails sends no
more, and its shard goes to the others. A shard still coming after `patience` seconds (and after twice as long
as most shards that came took, up to half a call's deadline) is asked of an idle donor too; the first answer is kept and the other call is
cancelled. So a donor that hangs costs a transfer `patience`, not its call's deadline, while another answers.

ShardFetch runs on the replica's event loop; `fetch(donor, shard)` is the one network call."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any


class ShardFetch:
    """One transfer's shards (`shards`, indices) from `donors`, into `have` (shard -> answer)."""

    def __init__(
        self,
        donors: list,
        shards: list[int],
        fetch: Callable[[Any, int], Awaitable],
        have: dict,
        patience: float,
        longest: float,
    ):
        """`longest`: the most patience the shards that came may raise `patience` to (half a call's deadline)."""
        self.donors, self.fetch, self.have = donors, fetch, have
        self.patience, self.longest = patience, max(patience, longest)
        self.shards, self.unasked = list(shards), [i for i in shards if i not in have]
        # donor index -> (the shard it is sending, since, the call)
        self.running: dict[int, tuple[int, float, asyncio.Task]] = {}
        self.took: list[float] = []  # seconds each shard that came took
        self.failed: dict[int, BaseException] = {}  # donor index -> why its call failed
        self.outrun: set[int] = set()  # donors whose shard came from another donor first
        self.sent: set[int] = set()  # donors that sent a shard that was kept
        self.news = asyncio.Condition()

    def missing(self) -> list[int]:
        return [i for i in self.shards if i not in self.have]

    async def run(self) -> None:
        """Until every shard is in; the first failure if every donor failed with some still missing."""
        workers = [asyncio.create_task(self._serve(k)) for k in range(len(self.donors))]
        try:
            async with self.news:
                await self.news.wait_for(lambda: not self.missing() or len(self.failed) == len(self.donors))
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        if self.missing():
            raise next(iter(self.failed.values()))

    async def _serve(self, k: int) -> None:
        """Donor `k` sends shards until none is missing, or until its call fails."""
        while (shard := await self._next_for(k)) is not None:
            started = time.monotonic()
            call = asyncio.create_task(self.fetch(self.donors[k], shard))
            self.running[k] = (shard, started, call)
            try:
                result = await call
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise
                if shard in self.have:
                    continue  # another donor sent it first (`_done`)
                self.failed[k] = ConnectionError("its call was cancelled")  # its channel closed under it
            except Exception as e:  # a donor may fail in any way (gone, refused, a state not of the step): no more
                self.failed[k] = e
            else:
                if shard not in self.have:
                    self.have[shard] = result
                    self.sent.add(k)
                    self.took.append(time.monotonic() - started)
            finally:
                del self.running[k]
            await self._done(shard)
            if k in self.failed:
                return

    async def _done(self, shard: int) -> None:
        """A call for `shard` ended: if the shard came, the other calls for it are cancelled; if it is still missing
        and nobody else is sending it, it is asked anew."""
        others = {j: call for j, (s, _, call) in self.running.items() if s == shard}
        if shard in self.have:
            for j, call in others.items():
                call.cancel()
                self.outrun.add(j)
        elif not others:
            self.unasked.insert(0, shard)
        async with self.news:
            self.news.notify_all()

    async def _next_for(self, k: int) -> int | None:
        """The shard donor `k` sends next: one nobody asked for, else the one overdue longest (`_overdue`); it
        waits for one while shards are coming from others (None once every shard is in)."""
        async with self.news:
            while self.missing():
                if self.unasked:
                    return self.unasked.pop(0)
                shard, wait = self._overdue()
                if shard is not None:
                    return shard
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.news.wait(), wait)
        return None

    def _overdue(self) -> tuple[int | None, float]:
        """The missing shard whose last ask is oldest, if that was longer ago than the patience, and the seconds
        until the next one is (None, seconds) otherwise."""
        took = sorted(self.took)
        typical = took[(len(took) - 1) // 2] if took else 0.0  # the lower median: one slow shard moves nothing
        patience, now = min(max(self.patience, 2 * typical), self.longest), time.monotonic()
        last: dict[int, float] = {}
        for shard, since, _ in self.running.values():
            last[shard] = max(since, last.get(shard, since))
        if not last:
            return None, patience
        shard = min(last, key=last.get)
        if now - last[shard] >= patience:
            return shard, 0.0
        return None, last[shard] + patience - now
