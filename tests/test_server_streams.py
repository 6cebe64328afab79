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
from minillm.serving.limits import SEND_BUFFER_BYTES, Admission, ServerLimits
from minillm.serving.loop import EngineLoop
from minillm.serving.output import OutputProcessor
from minillm.serving.protocol import ApiError
from minillm.serving.turns import Turns

pytestmark = pytest.mark.slow  # starts servers

TIMEOUT = 30  # s, any one HTTP call
TINY = ["--model", "tiny", "--device", "cpu", "--threads", "1", "--no-access-log"]
ONE_TOKEN = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}


EVENT_BYTES = 1500  # at least: a chat event of one token with 20 log-probs (about 1.56 KB)


def stalled_stream(port: int, max_tokens: int = 2000) -> socket.socket:
    """A chat stream of ``max_tokens`` tokens with 20 log-probs each (``EVENT_BYTES`` of events a token) on a
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


def run_stream(tiny_model, consume, limit: int = 8, max_tokens: int = 300):
    """``consume(stream)`` on one request of ``max_tokens`` tokens, on an engine loop whose streams hold at most
    ``limit`` outputs for a client that does not read; (what it returned, the engine's record)."""
    async def main():
        loop = EngineLoop(Engine(tiny_model, EngineConfig(num_blocks=32)), Turns(),
                          max_buffered_outputs=limit)
        loop.start()
        try:
            slot = Admission(1, 1).admit()
            stream = loop.submit(Request("r", [5, 6, 7], max_tokens, ignore_eos=True),
                                 OutputProcessor(ByteTokenizer(), []), slot, time.perf_counter())
            got = await asyncio.wait_for(consume(stream), TIMEOUT)
            deadline = time.monotonic() + TIMEOUT
            while (slot.admission is not None or not loop.records.rows) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert slot.admission is None  # the slot was given back: the engine ended the request
            return got, loop.records.rows[0]
        finally:
            loop.stop()

    return asyncio.run(main())


def test_a_stream_whose_client_stops_taking_outputs_is_aborted_after_its_limit(tiny_model):
    """The consumer takes one output and never comes back (its send waits on a client that reads nothing):
    the engine stops after ``limit`` more, and a client that reads again finds them, then the error."""
    async def stuck_sending(stream):
        await anext(stream)
        while not stream.ended:  # the send that never ends
            await asyncio.sleep(0.01)
        taken = []
        with pytest.raises(ApiError, match="took none of the last 8 outputs") as error:
            async for out in stream:
                taken.append(out)
        return taken, error.value

    (taken, error), record = run_stream(tiny_model, stuck_sending)
    assert (record.status, record.reason) == ("aborted", "client") and record.completion_tokens < 20
    assert 8 <= len(taken) < 20 and error.status == 408


def test_outputs_that_pile_up_while_the_consumer_waits_abort_nothing(tiny_model):
    """A busy event loop (not a client that does not read) can leave many outputs waiting for a consumer that
    is ready: the request runs to its end."""
    async def ready_but_late(stream):
        async def read_all():
            return [out async for out in stream]

        reader = asyncio.ensure_future(read_all())  # a client that takes every output
        await asyncio.sleep(0.05)  # the reader now waits for its next output
        time.sleep(0.5)  # the event loop is busy elsewhere while the engine steps on: far more than 8 arrive
        await asyncio.sleep(0)  # they are delivered before the reader wakes
        piled = len(stream.outputs)
        return await reader, piled

    (outputs, piled), record = run_stream(tiny_model, ready_but_late)
    assert piled > 8 and (record.status, record.reason) == ("finished", "max_tokens")
    assert sum(len(out.token_ids) for out in outputs) == 300


def test_a_stalled_reader_costs_the_engine_what_its_buffers_hold_not_its_max_tokens():
    """A chat stream of 2,000 tokens with 20 log-probs each, never read: the engine ends it once the
    connection's send buffers (the kernel's ``SEND_BUFFER_BYTES``, counted twice by Linux, and asyncio's
    64 KiB) and ``max_buffered_outputs`` are full."""
    with launch_server(TINY, startup_timeout=60) as server:
        with stalled_stream(server.port):
            wait_for_engine(server, 1)
            record = httpx.get(f"{server.base}/minillm/requests", timeout=TIMEOUT).json()["requests"][-1]
    bound = (2 * SEND_BUFFER_BYTES + 64 * 1024) // EVENT_BYTES + ServerLimits.max_buffered_outputs + 2
    assert (record["status"], record["reason"]) == ("aborted", "client")
    assert record["completion_tokens"] <= bound < 2000


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
