"""The server's boundary, seen from a client on 127.0.0.1 with raw sockets where httpx would hide the wire:
bodies that cannot be parsed or typed are a 400 in OpenAI's shape, a connection that goes on sending after
its response is closed, a request the server will not read to its end says ``Connection: close``, headers and
bodies are bounded, a web page cannot drive the loopback server, and bodies in transit are bounded in bytes.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from minillm.serving import launch_server

pytestmark = pytest.mark.slow  # starts servers

TIMEOUT = 30  # s, any one HTTP call
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server():
    args = ["--model", "tiny", "--device", "cpu", "--threads", "1", "--num-blocks", "64", "--max-body-bytes",
            "100000", "--header-timeout", "2", "--body-timeout", "2", "--no-access-log"]
    with launch_server(args, startup_timeout=60) as s:
        yield s


def post(server, body: dict | bytes, path: str = "/v1/completions", headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.base}{path}", content=content, headers=headers or JSON, timeout=TIMEOUT)


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# ---- bodies: parsed and typed, never a 500 -----------------------------------------------------------------
@pytest.mark.parametrize("raw", [
    b'{"model": "tiny", "prompt": "Hi", "max_tokens": 1, "x": ' + b"[" * 2000 + b"]" * 2000 + b"}",
    b"[" * 100_000,
    b'{"model": "tiny", "prompt": "Hi", "max_tokens": 1, "x": ' + b"1" * 5000 + b"}",
    b'{"model": "tiny", "prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}",
], ids=["deep-array-in-an-ignored-field", "unterminated-deep-array", "huge-integer-ignored", "huge-max-tokens"])
def test_deep_json_and_huge_integers_are_a_400(server, raw):
    error = openai_error(post(server, raw), 400)
    assert error["type"] == "invalid_request_error" and "Recursion" not in error["message"]
    assert post(server, {"model": "tiny", "prompt": "Hi", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"temperature": None}), ("/v1/completions", {"top_p": None}),
    ("/v1/completions", {"max_tokens": None}), ("/v1/completions", {"stream": None}),
    ("/v1/chat/completions", {"logprobs": None}), ("/v1/chat/completions", {"temperature": None, "top_p": None}),
    ("/v1/chat/completions", {"stream": None, "max_tokens": None, "top_logprobs": None}),
])
def test_an_explicit_null_means_the_default(server, path, extra):
    body = {"model": "tiny", "max_tokens": 2, "ignore_eos": True} | extra
    body |= {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"}
    response = post(server, body, path)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["choices"][0]["logprobs"] is None
    if extra.get("max_tokens", 0) is None and "chat" not in path:
        assert reply["usage"]["completion_tokens"] == 16  # OpenAI's default for completions


def test_an_unknown_model_is_not_echoed_whole(server):
    error = openai_error(post(server, {"model": "x" * 90_000, "prompt": "Hi"}), 404)
    assert error["param"] == "model" and len(error["message"]) < 1000 and "(90002 characters)" in error["message"]


@pytest.mark.parametrize("query, param", [("limit=abc", "limit"), ("offset=x", "offset"),
                                          ("token_times=maybe", "token_times")])
def test_a_bad_query_parameter_gets_openais_error_shape(server, query, param):
    error = openai_error(httpx.get(f"{server.base}/minillm/requests?{query}", timeout=TIMEOUT), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"


# ---- the wire: raw sockets ---------------------------------------------------------------------------------
def read_response(sock: socket.socket, timeout: float = 5.0) -> tuple[int, dict, bytes]:
    """(status, headers, what came of the body) of one response read from ``sock``."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        assert piece, f"closed before a response: {data!r}"
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        piece = sock.recv(65536)
        if not piece:
            break
        body += piece
    return int(lines[0].split()[1]), headers, body


def closed_within(sock: socket.socket, seconds: float, drip: bytes = b"x", every: float = 0.2) -> float | None:
    """Keep sending ``drip`` every ``every`` s and reading; the seconds until the server closed the connection
    (None if it was still open after ``seconds``)."""
    start = time.monotonic()
    sock.settimeout(every)
    while time.monotonic() - start < seconds:
        try:
            sock.sendall(drip)
        except OSError:  # reset or broken pipe: closed
            return time.monotonic() - start
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - start
        except TimeoutError:
            pass
        except OSError:
            return time.monotonic() - start
    return None


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


