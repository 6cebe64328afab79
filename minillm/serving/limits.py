"""The server's boundary: what one client may cost it, checked before its request reaches the engine.

The route and the engine loop stay plain; everything a hostile or broken client could abuse is bounded here:

- ``Boundary`` (an ASGI middleware, around every request): request headers of at most ``MAX_HEADER_BYTES``
  (431); a server on a loopback address answers only loopback ``Host`` names, and any server only ``Origin`` s
  of its own host (403), and a POST body must say ``application/json`` (415), so a web page cannot drive it;
  a response sent before the request's body was read to its end, or to a request with both Content-Length
  and Transfer-Encoding, says ``Connection: close`` (uvicorn then closes the connection, which would
  otherwise live as long as its client drips bytes); a response whose client takes nothing for
  ``send_timeout`` seconds is abandoned and its connection closed.
- ``Bodies``: a body of at most ``max_body_bytes`` (413), received within ``body_timeout`` (408), and at most
  ``max_transit_bytes`` of bodies being received or parsed at once (503).
- ``Admission``: the one count of requests in flight (429 beyond ``capacity``, 503 once shutting down).
- ``Preparer``: the heavy work of a request (parsing its body, the chat template, tokenizing, rendering a page
  of records) runs one job at a time on a thread of its own, smallest first, and its large jobs take at most
  ``share`` (a tenth) of the time: ``json`` and pydantic hold the GIL while they work, so this is what keeps a
  flood of big bodies from starving the engine thread and the event loop (which take ``turns``).
- ``connection_protocol``: uvicorn's HTTP/1.1 protocol with a deadline for a connection's next request
  (``header_timeout``); uvicorn has no setting for it.
"""
from __future__ import annotations

import asyncio
import contextlib
import heapq
import ipaddress
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from .protocol import ApiError

log = logging.getLogger("minillm.serving")
MAX_HEADER_BYTES = 16 * 1024  # the request line and headers (h11's own bound on headers that arrive in pieces)
# A connection's kernel send buffer (Linux's own grows to 4 MiB): with asyncio's 64 KiB, what a client that
# stops reading leaves unsent before its stream's outputs pile up (``max_buffered_outputs``); at 100 ms
# round trips it still carries 1.3 MB/s, far more than a stream of tokens.
SEND_BUFFER_BYTES = 128 * 1024


@dataclass(frozen=True)
class ServerLimits:
    """What one client may cost the server (``python -m minillm serve`` sets them from its flags)."""

    max_body_bytes: int = 4 * 1024 * 1024  # a larger request body is a 413
    max_transit_bytes: int = 16 * 1024 * 1024  # bodies being received or parsed, all together; beyond: 503
    body_timeout: float = 30.0  # s to receive a whole body, else 408
    header_timeout: float = 10.0  # s for a connection's next request headers, else it is closed
    send_timeout: float = 10.0  # s a response may wait for its client to take bytes, else it is abandoned
    max_waiting: int = 128  # requests in flight beyond max_batch_size that may wait; more get a 429
    max_messages: int = 512  # chat messages in one request
    prepare_timeout: float = 30.0  # s to wait for, parse, render the chat template and tokenize, else 503
    shutdown_timeout: float = 5.0  # s the streams running at shutdown may still take before they are ended
    retry_after: int = 1  # s, the Retry-After of a 429 or 503
    max_buffered_outputs: int = 64  # outputs a stream may hold while its client's buffers are full; then aborted


# ---- the ASGI middleware ------------------------------------------------------------------------------------
class ClientStalled(Exception):
    """A response's client took no bytes for ``send_timeout`` seconds."""


