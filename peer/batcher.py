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
        self.pending += 1
        try:
            return await future
        finally:
            self.pending -= 1

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
            batch = [item for item in await self._collect() if not item.future.cancelled()]
            if not batch:
                continue
            self.batches += 1
            self.requests += len(batch)
            try:
                results = await self.run([item.request for item in batch])
            except Exception as e:  # every request of the batch gets the error
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(e)
                continue
            for item, result in zip(batch, results, strict=True):
                if not item.future.done():
                    item.future.set_result(result)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
