"""What one client may cost the server, and how it ends: a failed step ends the requests in flight and the server
goes on, a body limit, prompts refused by their length before they are tokenized, tokenizing off the event loop,
bounded pages and a bounded ring of records, bounded chat templates, stop strings, a bounded waiting queue (429 +
Retry-After), header and body timeouts, a graceful SIGTERM, clear exit codes for a port in use and a pool that
cannot be allocated.

Every server here is the tiny model on 127.0.0.1; traffic is bounded in count and time."""
from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from conftest import TIMEOUT, wait_until_idle

from minillm import ByteTokenizer, generate
from minillm.engine import Engine, EngineConfig, Request, RequestRecord, Status
from minillm.serving import launch_server
from minillm.serving.app import create_app
from minillm.serving.launch import free_port
from minillm.serving.limits import Admission, ServerLimits
from minillm.serving.loop import EngineLoop
from minillm.serving.output import OutputProcessor
from minillm.serving.prepare import Prepare
from minillm.serving.protocol import ApiError
from minillm.serving.records import PAGE_TOKEN_TIMES, Records
from minillm.serving.turns import Turns

pytestmark = pytest.mark.slow  # starts servers

HEADERS = {"Content-Type": "application/json"}


async def drain(stream) -> list:
    return [out async for out in stream]


def run_on_loop(loop: EngineLoop, requests: list[Request]) -> list:
    """Submit every request at once; per request, its token ids or the exception that ended it."""
    async def main():
        admission = Admission(len(requests), 1)
        streams = [loop.submit(r, OutputProcessor(ByteTokenizer(), []), admission.admit(), time.perf_counter())
                   for r in requests]
        results = await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams), return_exceptions=True),
                                         TIMEOUT)
        assert admission.in_flight == 0  # every slot given back once the engine ended its request
        return [r if isinstance(r, BaseException) else [t for out in r for t in out.token_ids] for r in results]

    return asyncio.run(main())


# ---- a failure: the requests in flight end with an error, the server keeps serving ----------------------------
def test_a_step_that_fails_as_a_whole_fails_the_batch_and_is_counted(tiny_model, monkeypatch):
    engine = Engine(tiny_model, EngineConfig(num_blocks=32, block_size=16))
    real_run, calls = engine.runner.run, []

    def run(plan):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the model call failed")
        return real_run(plan)

    monkeypatch.setattr(engine.runner, "run", run)
    loop = EngineLoop(engine, Turns())
    loop.start()
    try:
        results = run_on_loop(loop, [Request(f"r{i}", [5, 6, 7 + i], 40, ignore_eos=True) for i in range(3)])
        assert all(isinstance(r, RuntimeError) and "engine step failed" in str(r) for r in results)
        deadline = time.monotonic() + TIMEOUT
        while loop.stats.running + loop.stats.waiting and time.monotonic() < deadline:
            time.sleep(0.01)  # the stats are taken after the step's streams have their errors
        assert loop.stats.failed == 3  # counted in /health
        assert {r.request_id for r in loop.records.rows} == {"r0", "r1", "r2"}  # and recorded
        after = run_on_loop(loop, [Request("next", [5, 6], 4, ignore_eos=True)])  # the server keeps serving
        assert after == [generate(tiny_model, [5, 6], 4)]
    finally:
        loop.stop()


@contextlib.contextmanager
def inprocess_server(engine: Engine, tokenizer=None, **limits):
    """create_app over ``engine``, served by uvicorn on a thread of this process (so that a test can patch
    the engine); its base URL and the app."""
    import uvicorn

    app = create_app(tokenizer or ByteTokenizer(), engine, "tiny", ServerLimits(**limits))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)


def sse_lines(response) -> list[str]:
    return [line for line in response.iter_lines() if line.startswith("data: ")]


# ---- a body limit, tokenizing off the event loop, over-long prompts refused first ------------------------------
@pytest.fixture(scope="module")
def limited():
    args = ["--model", "tiny", "--device", "cpu", "--threads", "1", "--max-batch-size", "1", "--max-waiting", "1",
            "--num-blocks", "256", "--max-body-bytes", "100000", "--header-timeout", "1", "--body-timeout", "1",
            "--max-messages", "8", "--no-access-log"]
    with launch_server(args, startup_timeout=60) as s:
        yield s