@pytest.mark.parametrize("head, first, status", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
     b"Content-Length: 1000000000\r\n\r\n", b"{", 413),
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n", b"1\r\nx\r\n", 200),
    (b"POST /v1/nothing HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
     b"Content-Length: 5000\r\n\r\n", b"{", 404),
    (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
     b"Content-Length: 5000\r\n\r\n", b'{"model":', 408),
], ids=["413", "health-with-a-body", "404", "408"])
def test_a_connection_that_goes_on_sending_after_its_response_is_closed(server, head, first, status):
    with connect(server) as sock:
        sock.sendall(head + first)
        got, headers, _ = read_response(sock)
        assert got == status
        assert headers.get("connection") == "close"  # the body was not read to its end
        took = closed_within(sock, 8.0, drip=b"1\r\ny\r\n" if b"chunked" in head else b"y")
        assert took is not None and took < 4, f"still open after {took} s"


def test_content_length_with_transfer_encoding_closes_the_connection(server):
    body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 1}).encode()
    with connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        status, headers, _ = read_response(sock)
        assert status == 200 and headers.get("connection") == "close"
        assert closed_within(sock, 4.0, drip=b"") is not None


@pytest.mark.parametrize("ending", [b"\r\n\r\n", b""], ids=["whole", "never-ending"])
def test_headers_of_100_kb_are_refused(server, ending):
    """A 431 whether the server reads the headers whole (the middleware refuses them) or in pieces (h11
    refuses to buffer more than the limit): which of the two happens to headers sent at once is up to the
    kernel; headers that never end are always read in pieces."""
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (100_000 if ending else 20_000) + ending
    with connect(server) as sock:
        sock.sendall(head)
        status, headers, body = read_response(sock)
        assert status == 431 and headers.get("connection") == "close"
        assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"


# ---- a web page cannot drive the loopback server -----------------------------------------------------------
BODY = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 1}).encode()


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"])
def test_a_body_that_is_not_json_is_a_415(server, kind):
    error = openai_error(post(server, BODY, headers={"Content-Type": kind}), 415)
    assert "application/json" in error["message"]


@pytest.mark.parametrize("headers, words", [
    ({"Host": "evil.example"}, "evil.example"), ({"Host": "evil.example:80"}, "evil.example"),
    ({"Origin": "http://evil.example"}, "http://evil.example"), ({"Origin": "null"}, "null"),
])
def test_a_foreign_host_or_origin_is_refused(server, headers, words):
    for method, path in (("POST", "/v1/completions"), ("GET", "/health"), ("GET", "/minillm/requests")):
        response = httpx.request(method, f"{server.base}{path}", content=BODY if method == "POST" else None,
                                 headers=JSON | headers, timeout=TIMEOUT)
        error = openai_error(response, 403)
        assert words in error["message"]


@pytest.mark.parametrize("headers", [{"Host": "localhost"}, {"Host": "127.0.0.1:1"}, {"Host": "[::1]:8000"},
                                     {"Origin": "http://localhost:8000"}, {"Origin": "http://127.0.0.1"}])
def test_loopback_hosts_and_origins_are_served(server, headers):
    assert post(server, BODY, headers=JSON | headers).status_code == 200


# ---- bodies in transit: bounded in bytes -------------------------------------------------------------------
def vm_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_concurrent_bodies_at_the_limit_are_bounded_in_memory():
    """40 bodies of 4 MiB of token ids at once: those beyond the bytes the server takes in at a time are refused
    at once (503, Retry-After), the others parsed one at a time; the server's peak memory grows by far less than
    the bodies' 160 MiB."""
    size = 4 * 2**20
    raw = json.dumps({"model": "tiny", "prompt": [7] * (size // 3 - 20), "max_tokens": 1}).encode()[:size]
    raw = raw[:raw.rfind(b",")] + b"]}"
    args = ["--model", "tiny", "--device", "cpu", "--threads", "1", "--no-access-log"]
    with launch_server(args, startup_timeout=60) as s:
        for _ in range(3):
            assert httpx.post(f"{s.url}/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1},
                              timeout=TIMEOUT).status_code == 200
        before = vm_kb(s.process.pid, "VmRSS")
        statuses: list[int] = []

        def send() -> None:
            try:
                with connect(s) as sock:
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                 b"application/json\r\nContent-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
                    statuses.append(read_response(sock, 60)[0])
            except OSError:  # refused before the whole body was sent: the server closed the connection
                statuses.append(-1)

        threads = [threading.Thread(target=send) for _ in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        growth_mb = (vm_kb(s.process.pid, "VmHWM") - before) / 1024
        assert httpx.post(f"{s.url}/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1},
                          timeout=TIMEOUT).status_code == 200
    assert len(statuses) == 40 and set(statuses) <= {400, 503, -1}, statuses
    assert growth_mb < 120, f"peak RSS grew {growth_mb:.0f} MB for 40 bodies of 4 MiB"