class Boundary:
    """ASGI middleware: header size, Host and Origin, JSON bodies, ``Connection: close``, the send timeout.
    ``host``: the address the server listens on (a loopback one makes ``Host`` headers checked)."""

    def __init__(self, app, host: str, send_timeout: float, connections: Connections | None = None):
        self.app, self.send_timeout, self.connections = app, send_timeout, connections
        self.loopback = is_loopback(host)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.connections is not None:
            self.connections.busy(scope.get("client"))
        headers = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, value.decode("latin-1"))
        length, chunked = headers.get(b"content-length"), b"transfer-encoding" in headers
        body_read = not chunked and length in (None, "0")
        close = chunked and length is not None  # RFC 9112 6.3: such a request may be smuggled; never reuse

        async def receive_tracked():
            nonlocal body_read
            message = await receive()
            body_read = body_read or (message["type"] == "http.request" and not message.get("more_body", False))
            return message

        async def send_in_time(message):
            if message["type"] == "http.response.start" and (close or not body_read):
                message = message | {"headers": [*message.get("headers", []), (b"connection", b"close")]}
            try:
                async with asyncio.timeout(self.send_timeout):
                    await send(message)
            except TimeoutError:
                raise ClientStalled(f"the client took nothing for {self.send_timeout:g} s") from None
            if message["type"] == "http.response.body" and not message.get("more_body", False) and \
                    self.connections is not None:
                self.connections.idle(scope.get("client"))

        refusal = self.refusal(scope, headers)
        close = close or refusal is not None  # a client refused at the door gets no second request here
        try:
            if refusal is not None:
                response = JSONResponse(refusal.body(), status_code=refusal.status, headers=refusal.headers)
                await response(scope, receive_tracked, send_in_time)
            else:
                await self.app(scope, receive_tracked, send_in_time)
        except ClientStalled as stalled:  # uvicorn closes a connection whose response was left unfinished
            log.warning("closing a response to %s: %s", scope.get("client"), stalled)

    def refusal(self, scope, headers: dict[bytes, str]) -> ApiError | None:
        """Why the request is refused before anything reads it (None: it is not)."""
        size = len(scope["raw_path"]) + len(scope["query_string"]) + sum(
            len(name) + len(value) + 4 for name, value in scope["headers"])
        if size > MAX_HEADER_BYTES:
            return ApiError(431, f"the request line and headers take {size} bytes, more than this server's limit "
                                 f"of {MAX_HEADER_BYTES}", code="request_header_fields_too_large")
        host = headers.get(b"host")
        hostname = urlsplit(f"//{host}").hostname if host else None
        if self.loopback and host is not None and not is_loopback(hostname or ""):
            return ApiError(403, f"the Host header names {host!r}; this server listens on a loopback address and "
                                 "answers only requests for localhost (a web page that rebinds a name to it is "
                                 "refused)", code="forbidden_host")
        origin = headers.get(b"origin")
        if origin is not None:
            origin_host = urlsplit(origin).hostname
            allowed = is_loopback(origin_host or "") if self.loopback else origin_host in (hostname, None) and \
                origin_host is not None
            if not allowed:
                return ApiError(403, f"requests from web pages of other sites (Origin: {origin!r}) are refused",
                                code="forbidden_origin")
        if scope["method"] == "POST":
            kind = headers.get(b"content-type", "").partition(";")[0].strip().lower()
            if kind != "application/json" and not kind.endswith("+json"):
                return ApiError(415, f"the request body must be application/json, not {kind or 'unlabelled'} "
                                     "(Content-Type)", code="unsupported_media_type")
        return None


