"""Dynamic batching: concurrent requests for one expert merged into one batch for the torch thread.

A batch holds at most `max_rows` rows (tokens). While a batch runs, new requests queue and form
the next one, so under load the batches grow by themselves. When other requests for the expert
are under way, a batch also waits up to `max_wait` for them to join it; a lone caller never waits.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class _Item:
    rows: int
    request: Any
    future: asyncio.Future


class Batcher:
    def __init__(self, run: Callable[[list[Any]], Awaitable[list[Any]]], max_rows: int, max_wait: float):
        self.run, self.max_rows, self.max_wait = run, max_rows, max_wait
        self.queue: collections.deque[_Item] = collections.deque()
        self._arrived = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self.batches = self.requests = 0  # counters, to see what batching gives
        self.pending = 0  # requests submitted and not answered yet

    async def submit(self, rows: int, request: Any) -> Any:
        """Queue one request of `rows` rows; its result once its batch has run."""
        future = asyncio.get_running_loop().create_future()
        self.queue.append(_Item(rows, request, future))
        self._arrived.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._work())
        self.pending += 1  # less one when its batch has run (in _work), so the next batch sees who is left
        return await future

    async def _collect(self) -> list[_Item]:
        loop = asyncio.get_running_loop()
        batch = [self.queue.popleft()]
        rows, deadline = batch[0].rows, loop.time() + self.max_wait
        while True:
            while self.queue and rows + self.queue[0].rows <= self.max_rows:
                item = self.queue.popleft()
                batch.append(item)
                rows += item.rows
            remaining = deadline - loop.time()
            alone = self.pending <= len(batch)  # nobody else is under way: waiting gains nothing
            if self.queue or rows >= self.max_rows or remaining <= 0 or alone:
                return batch
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                return batch

    async def _work(self) -> None:
        while self.queue:
            collected = await self._collect()
            batch = [item for item in collected if not item.future.cancelled()]
            self.pending -= len(collected) - len(batch)
            if not batch:
                continue
            self.batches += 1
            self.requests += len(batch)
            try:
                results = await self.run([item.request for item in batch])
            except Exception as e:  # every request of the batch gets the error
                results = [e] * len(batch)
                failed = True
            else:
                failed = False
            self.pending -= len(batch)
            for item, result in zip(batch, results, strict=True):
                if item.future.done():
                    continue
                if failed:
                    item.future.set_exception(result)
                else:
                    item.future.set_result(result)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
