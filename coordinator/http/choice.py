"""One choice of a response: a generation through Generations.stream (the same path as a gRPC
GenerateStream) on a thread of its own, since the round loop blocks on its gRPC streams, whose deltas
are handed to the request's event loop. close() (the client went away) cancels both services'
session streams at once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from coordinator.generation import Call, ClientRequest, Generations
from coordinator.monitor import Pair
from tandem.text import TextDelta

_END = object()


class Choice:
    """One generation on a thread of its own; its deltas (and then _END, or the error) on a queue
    of the event loop."""

    def __init__(self, generations: Generations, build: Callable[[Pair], ClientRequest],
                 loop: asyncio.AbstractEventLoop):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt_ids: list[int] = []
        self._active = True
        self._cancel: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._loop = loop
        self._build = build
        call = Call(None, lambda: self._active, self._on_cancel)
        threading.Thread(target=self._run, args=(generations, call), name="tandem-http-choice", daemon=True).start()

    def _built(self, pair: Pair) -> ClientRequest:
        request = self._build(pair)
        self.prompt_ids = request.generation.prompt_ids
        return request

    def _run(self, generations: Generations, call: Call) -> None:
        put = self._loop.call_soon_threadsafe
        try:
            for delta in generations.stream(self._built, call):
                put(self.queue.put_nowait, delta)
            put(self.queue.put_nowait, _END)
        except BaseException as exc:  # noqa: BLE001 - handed to the request's handler
            try:
                put(self.queue.put_nowait, exc)
            except RuntimeError:  # the loop is closed: the server stopped
                pass

    def _on_cancel(self, cancel: Callable[[], None]) -> None:
        with self._lock:
            self._cancel = cancel
            gone = not self._active
        if gone:
            cancel()

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def close(self) -> None:
        """The client went away (or another choice failed): free both services' sessions now."""
        with self._lock:
            self._active = False
            cancel = self._cancel
        if cancel is not None:
            cancel()

    async def next(self) -> TextDelta | None:
        """The next delta; None at the end; the generation's error raised."""
        item = await self.queue.get()
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item
