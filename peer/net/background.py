"""An asyncio loop on a thread of its own, for gRPC servers of a process whose main loop is not asyncio
(the coordinator's archive and relay)."""

from __future__ import annotations

import asyncio
import threading


class LoopThread:
    def __init__(self, name: str):
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def _run(self, setup) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(setup())
        except BaseException as e:  # handed to the starting thread, which raises it
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    def start(self, setup, timeout: float = 30.0) -> None:
        """Run coroutine function `setup` on the new loop, then keep the loop running; OSError if it fails."""
        threading.Thread(target=self._run, args=(setup,), name=self.name, daemon=True).start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise OSError(f"the {self.name}'s gRPC server did not start: {self._error or 'timed out'}")

    def call(self, coroutine, timeout: float = 5.0):
        """Run `coroutine` on the loop from another thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