def test_a_body_over_the_limit_is_a_413_naming_the_limit(limited):
    body = json.dumps({"model": "tiny", "prompt": "x" * 200_000, "max_tokens": 1}).encode()
    response = httpx.post(f"{limited.url}/completions", content=body, headers=HEADERS, timeout=TIMEOUT)
    assert response.status_code == 413, response.text
    assert "100000 bytes" in response.json()["error"]["message"] and "--max-body-bytes" in response.text

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny", "max_tokens": 1, "prompt": "'
        for _ in range(30):
            yield b"y" * 5000
        yield b'"}'

    response = httpx.post(f"{limited.url}/completions", content=chunks(), headers=HEADERS, timeout=TIMEOUT)
    assert response.status_code == 413 and "100000 bytes" in response.text
    assert httpx.post(f"{limited.url}/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                      timeout=TIMEOUT).status_code == 200


class NoEncoding(ByteTokenizer):
    def encode(self, *args, **kwargs):
        raise AssertionError("tokenized a prompt that its length already refuses")


def test_an_over_long_prompt_is_refused_before_it_is_tokenized(tiny_model):
    engine = Engine(tiny_model, EngineConfig(num_blocks=8, block_size=16))  # at most 129 tokens
    prepare = Prepare(NoEncoding(), engine, "tiny", ServerLimits())
    with pytest.raises(ApiError) as info:
        prepare(json.dumps({"model": "tiny", "prompt": "z" * 130}).encode(), chat=False)
    assert (info.value.status, info.value.param) == (400, "prompt") and "before tokenizing" in info.value.message
    with pytest.raises(ApiError) as info:
        prepare(json.dumps({"model": "tiny", "prompt": [5] * 129}).encode(), chat=False)
    assert info.value.param == "prompt" and "no room for a reply" in info.value.message


def test_a_big_prompt_does_not_freeze_health_or_the_streams(tiny_model):
    """20 MB of prompt text: refused quickly (400 naming the prompt), while /health keeps answering."""
    engine = Engine(tiny_model, EngineConfig(num_blocks=32, block_size=16))
    with inprocess_server(engine, max_body_bytes=64 * 2**20, max_transit_bytes=64 * 2**20) as (base, _):
        worst, done = [0.0], threading.Event()

        def ping():
            with httpx.Client(timeout=TIMEOUT) as client:
                while not done.is_set():
                    start = time.perf_counter()
                    client.get(f"{base}/health")
                    worst[0] = max(worst[0], time.perf_counter() - start)
                    time.sleep(0.02)

        pinger = threading.Thread(target=ping)
        pinger.start()
        time.sleep(0.2)
        body = json.dumps({"model": "tiny", "prompt": "x" * 20_000_000, "max_tokens": 1}).encode()
        start = time.perf_counter()
        response = httpx.post(f"{base}/v1/completions", content=body, headers=HEADERS, timeout=TIMEOUT)
        took = time.perf_counter() - start
        time.sleep(0.2)
        done.set()
        pinger.join(TIMEOUT)
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
        assert "before tokenizing" in response.json()["error"]["message"]
        assert worst[0] < 1.0, f"/health waited {worst[0]:.2f} s during the big request ({took:.2f} s)"


# ---- /minillm/requests is paged, and its records bounded ---------------------------------------------------------
def test_the_records_are_paged(limited):
    for _ in range(5):
        assert httpx.post(f"{limited.url}/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2,
                                                              "ignore_eos": True}, timeout=TIMEOUT).status_code == 200
    first = httpx.get(f"{limited.base}/minillm/requests", params={"limit": 2}, timeout=TIMEOUT).json()
    assert len(first["requests"]) == 2 and first["total"] >= 5 and first["next_offset"] == 2
    second = httpx.get(f"{limited.base}/minillm/requests", params={"limit": 2, "offset": 2}, timeout=TIMEOUT).json()
    assert len(second["requests"]) == 2 and not {r["id"] for r in first["requests"]} & {
        r["id"] for r in second["requests"]}
    bare = httpx.get(f"{limited.base}/minillm/requests", params={"limit": 1, "token_times": "false"},
                     timeout=TIMEOUT).json()
    assert bare["requests"][0]["token_times"] is None
    for params in ({"limit": 100_000}, {"limit": 0}, {"offset": -1}):
        response = httpx.get(f"{limited.base}/minillm/requests", params=params, timeout=TIMEOUT)
        assert response.status_code == 400 and response.json()["error"]["param"] in params


def long_record(i: int, tokens: int = 2047) -> RequestRecord:
    return RequestRecord(f"r{i}", Status.FINISHED, "max_tokens", 1, [5] * tokens, 0.0,
                         [0.001 * t for t in range(tokens)], 2.0, 0)


def test_a_full_ring_of_long_records_gives_a_bounded_page(tiny_model):
    from starlette.testclient import TestClient

    app = create_app(ByteTokenizer(), Engine(tiny_model, EngineConfig(num_blocks=8, block_size=16)), "tiny")
    records = app.state.engine_loop.records
    for i in range(1000):  # the engine thread is not started: the records are kept by hand
        records.keep(long_record(i))
    with TestClient(app, base_url="http://localhost") as client:
        response = client.get("/minillm/requests", params={"limit": 1000})
    assert response.status_code == 200 and len(response.content) < 1_000_000, len(response.content)
    page = response.json()
    assert page["requests"][-1]["id"] == "r999" and page["next_offset"] == len(page["requests"]) < 1000
    assert sum(len(r["token_times"]) for r in page["requests"]) <= PAGE_TOKEN_TIMES


