"""The engine on a thread of its own: HTTP handlers submit and abort requests, the thread steps the engine.

The engine is not thread-safe, so exactly one thread touches it. Handlers (on the asyncio event loop)
put commands on a queue; the engine thread applies them between steps (a request that arrives while a
step runs joins the next one: continuous batching across HTTP requests) and hands each new token to
the request's stream with ``call_soon_threadsafe``. While nothing is waiting or running it sleeps on
the queue instead of spinning.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from ..engine import Engine, Request, RequestRecord, StepOutput

log = logging.getLogger("minillm.serving")
RECORDS_KEPT = 4096  # finished requests whose engine records the server keeps (oldest dropped first)


@dataclass(frozen=True)
class AddRequest:
    """Queue ``request``, whose tokens go to ``stream``; the server received it at ``received``
    (``time.perf_counter()``)."""

    request: Request
    stream: RequestStream
    received: float


@dataclass(frozen=True)
class AbortRequest:
    """End a waiting or running request: its client left (``reason`` "client"), or its text reached a stop
    string ("stop", which the engine records as finished)."""

    request_id: str
    reason: str = "client"


@dataclass(frozen=True)
class Stop:
    """Abort what is left and end the engine thread."""


@dataclass(frozen=True)
class FailAll:
    """End every waiting and running request with ``error`` (the server is shutting down); keep serving."""

    error: Exception


Command = AddRequest | AbortRequest | Stop | FailAll  # what handlers put on ``EngineLoop.commands``


class RequestStream:
    """The ``StepOutput`` s of one request, as an async iterator that ends after the finished one.

    ``close()`` aborts the request in the engine if it has not finished (its client left)."""

    def __init__(self, owner: EngineLoop, request_id: str, loop: asyncio.AbstractEventLoop):
        self.owner, self.request_id, self.loop = owner, request_id, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False
        owner.in_flight += 1  # on the event loop, as every change of in_flight

    def put(self, item: StepOutput | Exception) -> None:
        """Called on the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StepOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, Exception):
            self._end()
            raise item
        if item.finished:
            self._end()
        return item

    def _end(self) -> None:
        if not self.done:
            self.done = True
            self.owner.in_flight -= 1

    def close(self, reason: str = "client") -> None:
        """End the request in the engine if it has not ended: its client left, or ("stop") a stop string."""
        if not self.done:
            self._end()
            self.owner.abort(self.request_id, reason)


class EngineLoop:
    """Owns an ``Engine`` and the thread that drives it (``start`` / ``stop``)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.streams: dict[str, RequestStream] = {}  # engine thread only
        self.records: deque[RequestRecord] = deque(maxlen=RECORDS_KEPT)
        self.records_lock = threading.Lock()
        self.in_flight = 0  # requests submitted and not yet ended (event loop only): the admission count
        self.stats = engine.load()  # after the latest step or command (what /health reports)
        self.thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left, end the thread."""
        self.commands.put(Stop())
        self.thread.join(timeout)

    def submit(self, request: Request, received: float) -> RequestStream:
        """Queue ``request``, which reached the server at ``time.perf_counter()`` = ``received`` (call on
        the event loop; check ``engine.rejection`` first)."""
        stream = RequestStream(self, request.request_id, asyncio.get_running_loop())
        self.commands.put(AddRequest(request, stream, received))
        return stream

    def abort(self, request_id: str, reason: str = "client") -> None:
        self.commands.put(AbortRequest(request_id, reason))

    def fail_all(self, error: Exception) -> None:
        """End every request in flight with ``error`` (its stream gets it); later requests are served."""
        self.commands.put(FailAll(error))

    def finished_records(self, offset: int = 0, limit: int | None = None) -> tuple[list[RequestRecord], int]:
        """(records ``offset`` to ``offset + limit`` of those kept, oldest first; how many are kept)."""
        with self.records_lock:
            total = len(self.records)
            end = total if limit is None else min(total, offset + limit)
            return [self.records[i] for i in range(min(offset, total), end)], total

    # ---- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            commands = []
            try:  # block only when idle; between steps take whatever has arrived
                commands.append(self.commands.get(block=not self.engine.has_unfinished()))
                while True:
                    commands.append(self.commands.get_nowait())
            except queue.Empty:
                pass
            for command in commands:
                if isinstance(command, Stop):
                    self._abort_all(RuntimeError("the server is shutting down"))
                    return
                if isinstance(command, AddRequest):
                    self._add(command)
                elif isinstance(command, FailAll):
                    self._abort_all(command.error)
                else:
                    self._abort(command.request_id, command.reason)
            outputs = self._step() if self.engine.has_unfinished() else []
            self.stats = self.engine.load()
            for out in outputs:
                self.streams[out.request_id].put(out)
                if out.finished:
                    del self.streams[out.request_id]

    def _add(self, command: AddRequest) -> None:
        # it arrived when the server received it, not when this thread got to it after the step in flight
        # (as in an offline run, where a request arriving mid-step waits for the step's end)
        request, stream = command.request, command.stream
        arrival = self.engine.clock() - (time.perf_counter() - command.received)
        try:
            self.engine.add_request(request, arrival_time=arrival)
        except ValueError as error:
            stream.put(error)
            return
        self.streams[request.request_id] = stream

    def _abort(self, request_id: str, reason: str) -> None:
        record = self.engine.abort(request_id, reason)
        if record is not None:
            self.streams.pop(request_id, None)
            self._keep(record)

    def _step(self) -> list[StepOutput]:
        try:
            result = self.engine.step()
        except Exception as error:  # fail the requests in flight, keep serving
            log.exception("engine step failed")
            self._abort_all(RuntimeError(f"engine step failed: {error!r}"))
            return []
        for record in result.ended:
            self._keep(record)
        return result.outputs

    def _abort_all(self, error: Exception) -> None:
        """End every request in flight with ``error`` (the engine records them as failed)."""
        for request_id, stream in list(self.streams.items()):
            record = self.engine.abort(request_id, "error")
            if record is not None:
                self._keep(record)
            stream.put(error)
        self.streams.clear()

    def _keep(self, record: RequestRecord) -> None:
        with self.records_lock:
            self.records.append(record)