def is_loopback(host: str) -> bool:
    """``host`` (a name or an address) is this machine's loopback: localhost, 127.0.0.0/8 or ::1."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ---- request bodies ----------------------------------------------------------------------------------------
class Bodies:
    """Reads request bodies within the limits, and counts the bytes of those being received or parsed."""

    def __init__(self, limits: ServerLimits):
        self.limits, self.in_transit = limits, 0  # bytes, changed on the event loop only

    @asynccontextmanager
    async def read(self, http: HTTPRequest):
        """The request's body (bytes); its size counts toward ``max_transit_bytes`` until the block ends (from
        the start, when its Content-Length declares it; else as it arrives)."""
        limit, declared = self.limits.max_body_bytes, http.headers.get("content-length", "")
        too_large = f"more than this server's limit of {limit} bytes (--max-body-bytes)"
        if declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body is {int(declared)} bytes, {too_large}", code="request_too_large")
        held = self._take(int(declared)) if declared.isdigit() else 0
        try:
            chunks, size = [], 0
            async with asyncio.timeout(self.limits.body_timeout):
                async for chunk in http.stream():
                    size += len(chunk)
                    if size > limit:
                        raise ApiError(413, f"the request body is {too_large}", code="request_too_large")
                    held += self._take(max(0, size - held))
                    chunks.append(chunk)
            yield b"".join(chunks)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.limits.body_timeout:g} s",
                           code="timeout") from None
        except ClientDisconnect:
            raise ApiError(400, "the client left before sending the whole body") from None
        finally:
            self.in_transit -= held

    def _take(self, size: int) -> int:
        if self.in_transit + size > self.limits.max_transit_bytes:
            raise ApiError(503, f"the server is receiving {self.in_transit} bytes of request bodies, at most "
                                f"{self.limits.max_transit_bytes} (--max-transit-bytes); retry later",
                           code="server_overloaded", headers={"Retry-After": str(self.limits.retry_after)})
        self.in_transit += size
        return size


# ---- admission ---------------------------------------------------------------------------------------------
class Admission:
    """The one count of requests in flight, changed only here.

    A request takes a slot when it arrives, before its body is read, and gives it back when the engine has
    ended it (or when it was refused before reaching the engine): not when its client has read the last
    event, so a client that stops reading holds no slot once the engine is done with its request."""

    def __init__(self, capacity: int, retry_after: int):
        self.capacity, self.retry_after = capacity, retry_after
        self.in_flight = 0  # changed on the event loop only
        self.closing = False  # set once shutdown begins

    def admit(self) -> Slot:
        """A slot, or ApiError: 503 once shutting down, 429 when ``capacity`` requests are in flight."""
        retry = {"Retry-After": str(self.retry_after)}
        if self.closing:
            raise ApiError(503, "the server is shutting down", code="shutting_down", headers=retry)
        if self.in_flight >= self.capacity:
            raise ApiError(429, f"the server is full: {self.in_flight} requests in flight, at most {self.capacity} "
                                "(max_batch_size + --max-waiting); retry later", code="server_overloaded",
                           headers=retry)
        self.in_flight += 1
        return Slot(self)

    def _release(self) -> None:
        self.in_flight -= 1


class Slot:
    """One request's place in ``Admission``; ``release()`` gives it back (once, whoever calls it first)."""

    def __init__(self, admission: Admission):
        self.admission: Admission | None = admission

    def release(self) -> None:
        if self.admission is not None:
            self.admission, admission = None, self.admission
            admission._release()