def test_the_ring_of_records_is_bounded_in_token_times_and_keeps_no_tokens():
    """Long records fill the ring by their token times, not their count: the oldest go first, and what is
    kept is what the endpoint publishes (no token ids)."""
    records = Records(kept=4096, kept_token_times=10_000)
    for i in range(50):
        records.keep(long_record(i, tokens=1000))
    kept = list(records.rows)
    assert [r.request_id for r in kept] == [f"r{i}" for i in range(40, 50)] and records.token_times == 10_000
    assert all(not hasattr(r, "output_ids") for r in kept)
    assert json.loads(records.page(0, 3))["next_offset"] == 3


# ---- what rendering a chat template may cost ----------------------------------------------------------------------
def test_chat_messages_are_capped(limited):
    messages = [{"role": "user", "content": "a"}] * 9
    response = httpx.post(f"{limited.url}/chat/completions", json={"model": "tiny", "messages": messages,
                                                                   "max_tokens": 1}, timeout=TIMEOUT)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert "limit of 8" in response.json()["error"]["message"]


class HugeTemplate(ByteTokenizer):
    chat_template = "{% for m in messages %}{{ m.content * 1000 }}{% endfor %}"

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(m["content"] * 1000 for m in messages)

    def encode_chat(self, messages, add_generation_prompt=True):
        raise AssertionError("encoded a rendered prompt that its length already refuses")


def test_a_rendered_chat_prompt_longer_than_the_context_is_refused_before_encoding(tiny_model):
    engine = Engine(tiny_model, EngineConfig(num_blocks=8, block_size=16))
    prepare = Prepare(HugeTemplate(), engine, "tiny", ServerLimits())
    with pytest.raises(ApiError) as info:
        prepare(json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "abc"}]}).encode(), chat=True)
    assert info.value.param == "messages" and "the template renders" in info.value.message


# ---- stop strings ------------------------------------------------------------------------------------------------
def test_stop_text_holds_back_what_may_begin_a_stop_string():
    from minillm.serving.output import StopText

    stops = StopText(["END", "xy"])
    assert stops.push("abcE") == ("abc", False)
    assert stops.push("N") == ("", False)
    assert stops.push("q") == ("ENq", False)
    assert stops.push("zzx") == ("zz", False)
    assert stops.push("y tail") == ("", True)
    other = StopText(["ab"])
    assert other.push("a") == ("", False) and other.flush() == "a"


@pytest.fixture(scope="module")
def plain():
    with launch_server(["--model", "tiny", "--device", "cpu", "--threads", "1", "--num-blocks", "64",
                        "--no-access-log"], startup_timeout=60) as s:
        yield s


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_text_before_it(plain, chat, stream):
    tokenizer = ByteTokenizer()
    path = "/chat/completions" if chat else "/completions"
    body = {"model": "tiny", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    body |= {"messages": [{"role": "user", "content": "Once"}]} if chat else {"prompt": "Once"}
    whole = httpx.post(f"{plain.url}{path}", json=body, timeout=TIMEOUT).json()
    text = whole["choices"][0]["message"]["content"] if chat else whole["choices"][0]["text"]
    assert len(tokenizer.encode(text)) >= 30
    stop = text[20:23]
    expected = text[:text.find(stop)]
    request = body | {"stop": ["never-seen-here", stop], "stream": stream}
    if stream:
        with httpx.stream("POST", f"{plain.url}{path}", json=request, timeout=TIMEOUT) as response:
            lines = sse_lines(response)
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        pieces = [c["choices"][0]["delta"].get("content", "") if chat else c["choices"][0]["text"] for c in chunks]
        got, finish, request_id = "".join(pieces), chunks[-1]["choices"][0]["finish_reason"], chunks[0]["id"]
    else:
        reply = httpx.post(f"{plain.url}{path}", json=request, timeout=TIMEOUT).json()
        choice = reply["choices"][0]
        got, finish = (choice["message"]["content"] if chat else choice["text"]), choice["finish_reason"]
        assert reply["usage"]["completion_tokens"] < 40
        request_id = reply["id"]
    assert (got, finish) == (expected, "stop")
    assert wait_until_idle(plain)["kv_blocks_used"] == 0
    kept = httpx.get(f"{plain.base}/minillm/requests", params={"limit": 5}, timeout=TIMEOUT).json()["requests"]
    record = next(r for r in kept if r["id"] == request_id)
    assert (record["status"], record["reason"]) == ("finished", "stop") and record["completion_tokens"] < 40


def test_stop_and_logprobs_are_checked_by_name(plain):
    for extra, param, words in (({"stop": ["a"] * 5}, "stop", "at most 4"), ({"stop": [""]}, "stop", "1 to 256"),
                                ({"logprobs": 6}, "logprobs", "between 0 and 5")):
        response = httpx.post(f"{plain.url}/completions", json={"model": "tiny", "prompt": "Hi"} | extra,
                              timeout=TIMEOUT)
        assert response.status_code == 400 and response.json()["error"]["param"] == param
        assert words in response.json()["error"]["message"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 21}
    response = httpx.post(f"{plain.url}/chat/completions", json=chat, timeout=TIMEOUT)
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"
    assert "between 0 and 20" in response.json()["error"]["message"]


# ---- backpressure and slow clients --------------------------------------------------------------------------------
def test_a_full_queue_answers_429_with_retry_after(limited):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=TIMEOUT) as a, httpx.Client(timeout=TIMEOUT) as b:
        with a.stream("POST", f"{limited.url}/completions", json=body) as first, \
                b.stream("POST", f"{limited.url}/completions", json=body) as second:
            assert first.status_code == second.status_code == 200
            response = httpx.post(f"{limited.url}/completions", json=body | {"stream": False}, timeout=TIMEOUT)
            assert response.status_code == 429 and response.headers["Retry-After"] == "1"
            assert "--max-waiting" in response.json()["error"]["message"]
    assert wait_until_idle(limited)["kv_blocks_used"] == 0
    assert httpx.post(f"{limited.url}/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1},
                      timeout=TIMEOUT).status_code == 200


