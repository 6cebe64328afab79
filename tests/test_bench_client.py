"""``python -m minillm bench``: chunk timestamps become vLLM's metrics (checked on a scripted server with a
fake clock), failures are counted, and on a real minillm server the client's numbers equal the engine's
own plus the HTTP time the client measures."""
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from minillm.analysis.metrics import SLO, e2e_latency, itls, tpot, ttft
from minillm.analysis.workload import poisson_arrivals, random_requests
from minillm.engine import Engine, EngineConfig, Request, RequestRecord, Status
from minillm.sampling import SamplingParams
from minillm.serving import bench as bench_client
from minillm.serving.app import create_app
from minillm.serving.bench import (
    StreamError,
    compare_with_engine,
    fetch_engine_records,
    main,
    parse_slo,
    payload,
    run_benchmark,
    sse_lines,
)
from minillm.serving.launch import free_port
from minillm.serving.records import PAGE_DEFAULT
from minillm.text.byte import ByteTokenizer

pytestmark = pytest.mark.slow  # starts a server


class FakeClock:
    """Seconds that pass only when the scripted server says so."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def scripted_server(clock: FakeClock, scripts: dict):
    """An httpx transport answering each prompt (by its first id) with a script of
    (seconds to wait, event); an int status instead of a script answers with that error."""
    async def handler(request: httpx.Request) -> httpx.Response:
        script = scripts[json.loads(request.content)["prompt"][0]]
        if isinstance(script, int):
            return httpx.Response(script, json={"error": {"message": "no"}})

        async def events():
            for wait, event in script:
                clock.t += wait
                yield f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()

        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def token(text, finish=None, ids=None):
    choice = {"index": 0, "text": text, "finish_reason": finish} | ({"token_ids": ids} if ids else {})
    return {"id": "cmpl-1", "choices": [choice], "usage": None}


def used(n_prompt, n_out):
    return {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out}}


SCRIPTS = {
    1: [(0.100, token("a")), (0.020, token("b")), (0.030, token("c", "length")), (0, used(6, 3)), (0, "[DONE]")],
    2: [(0.050, token("xy", ids=[7, 8])), (0.010, token("z", "length", ids=[9])), (0, used(4, 3)), (0, "[DONE]")],
    3: 400,
    4: [(0.010, token("a")), (0.010, {"error": {"message": "engine failed"}})],
    5: [(0.010, token("a")), (0.010, token("b", "length")), (0, used(2, 3)), (0, "[DONE]")],
}


def run_scripted(**kwargs):
    clock = FakeClock()
    requests = [Request(i, [p, 0, 0], 3) for i, p in enumerate(SCRIPTS)]
    return run_benchmark("http://fake/v1", "m", requests, concurrency=1, clock=clock,
                         transport=scripted_server(clock, SCRIPTS), **kwargs)


def test_chunk_arrival_times_give_vllms_metrics():
    result = run_scripted(slo=SLO(ttft=0.08))
    one, two, bad, broken, short = result.records
    assert one.token_times == pytest.approx([0.1, 0.12, 0.15]) and one.arrival_time == 0
    assert (ttft(one), tpot(one), *itls(one), e2e_latency(one)) == pytest.approx((0.1, 0.025, 0.02, 0.03, 0.15))
    assert (one.text, one.finish_reason, one.usage_tokens, one.prompt_len) == ("abc", "length", 3, 6)
    assert two.arrival_time == pytest.approx(0.15)  # closed loop: sent when the first ended
    assert two.token_times == pytest.approx([0.2, 0.2, 0.21])  # a chunk of two tokens: two equal times
    assert "HTTP 400" in bad.error and bad.token_times == []
    assert "engine failed" in broken.error and broken.token_times == []
    assert result.count_mismatches == 1  # the last one: two chunks, usage says three tokens
    m = result.metrics
    assert (m.n_requests, m.n_completed, m.n_failed, m.output_tokens) == (5, 3, 2, 8)
    assert m.duration == pytest.approx(0.25) and m.output_throughput == pytest.approx(8 / 0.25)
    assert m.n_good == 2  # TTFT 0.1 s misses 80 ms; 50 ms and 10 ms meet it
    assert m.ttft.values == pytest.approx((0.1, 0.05, 0.01))
    saved = json.loads(json.dumps(result.to_json()))
    assert saved["metrics"]["ttft_ms"]["p50"] == pytest.approx(50)
    assert saved["metrics"]["goodput"] == pytest.approx(2 / 0.25)
    assert saved["requests"][2]["error"].startswith("ValueError: HTTP 400")


def test_it_runs_inside_a_running_event_loop_as_in_a_notebook():
    async def in_a_loop():
        return run_scripted()

    assert asyncio.run(in_a_loop()).metrics.n_completed == 3


def test_the_request_body():
    request = Request(0, [1, 2], 5, sampling=SamplingParams(0.7, 20, 0.9), ignore_eos=True, seed=3)
    assert payload("m", request) == {
        "model": "m", "prompt": [1, 2], "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 3,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    assert "top_k" not in payload("m", Request(0, [1], 5)) and "ignore_eos" not in payload("m", Request(0, [1], 5))


def test_slo_and_argument_errors(capsys):
    assert parse_slo(["ttft:300", "tpot:30"]) == SLO(ttft=0.3, tpot=0.03)
    for bad in (["ttft"], ["latency:5"], ["tpot:fast"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_slo(bad)
    for argv, words in ((["--request-rate", "5", "--concurrency", "2"], "not both"),
                        (["--goodput", "ttft:x"], "milliseconds"), (["--prompt-len", "9", "3"], "low 9 > high 3"),
                        (["--request-rate", "0"], "rate=0.0")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and words in capsys.readouterr().err
    assert main(["--url", "http://127.0.0.1:9/v1"]) == 1  # nobody listens on port 9
    assert "cannot list the models" in capsys.readouterr().err


def test_the_client_equals_the_engine_plus_the_http_time_it_measures(server):
    requests = random_requests(16, (8, 48), (4, 16), seed=1, vocab_size=258,
                               arrival_times=poisson_arrivals(16, 40.0, seed=1))
    result = run_benchmark(server.url, "tiny", requests, timeout=30)
    assert result.metrics.n_completed == 16 and result.count_mismatches == 0
    comparison = compare_with_engine(result, fetch_engine_records(server.url))
    assert len(comparison.pairs) == 16
    for (client, engine), request in zip(comparison.pairs, requests):
        n = request.max_tokens
        assert len(client.token_times) == len(engine.token_times) == client.usage_tokens == n
        added_ttft, added_e2e = ttft(client) - ttft(engine), e2e_latency(client) - e2e_latency(engine)
        assert added_ttft >= 0 and added_e2e >= 0  # no token reaches the client before the engine made it
        if n > 1:  # TPOT differs by exactly how much longer the last token's trip was than the first's
            assert tpot(client) - tpot(engine) == pytest.approx((added_e2e - added_ttft) / (n - 1), abs=1e-9)
        assert sum(itls(client)) == pytest.approx(sum(itls(engine)) + added_e2e - added_ttft, abs=1e-9)
    assert comparison.added_ttft.n == 16 and min(comparison.added_ttft.values) >= 0
    closed = run_benchmark(server.url, "tiny", requests[:8], concurrency=4, timeout=30)
    assert closed.metrics.n_completed == 8 and [r.request_id for r in closed.records] == list(range(8))


def test_the_command_line_against_a_server(server, tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["--url", server.url, "--num-requests", "6", "--request-rate", "30", "--prompt-len", "8", "16",
            "--output-len", "4", "8", "--vocab-size", "258", "--goodput", "ttft:1000", "--compare-engine",
            "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "model 'tiny'" in printed and "6 / 6" in printed and "6 requests seen by both" in printed
    saved = json.loads(out.read_text())
    assert saved["metrics"]["completed"] == 6 and saved["arguments"]["request_rate"] == 30
    assert saved["engine"]["metrics"]["completed"] == 6 and len(saved["requests"]) == 6
    for name in ("added_ttft_ms", "added_e2e_ms"):  # numbers in ms, shaped like every other latency
        added = saved["engine"][name]
        assert added.keys() == saved["metrics"]["ttft_ms"].keys() == {"n", "mean", "p50", "p90", "p99"}
        assert added["n"] == 6 and all(isinstance(added[k], float) and added[k] >= 0
                                       for k in ("mean", "p50", "p90", "p99"))
        assert added["p50"] <= added["p99"]


def test_http_errors_are_recorded_not_raised(server):
    result = run_benchmark(server.url, "no-such-model", [Request(0, [1, 2], 3)], timeout=30)
    assert result.metrics.n_failed == 1 and "HTTP 404" in result.records[0].error
    assert bench_client.list_models(server.url) == ["tiny"]


# ---- broken servers: every failure is a counted request with its reason, and the run always ends ----------
# Each is a real HTTP server on 127.0.0.1, started by the test. A request picks its behaviour by the path
# (http://127.0.0.1:PORT/<mode>/v1) or, under /any/v1, by its prompt's first id (an index into MODES).
def _tok(text, finish=None):
    return json.dumps({"id": "cmpl-x", "choices": [{"index": 0, "text": text, "finish_reason": finish}]})


USAGE = json.dumps({"id": "cmpl-x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
MODES = {  # mode: the SSE events (None: special), and the words its failure's reason must hold
    "ok": ([_tok("a"), _tok("b", "length"), USAGE, "[DONE]"], None),
    "truncated": ([_tok("a"), _tok("b")], "without [DONE] or a finish_reason"),
    "nondict": ([_tok("a"), "[1, 2, 3]"], "JSON list"),
    "number": (["42"], "JSON int"),
    "badchoice": ([_tok("a"), json.dumps({"choices": "x"})], "choices is not a list"),
    "badchoiceitem": ([json.dumps({"choices": [1]})], "choices is not a list"),
    "badusage": ([_tok("a", "length"), json.dumps({"choices": [], "usage": 5})], "usage is not an object"),
    "badids": ([json.dumps({"choices": [{"text": "a", "token_ids": 7}]})], "token_ids is not a list"),
    "notjson": (["{oops"], "not JSON"),
    "doneonly": (["[DONE]"], "without a token ([DONE] only)"),
    "json200": (None, "without a token"),
    "drip": (None, "no token for"),  # an SSE comment every 0.1 s, never a token
    "slow": (None, "took more than"),  # a token every 0.1 s, never an end
    "forever": (None, "more tokens than"),  # 100 tokens a second, never an end
    "noline": (None, "no token for"),  # 1 KB every 50 ms, never a line break
    "slowheaders": (None, "no token for"),  # a response header that never ends
    "drip-stream": (None, "no token for"),  # a valid stream, a byte every 0.3 s
}
MODE_NAMES = list(MODES)
DEADLINE_MODES = ("drip", "slow", "forever", "noline", "slowheaders", "drip-stream")


class _FakeServer:
    def __init__(self):
        import http.server
        import threading

        modes = MODES

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def mode(self, body=None) -> str:
                name = self.path.strip("/").split("/")[0]
                if name == "any" and body is not None:
                    return MODE_NAMES[json.loads(body)["prompt"][0]]
                return name

            def reply(self, status, body: bytes, kind="application/json"):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                mode = self.mode()
                if mode == "models-drip" and self.path.endswith("/v1/models"):
                    return self.drip(b'{"data": [{"id": "fake"}]}', 0.5)
                if mode == "pages-forever" and "/minillm/requests" in self.path:
                    offset = int(self.path.partition("offset=")[2].partition("&")[0] or 0)
                    page = {"requests": [], "total": 10**9, "offset": offset, "next_offset": offset + 1}
                    return self.reply(200, json.dumps(page).encode())
                if self.path.endswith("/v1/models"):
                    self.reply(200, json.dumps({"data": [{"id": "fake"}]}).encode())
                else:  # /minillm/requests of a server that is not minillm
                    self.reply(200, b"<html>not a minillm server</html>", "text/html")

            def drip(self, data: bytes, every: float, head: bool = True) -> None:
                """Send ``data`` a byte at a time (bounded: 20 s at most)."""
                try:
                    if head:
                        self.send_response(200)
                        self.send_header("Content-Type", "application/json")
                        self.end_headers()
                    end = time.monotonic() + 20
                    for byte in data:
                        if time.monotonic() > end:
                            return
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(every)
                except OSError:  # the client left
                    pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                mode = self.mode(body)
                mode = "ok" if mode == "pages-forever" else mode  # its records are what is broken
                if mode == "slowheaders":  # a status line, then a header that never ends
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Slow: ")
                    return self.drip(b"a" * 100, 0.5, head=False)
                if mode == "drip-stream":  # a valid stream, a byte every 0.3 s
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    events = [_tok("a"), _tok("b", "length"), USAGE, "[DONE]"]
                    return self.drip("".join(f"data: {e}\n\n" for e in events).encode(), 0.3, head=False)
                if mode == "json200":
                    return self.reply(200, json.dumps({"id": "cmpl-x", "choices": [{"text": "hi"}]}).encode())
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()  # HTTP/1.0: the body ends when the connection closes
                try:
                    if mode in ("drip", "slow", "forever", "noline"):
                        end = time.monotonic() + 20  # bounded even if the client never leaves
                        piece = {"drip": b": ping\n\n", "slow": f"data: {_tok('a')}\n\n".encode(),
                                 "forever": f"data: {_tok('a')}\n\n".encode() * 10, "noline": b"x" * 1024}[mode]
                        while time.monotonic() < end:
                            self.wfile.write(piece)
                            self.wfile.flush()
                            time.sleep(0.05 if mode == "noline" else 0.1)
                        return
                    for event in modes[mode][0]:
                        self.wfile.write(f"data: {event}\n\n".encode())
                        self.wfile.flush()
                except OSError:  # the client left
                    pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.port}/{mode}/v1"


@pytest.fixture(scope="module")
def fake():
    fake_server = _FakeServer()
    yield fake_server
    fake_server.httpd.shutdown()
    fake_server.httpd.server_close()


def bounded(fn, seconds: float = 30):
    """fn() on a thread; its result, or a test failure (not a hang) if it raises or takes longer."""
    import threading

    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as error:  # reported below
            out["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    assert "error" not in out, f"the run raised {out.get('error')!r}"
    return out["value"]


def test_every_broken_stream_is_a_failed_request_with_its_reason(fake):
    modes = [m for m in MODE_NAMES if m not in DEADLINE_MODES]  # those: the deadlines' tests below
    requests = [Request(i, [MODE_NAMES.index(m), 1, 2], 2) for i, m in enumerate(modes)]
    result = bounded(lambda: run_benchmark(fake.url("any"), "fake", requests, concurrency=4, timeout=5.0))
    by_mode = dict(zip(modes, result.records))
    assert by_mode["ok"].error is None and len(by_mode["ok"].token_times) == 2
    for mode in modes[1:]:
        record, words = by_mode[mode], MODES[mode][1]
        assert record.error and words in record.error and record.token_times == [], (mode, record.error)
    m = result.metrics
    assert (m.n_requests, m.n_completed, m.n_failed) == (len(modes), 1, len(modes) - 1)


def test_a_request_that_never_ends_fails_at_its_deadline(fake):
    requests = [Request(0, [MODE_NAMES.index("slow"), 1], 1000), Request(1, [MODE_NAMES.index("ok"), 1], 2)]
    result = bounded(lambda: run_benchmark(fake.url("any"), "fake", requests, timeout=5.0, request_timeout=1.0), 15)
    slow, ok = result.records
    assert "took more than 1 s" in slow.error and slow.token_times == [] and ok.error is None


def test_a_server_that_only_sends_keep_alive_comments_cannot_hang_the_run(fake):
    result = bounded(lambda: run_benchmark(fake.url("drip"), "fake", [Request(0, [1, 2], 4)], timeout=1.0), 15)
    assert result.metrics.n_failed == 1 and "no token for 1 s" in result.records[0].error


def test_the_command_line_reports_why_requests_failed_and_always_writes_its_json(fake, tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["--url", fake.url("truncated"), "--num-requests", "3", "--prompt-len", "2", "4", "--output-len", "2",
            "2", "--timeout", "5", "--json", str(out)]
    assert bounded(lambda: main(argv)) == 1  # nothing completed
    printed = capsys.readouterr().out
    assert "0 / 3" in printed and "3 request(s) failed" in printed and "without [DONE]" in printed
    saved = json.loads(out.read_text())
    assert saved["metrics"]["failed"] == 3 and all("without [DONE]" in r["error"] for r in saved["requests"])

    assert bounded(lambda: main(["--url", fake.url("drip"), "--num-requests", "2", "--timeout", "0.5",
                                 "--concurrency", "2"])) == 1
    assert "2 x StreamError: no token for 0.5 s" in capsys.readouterr().out


def test_a_failed_engine_comparison_is_a_message_and_the_json_is_still_written(fake, tmp_path, capsys):
    out = tmp_path / "run.json"  # --compare-engine against a server that is not minillm
    argv = ["--url", fake.url("ok"), "--num-requests", "3", "--prompt-len", "2", "4", "--output-len", "2", "2",
            "--timeout", "5", "--json", str(out), "--compare-engine"]
    assert bounded(lambda: main(argv)) == 1
    printed = capsys.readouterr().out
    assert "3 / 3" in printed and "--compare-engine: no comparison" in printed
    saved = json.loads(out.read_text())
    assert saved["metrics"]["completed"] == 3 and "error" in saved["engine"]


@pytest.mark.parametrize("argv, words", [(["--concurrency", "0"], "--concurrency 0"),
                                         (["--request-timeout", "0"], "--request-timeout 0")])
def test_bad_limits_are_usage_errors(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and words in capsys.readouterr().err


# ---- servers that take only text, as llama-cpp-python's: text prompts, and tokens counted right ----------
class _TextOnlyServer:
    """Like llama-cpp-python's server: a prompt of token ids is a 500 ("Input should be a valid string"); a
    stream is one chunk per token (no token_ids, no usage), then a last chunk with no text that only gives the
    finish_reason, then [DONE]. ``ignore_eos`` is ignored, ``min_tokens`` honoured. Under /interrupt/v1 a
    stream ends with [DONE] after 2 tokens and no finish_reason, as when a newer request interrupts it; under
    /interrupt/v1 and /lenient/v1 a prompt of ids is taken too."""

    def __init__(self):
        import http.server
        import threading

        seen = self.bodies = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, body: dict):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply(200, {"data": [{"id": "/models/some-model.Q4_1.gguf", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                seen.append(body)
                if not isinstance(body["prompt"], str) and not self.path.startswith(("/interrupt", "/lenient")):
                    return self.reply(500, {"error": {"message": "[{'type': 'string_type', 'loc': ('body', "
                                                                 "'prompt', 'str'), 'msg': 'Input should be a "
                                                                 "valid string'}]"}})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                n = 2 if self.path.startswith("/interrupt") else body.get("min_tokens") or 3
                events = [{"id": "cmpl-t", "choices": [{"text": " w", "index": 0, "finish_reason": None}]}] * n
                if not self.path.startswith("/interrupt"):
                    events.append({"id": "cmpl-t", "choices": [{"text": "", "index": 0, "finish_reason": "length"}]})
                for event in [*map(json.dumps, events), "[DONE]"]:
                    self.wfile.write(f"data: {event}\n\n".encode())
                    self.wfile.flush()

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()


@pytest.fixture(scope="module")
def text_only():
    text_server = _TextOnlyServer()
    yield text_server
    text_server.httpd.shutdown()
    text_server.httpd.server_close()


def test_a_text_only_server_is_measured_with_text_prompts(text_only, capsys):
    argv = ["--url", text_only.url, "--num-requests", "4", "--prompt-len", "8", "16", "--output-len", "5", "5",
            "--concurrency", "2", "--request-timeout", "20"]
    assert bounded(lambda: main(argv + ["--prompt-format", "ids"])) == 1  # what llama.cpp answers to ids
    printed = capsys.readouterr().out
    assert "0 / 4" in printed and "4 x ValueError: HTTP 500" in printed and "valid string" in printed
    del text_only.bodies[:]
    assert bounded(lambda: main(argv + ["--prompt-format", "text", "--tokenizer", "bytes", "--min-tokens"])) == 0
    printed = capsys.readouterr().out
    assert "sent as text (random ids decoded with the bytes tokenizer)" in printed and "4 / 4" in printed
    assert "Output tokens                     20" in printed  # 5 each: the last chunk, with no text, counts none
    assert "output tokens counted from:\n  one token per chunk (no token_ids, no usage) for 4" in printed
    assert all(isinstance(b["prompt"], str) and 8 <= len(b["prompt"]) <= 16 and b["min_tokens"] == 5
               for b in text_only.bodies)


def test_a_stream_that_ends_with_done_but_no_finish_reason_is_a_failed_request(text_only):
    requests = [Request(0, [1, 2, 3], 5)]
    url = text_only.url.replace("/v1", "/interrupt/v1")
    result = bounded(lambda: run_benchmark(url, "m", requests, timeout=5.0))
    record = result.records[0]
    assert record.error and "no choice gave a finish_reason (interrupted" in record.error
    assert result.metrics.n_failed == 1


def test_a_last_chunk_with_only_a_finish_reason_is_not_a_token(text_only):
    requests = [Request(i, [1, 2, 3], 3) for i in range(2)]
    url = text_only.url.replace("/v1", "/lenient/v1")
    result = bounded(lambda: run_benchmark(url, "m", requests, timeout=5.0))
    assert [len(r.token_times) for r in result.records] == [3, 3] and result.metrics.output_tokens == 6


def test_text_prompts_and_the_request_body():
    prompts = bench_client.TextPrompts("bytes")
    text, n = prompts.text([0, 1, 94, 95, 300])
    assert (text, n) == (" !~ /", 5) and text.isprintable()
    assert payload("m", Request(0, [1, 2], 5, ignore_eos=True), prompt="hi", min_tokens=True) == {
        "model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0.0, "top_p": 1.0, "ignore_eos": True,
        "min_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    with pytest.raises(ValueError, match="no tokenizer for 'gpt-4'"):
        bench_client.load_tokenizer("gpt-4")
    assert bench_client.tokenizer_for("tiny") is None
    assert bench_client.tokenizer_for("smollm2-135m-instruct") == "smollm2-135m-instruct"


def test_output_tokens_can_be_counted_from_usage():
    by_chunks, by_usage = run_scripted(), run_scripted(count="usage")
    assert [r.counted_by for r in by_chunks.records if not r.error] == ["chunks", "token_ids", "chunks"]
    assert [r.counted_by for r in by_usage.records if not r.error] == ["usage"] * 3
    short = by_usage.records[-1]  # two chunks, usage says three: the last chunk's time stands for the third
    assert short.token_times == pytest.approx([0.24, 0.25, 0.25])
    assert (by_chunks.metrics.output_tokens, by_usage.metrics.output_tokens) == (8, 9)
    assert by_usage.to_json()["counted_by"] == {"usage": 3}


def test_engine_records_are_read_from_every_page(tiny_model):
    """More records than one page of ``/minillm/requests`` (the real endpoint, on a thread of this process):
    every finished one is read, the aborted ones left out."""
    app = create_app(ByteTokenizer(), Engine(tiny_model, EngineConfig(num_blocks=4)), "tiny")
    n = 2 * PAGE_DEFAULT + 50
    for i in range(n):
        app.state.engine_loop.records.keep(
            RequestRecord(f"cmpl-{i}", Status.ABORTED if i % 7 == 0 else Status.FINISHED, "max_tokens", 3, [1, 2],
                          float(i), [i + 0.25, i + 0.5], i + 0.5, 0))
    port = free_port()
    http_server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=http_server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not http_server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert http_server.started
        records = fetch_engine_records(f"http://127.0.0.1:{port}/v1")
    finally:
        http_server.should_exit = True
        thread.join(30)
    finished = [i for i in range(n) if i % 7]
    assert sorted(records, key=lambda r: int(r.split("-")[1])) == [f"cmpl-{i}" for i in finished]
    first, last = records["cmpl-1"], records[f"cmpl-{finished[-1]}"]
    assert (first.arrival_time, first.token_times, first.prompt_len) == (1.0, [1.25, 1.5], 3)
    assert last.token_times == [finished[-1] + 0.25, finished[-1] + 0.5]


def _lines(chunks: list[str]) -> list[str]:
    async def chunked():
        for chunk in chunks:
            yield chunk

    async def collect():
        return [line async for line in sse_lines(chunked())]

    return asyncio.run(collect())


def test_sse_lines_split_at_cr_lf_lf_and_cr_only():
    """A data line with U+2028 or U+0085 inside a JSON string (vLLM, like most servers, sends raw UTF-8) is one
    line; httpx's iter_lines cut it into three, and the request counted as failed."""
    text = 'data: {"text":"a\u2028b\x85c"}'
    assert _lines([text + "\n\n"]) == [text, ""]
    assert _lines(["data: 1\r", "\ndata: 2\rdata: 3\n"]) == ["data: 1", "data: 2", "data: 3"]
    assert _lines(["data: x", "y\r\n", "\r\n", "data: [DONE]"]) == ["data: xy", "", "data: [DONE]"]


