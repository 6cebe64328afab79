"""One client cannot take the server from the others: a client that stops reading its stream holds no admission
slot once the engine is done with it and is cut off after ``--send-timeout``; a request that arrives during a
flood of big bodies is served at once; pages of the engine's records are small; the server exits 0 on SIGTERM
when it watches its standard input. Each server here is the tiny model on 127.0.0.1."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from minillm import ByteTokenizer
from minillm.engine import Engine, EngineConfig, Request
from minillm.serving import launch_server
from minillm.serving.launch import free_port
from minillm.serving.limits import Admission
from minillm.serving.loop import EngineLoop
from minillm.serving.output import OutputProcessor

pytestmark = pytest.mark.slow  # starts servers

TIMEOUT = 30  # s, any one HTTP call
TINY = ["--model", "tiny", "--device", "cpu", "--threads", "1", "--no-access-log"]
ONE_TOKEN = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}


def stalled_stream(port: int, max_tokens: int = 2000) -> socket.socket:
    """A chat stream of ``max_tokens`` tokens with 20 log-probs each (about 2.5 KB of events a token) on a
    socket with a tiny receive buffer, never read."""
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens,
                       "ignore_eos": True, "logprobs": True, "top_logprobs": 20, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return sock


def wait_for_engine(server, ended: int, seconds: float = 90) -> dict:
    """/health once ``ended`` requests have finished or been aborted and nothing runs or waits."""
    deadline = time.monotonic() + seconds
    while True:
        health = server.health()
        if health["finished"] + health["aborted"] >= ended and health["running"] + health["waiting"] == 0:
            return health
        assert time.monotonic() < deadline, f"the engine is still busy: {health}"
        time.sleep(0.2)


def test_a_client_that_stops_reading_holds_no_slot_once_the_engine_is_done():
    """Two streams nobody reads, on a server that admits two requests: once the engine has ended them the
    server is idle, and a new request is served, not refused with 429."""
    with launch_server(TINY + ["--max-batch-size", "2", "--max-waiting", "0"], startup_timeout=60) as server:
        stalled = [stalled_stream(server.port) for _ in range(2)]
        try:
            wait_for_engine(server, 2)
            response = httpx.post(f"{server.url}/completions", json=ONE_TOKEN, timeout=TIMEOUT)
            assert response.status_code == 200, response.text
        finally:
            for sock in stalled:
                sock.close()


def read_all(sock: socket.socket, seconds: float) -> bytes:
    sock.settimeout(seconds)
    data = b""
    while piece := sock.recv(1 << 20):
        data += piece
    return data


def test_a_stream_whose_client_takes_nothing_is_cut_off_after_the_send_timeout():
    with launch_server(TINY + ["--send-timeout", "1"], startup_timeout=60) as server:
        with stalled_stream(server.port) as sock:
            wait_for_engine(server, 1)
            time.sleep(2)  # the last send waits at most 1 s more
            events = read_all(sock, 10)
        assert events.startswith(b"HTTP/1.1 200") and b"data: {" in events
        assert not events.rstrip().endswith(b"data: [DONE]")  # cut off, not finished
        assert httpx.post(f"{server.url}/completions", json=ONE_TOKEN, timeout=TIMEOUT).status_code == 200
        assert "took nothing for 1 s" in server.log_text()


def test_a_stream_not_read_past_its_buffer_is_aborted(tiny_model):
    """The engine stops working for a stream whose client has left ``max_buffered_outputs`` outputs untaken."""
    async def main():
        loop = EngineLoop(Engine(tiny_model, EngineConfig(num_blocks=32)), max_buffered_outputs=8)
        loop.start()
        try:
            slot = Admission(1, 1).admit()
            loop.submit(Request("never-read", [5, 6, 7], 300, ignore_eos=True),
                        OutputProcessor(ByteTokenizer(), []), slot, time.perf_counter())
            deadline = time.monotonic() + TIMEOUT
            while slot.admission is not None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            while not loop.records.rows and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return slot, loop.records.rows[0]
        finally:
            loop.stop()

    slot, record = asyncio.run(main())
    assert slot.admission is None  # the slot was given back: the engine ended the request
    assert (record.status, record.reason) == ("aborted", "client") and record.completion_tokens < 300


def test_a_request_during_a_flood_of_big_bodies_is_answered_at_once():
    """60 bodies of 4 MiB of token ids sent at once, then a one-token request: it does not wait behind them."""
    size = 4 * 2**20
    ids = json.dumps({"model": "tiny", "prompt": [7] * (size // 3), "max_tokens": 1}).encode()
    big = ids[:ids.rfind(b",", 0, size - 32)] + b'], "max_tokens": 1}'
    with launch_server(TINY, startup_timeout=60) as server:
        def flood():
            try:
                with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                 b"application/json\r\nContent-Length: %d\r\n\r\n" % len(big) + big)
                    sock.recv(100)
            except OSError:  # refused before the body was all sent
                pass

        threads = [threading.Thread(target=flood) for _ in range(60)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        start = time.perf_counter()
        response = httpx.post(f"{server.url}/completions", json=ONE_TOKEN, timeout=TIMEOUT)
        took = time.perf_counter() - start
        for t in threads:
            t.join(120)
    assert response.status_code == 200 and took < 1.5, f"{took:.2f} s"


def test_a_page_of_records_is_small_by_default():
    with launch_server(TINY, startup_timeout=60) as server:
        with httpx.Client(timeout=TIMEOUT) as client:
            for _ in range(120):
                assert client.post(f"{server.url}/completions", json=ONE_TOKEN).status_code == 200
            page = client.get(f"{server.base}/minillm/requests").json()
    assert len(page["requests"]) == 100 and page["total"] >= 120 and page["next_offset"] == 100


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT])
def test_a_server_watching_its_standard_input_exits_0_on_a_signal(how):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "minillm", "serve", *TINY, "--port", str(port),
                                "--exit-with-parent"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        process.send_signal(how)
        assert process.wait(20) == 0, process.stdout.read().decode(errors="replace")[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