# ---- the preparation worker --------------------------------------------------------------------------------
class Preparer:
    """Runs jobs one at a time on a thread of its own, the smallest (by the size given, in bytes) first. A job
    larger than ``small`` bytes waits until the worker has rested ``1 / share - 1`` times as long as the jobs
    before it took, so that those jobs hold the GIL at most ``share`` of the time (the GIL is what parsing a
    big JSON body takes from every other thread while it runs); smaller jobs, an ordinary request's, never
    wait for that rest."""

    def __init__(self, share: float = 0.1, small: int = 64 * 1024):
        self.rest, self.small = 1 / share - 1, small
        self.jobs: list = []  # heap of (size, order, fn, future, event loop)
        self.ready = threading.Condition()
        self.order = itertools.count()
        self.rested_at = 0.0  # time.perf_counter() when a large job may start
        threading.Thread(target=self._work, name="minillm-prepare", daemon=True).start()

    async def run(self, size: int, fn: Callable, *args):
        """``fn(*args)`` on the worker thread, once the jobs smaller than ``size`` ahead of it are done."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self.ready:
            heapq.heappush(self.jobs, (size, next(self.order), lambda: fn(*args), future, loop))
            self.ready.notify()
        return await future

    def _work(self) -> None:
        while True:
            with self.ready:
                while not self.jobs or (self.jobs[0][0] > self.small and time.perf_counter() < self.rested_at):
                    self.ready.wait(max(0.0, self.rested_at - time.perf_counter()) if self.jobs else None)
                _, _, job, future, loop = heapq.heappop(self.jobs)
            if future.cancelled():  # its request ended while it waited (a read across threads: at worst a job
                continue  # done for nothing)
            start = time.perf_counter()
            try:
                result, error = job(), None
            except BaseException as e:  # handed to the request that asked
                result, error = None, e
            with contextlib.suppress(RuntimeError):  # its event loop has closed: nobody waits for it
                loop.call_soon_threadsafe(_settle, future, result, error)
            end = time.perf_counter()
            self.rested_at = max(self.rested_at, end) + self.rest * (end - start)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if not future.done():
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


# ---- connections: a deadline for each request's headers ---------------------------------------------------
class Connections:
    """Closes a connection that has not delivered a whole request's headers ``timeout`` seconds after it opened
    or after its last response ended (it may be dripping headers, or a body after its response: slowloris).

    uvicorn has no such setting (``timeout_keep_alive`` is restarted by every byte that arrives), so this
    knows connections by their peer address: the protocol (``connection_protocol``) registers each one when it
    opens, ``Boundary`` says when a request starts (``busy``) and when its response has ended (``idle``)."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.open: dict[tuple, list] = {}  # peer -> [transport, its timer or None]

    def opened(self, transport) -> None:
        peer = _peer(transport)
        if peer is not None:
            self.open[peer] = [transport, None]
            self.idle(peer)

    def closed(self, transport) -> None:
        self.busy(_peer(transport))
        self.open.pop(_peer(transport), None)

    def busy(self, peer) -> None:
        entry = self.open.get(tuple(peer)) if peer else None
        if entry is not None and entry[1] is not None:
            entry[1].cancel()
            entry[1] = None

    def idle(self, peer) -> None:
        entry = self.open.get(tuple(peer)) if peer else None
        if entry is not None:
            self.busy(peer)
            entry[1] = asyncio.get_running_loop().call_later(self.timeout, entry[0].close)


def _peer(transport) -> tuple | None:
    """The connection's peer as ASGI's ``scope["client"]`` names it: (host, port)."""
    peer = transport.get_extra_info("peername")
    return (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) and len(peer) >= 2 else None


def connection_protocol(connections: Connections):
    """uvicorn's h11 protocol class, telling ``connections`` when each connection opens and closes, and
    answering headers over ``MAX_HEADER_BYTES`` with a 431 however they arrive."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineProtocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.watched = transport
            connections.opened(transport)

        def connection_lost(self, exc) -> None:
            connections.closed(self.watched)
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to bytes h11 cannot parse. Headers that arrive in one read reach ``Boundary``,
            whatever their size, and get its 431; those that arrive in pieces make h11 refuse the connection
            once it buffers more than ``MAX_HEADER_BYTES`` without their end: they get the same 431 here."""
            buffered, _ = self.conn.trailing_data
            if len(buffered) <= MAX_HEADER_BYTES:
                return super().send_400_response(msg)
            error = ApiError(431, f"the request line and headers take more than this server's limit of "
                                  f"{MAX_HEADER_BYTES} bytes", code="request_header_fields_too_large")
            body = json.dumps(error.body()).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                       (b"connection", b"close")]
            head = h11.Response(status_code=431, headers=headers, reason=b"Request Header Fields Too Large")
            for event in (head, h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return DeadlineProtocol