def test_a_connection_that_never_finishes_its_headers_is_closed(limited):
    with socket.create_connection(("127.0.0.1", limited.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        start = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the server (a timeout here raises)
        assert time.monotonic() - start < 4


def test_a_body_that_never_arrives_is_a_408(limited):
    with socket.create_connection(("127.0.0.1", limited.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\":")
        reply, deadline = b"", time.monotonic() + 4
        while b"arrive" not in reply and time.monotonic() < deadline:
            data = sock.recv(4096)
            if not data:
                break
            reply += data
        assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in reply


# ---- shutdown and exit codes ---------------------------------------------------------------------------------------
def test_once_shutdown_begins_new_requests_get_a_503(tiny_model):
    with inprocess_server(Engine(tiny_model, EngineConfig(num_blocks=8, block_size=16))) as (base, app):
        one_token = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}
        assert httpx.post(f"{base}/v1/completions", json=one_token, timeout=TIMEOUT).status_code == 200
        app.state.begin_shutdown()
        response = httpx.post(f"{base}/v1/completions", json=one_token, timeout=TIMEOUT)
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert "shutting down" in response.json()["error"]["message"]


class SlowTokenizer(ByteTokenizer):
    def encode(self, *args, **kwargs):
        time.sleep(1.0)
        return super().encode(*args, **kwargs)


def test_a_prompt_that_takes_too_long_to_prepare_is_a_503(tiny_model):
    engine = Engine(tiny_model, EngineConfig(num_blocks=8, block_size=16))
    with inprocess_server(engine, tokenizer=SlowTokenizer(), prepare_timeout=0.2) as (base, _):
        response = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1},
                              timeout=TIMEOUT)
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert "preparing the prompt took more than 0.2 s" in response.json()["error"]["message"]


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "minillm", "serve", "--model", "tiny", "--device", "cpu", "--threads", "1",
            "--host", "127.0.0.1", "--no-access-log", *args]


def test_sigterm_ends_a_running_stream_with_an_error_event_and_done_then_exits_0():
    port = free_port()
    process = subprocess.Popen(serve_command("--port", str(port), "--shutdown-timeout", "0.5"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{base}/health", timeout=2)
                break
            time.sleep(0.1)
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=TIMEOUT) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 1:
                        process.send_signal(signal.SIGTERM)
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert "shutting down" in error["message"]
        assert len(lines) < 2000
        assert process.wait(15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_port_in_use_has_its_own_exit_code_and_a_one_line_message():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(serve_command("--port", str(port)), capture_output=True, text=True, timeout=90)
    assert done.returncode == 4, done.stderr
    assert "already in use" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_pool_that_cannot_be_allocated_is_a_clear_error(capsys):
    from minillm.serving.cli import main

    assert main(["--model", "tiny", "--device", "cpu", "--port", "0", "--num-blocks", str(10**12)]) == 2
    err = capsys.readouterr().err
    assert "--num-blocks 1000000000000" in err and "bytes" in err and "Traceback" not in err
    needed = 10**12 * 16 * 2 * torch.finfo(torch.float32).bits // 8  # a lower bound: K and V, one float each
    assert any(word.isdigit() and int(word) >= needed for word in err.replace("(", " ").split())