@pytest.mark.parametrize("mode", ["forever", "noline", "slowheaders", "drip-stream"])
def test_a_stream_that_never_ends_or_drips_fails_within_the_timeout(fake, mode):
    """No --request-timeout: the idle deadline alone ends the request (a timer, not the next line), and a
    stream that carries more tokens than max_tokens fails as soon as it does."""
    start = time.monotonic()
    result = bounded(lambda: run_benchmark(fake.url(mode), "fake", [Request(0, [1, 2], 3)], timeout=2.0), 15)
    record = result.records[0]
    assert record.error and MODES[mode][1] in record.error, record.error
    assert time.monotonic() - start < 8


def test_the_command_line_ends_with_its_json_against_a_stream_that_never_ends(fake, tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["--url", fake.url("forever"), "--model", "fake", "--num-requests", "2", "--concurrency", "2",
            "--prompt-len", "4", "4", "--output-len", "3", "3", "--timeout", "3", "--json", str(out)]
    assert bounded(lambda: main(argv), 20) == 1
    assert json.loads(out.read_text())["metrics"]["failed"] == 2
    assert "2 x StreamError: more tokens than" in capsys.readouterr().out


def test_a_models_list_that_drips_is_an_error_within_the_timeout(fake, capsys):
    start = time.monotonic()
    assert bounded(lambda: main(["--url", fake.url("models-drip"), "--num-requests", "1", "--timeout", "2"]), 20) == 1
    assert "cannot list the models" in capsys.readouterr().err and time.monotonic() - start < 8


def test_records_that_page_forever_end_with_an_error_and_the_json(fake, tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["--url", fake.url("pages-forever"), "--model", "fake", "--num-requests", "1", "--prompt-len", "2", "2",
            "--output-len", "2", "2", "--timeout", "3", "--compare-engine", "--json", str(out)]
    bounded(lambda: main(argv), 30)
    assert "--compare-engine: no comparison" in capsys.readouterr().out
    assert "error" in json.loads(out.read_text())["engine"]


def test_sse_lines_is_linear_and_caps_a_line():
    """A line arriving in 64 KiB pieces: found in time linear in its length; past the cap, a StreamError."""
    piece = "x" * 65536

    async def pieces(n: int):
        for _ in range(n):
            yield piece
        yield "\n"

    async def collect(n: int):
        return [line async for line in sse_lines(pieces(n))]

    start = time.monotonic()
    assert [len(line) for line in asyncio.run(collect(15))] == [15 * 65536]  # just under 1 MiB
    with pytest.raises(StreamError, match="longer than"):
        asyncio.run(collect(256))  # 16 MiB
    assert time.monotonic() - start < 2


# ---- a client for any OpenAI server: no torch, no engine --------------------------------------------------
REFUSE_TORCH = """
import sys


class Refuse:
    \"\"\"Makes importing torch or minillm's engine an ImportError in this process.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch" or name.startswith("minillm.engine"):
            raise ImportError(f"{name} is refused: the bench client must run without it")


sys.meta_path.insert(0, Refuse())
"""


def test_the_bench_client_runs_where_torch_and_the_engine_cannot_be_imported(fake, tmp_path):
    """``python -m minillm bench`` in a process that cannot import torch or the engine (a sitecustomize on
    PYTHONPATH refuses them): its help, and a run against a fake OpenAI server, with its JSON."""
    (tmp_path / "sitecustomize.py").write_text(REFUSE_TORCH)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}

    def run(*args):
        return subprocess.run([sys.executable, *args], env=env, cwd=Path(__file__).resolve().parent.parent,
                              capture_output=True, text=True, timeout=60)

    refused = run("-c", "import minillm.model")
    assert refused.returncode == 1 and "torch is refused" in refused.stderr  # the refusal works
    assert run("-c", "import minillm; minillm.SamplingParams(temperature=0.5)").returncode == 0
    shown = run("-m", "minillm", "bench", "--help")
    assert shown.returncode == 0 and "--request-rate" in shown.stdout, shown.stderr
    out = tmp_path / "run.json"
    done = run("-m", "minillm", "bench", "--url", fake.url("ok"), "--model", "fake", "--num-requests", "4",
               "--concurrency", "2", "--prompt-len", "4", "4", "--output-len", "2", "2", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(out.read_text())["metrics"]["completed"] == 4
