"""Client mistakes and degenerate values against the server (the tiny model, conftest's ``server``):
each gets a 400 naming its field, or a sane answer, never a 500 and never harm to other requests in flight."""
import json
import threading

import httpx
import pytest
from conftest import TIMEOUT, wait_until_idle
from fastapi.exceptions import RequestValidationError

from minillm.serving.protocol import ChatCompletionRequest, CompletionRequest, parse_body, request_error, sse

pytestmark = pytest.mark.slow  # starts a server

HEADERS = {"Content-Type": "application/json"}


def post(server, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.base}{path}", content=content, timeout=TIMEOUT, headers=HEADERS)


def refusal(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


def greedy_completion(server, **extra) -> dict:
    response = post(server, "/v1/completions", {"model": "tiny", "prompt": "Once", "max_tokens": 6,
                                                "ignore_eos": True, "return_token_ids": True, **extra})
    assert response.status_code == 200, response.text
    return response.json()


# Degenerate sampling values inside the accepted ranges once gave NaN probabilities; the engine step raised
# and every request in flight failed.
@pytest.mark.parametrize("extra", [{"temperature": 1e-300}, {"temperature": 5e-324},
                                   {"temperature": 1.0, "top_p": 1e-300}])
def test_a_degenerate_temperature_or_top_p_is_greedy(server, extra):
    greedy = greedy_completion(server, temperature=0)["choices"][0]["token_ids"]
    assert greedy_completion(server, seed=5, **extra)["choices"][0]["token_ids"] == greedy


def test_an_event_s_json_is_ascii_so_no_client_cuts_its_line():
    """The tiny model's byte tokenizer can write U+0085 or U+2028; sent raw, httpx's iter_lines split the data
    line there and this file's stream test failed on a truncated chunk."""
    event = sse({"choices": [{"text": "a\u2028b\x85c\u00e9"}]})
    assert event.isascii() and event.endswith("\n\n") and len(event.splitlines()) == 2
    assert json.loads(event[6:])["choices"][0]["text"] == "a\u2028b\x85c\u00e9"


def test_a_degenerate_request_leaves_the_streams_in_flight_alone(server):
    finishes = []

    def stream():
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=TIMEOUT) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    finishes.append(chunk["choices"][0]["finish_reason"] if "choices" in chunk else "error")

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    greedy_completion(server, temperature=1e-300)
    for t in threads:
        t.join(TIMEOUT)
    assert finishes.count("length") == 2 and "error" not in finishes
    assert wait_until_idle(server)["kv_blocks_used"] == 0


# A lone surrogate (no character: it can be neither encoded nor tokenized), and a seed outside 64 bits, were 500s.
@pytest.mark.parametrize("path, raw", [
    ("/v1/completions", rb'{"model": "tiny", "prompt": "\ud800", "max_tokens": 1}'),
    ("/v1/completions", rb'{"model": "tiny", "prompt": "ok \udfff", "max_tokens": 1}'),
    ("/v1/chat/completions", rb'{"model": "tiny", "messages": [{"role": "user", "content": "\ud83d"}]}'),
    ("/v1/chat/completions", rb'{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": '
                             rb'[{"type": "text", "text": "a"}, {"type": "text", "text": "\udfff"}]}]}'),
])
def test_a_lone_surrogate_is_a_400_naming_its_place(server, path, raw):
    error = refusal(post(server, path, raw))
    assert "not valid JSON" in error["message"] and "line 1 column" in error["message"]


@pytest.mark.parametrize("seed", [2**64, 2**70, -2**63 - 1])
def test_a_seed_outside_64_bits_is_a_400_naming_seed(server, seed):
    error = refusal(post(server, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 1, "seed": seed}))
    assert error["param"] == "seed" and "64-bit seed range" in error["message"]


@pytest.mark.parametrize("seed", [2**64 - 1, -2**63, 0])
def test_seeds_at_the_ends_of_the_range_are_served(server, seed):
    greedy_completion(server, temperature=1.0, seed=seed)


# Fields the server cannot honour were once silently ignored, and n: true passed as neutral (logprobs, now
# implemented: test_logprobs.py).
@pytest.mark.parametrize("field, value", [
    ("stop_token_ids", [5]), ("min_tokens", 2), ("repetition_penalty", 1.2), ("functions", [{"name": "f"}]),
    ("function_call", "auto"), ("function_call", {"name": "f"}), ("min_p", 0.1),
    ("n", True), ("n", 1.0), ("frequency_penalty", False),
])
def test_fields_the_server_cannot_honour_are_refused_by_name(server, field, value):
    for path, body in [("/v1/completions", {"model": "tiny", "prompt": "Hi"}),
                       ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})]:
        error = refusal(post(server, path, body | {field: value, "max_tokens": 1}))
        assert error["param"] == field and "not supported" in error["message"]


@pytest.mark.parametrize("extra", [{"n": 1}, {"logprobs": None}, {"logprobs": False}, {"stop_token_ids": []},
                                   {"repetition_penalty": 1.0}, {"presence_penalty": 0.0}, {"functions": None}])
def test_neutral_values_of_those_fields_are_accepted(server, extra):
    greedy_completion(server, **extra)


def test_parse_body_refusals_without_a_server():
    cases = [(rb'{"model": "t", "prompt": "\ud800"}', CompletionRequest, None),
             (b'{"model": "t", "prompt": "x", "seed": 18446744073709551616}', CompletionRequest, "seed"),
             (b'{"model": "t", "prompt": "x", "n": true}', CompletionRequest, "n"),
             (b'{"model": "t", "prompt": "x", "logprobs": true}', CompletionRequest, "logprobs"),
             (b'{"model": "t", "messages": [{"role": "user", "content": "x"}], "stop_token_ids": [2]}',
              ChatCompletionRequest, "stop_token_ids")]
    for raw, model_class, param in cases:
        with pytest.raises(RequestValidationError) as info:
            parse_body(raw, model_class)
        error = request_error(info.value.errors())
        assert (error.status, error.param) == (400, param)
    long = parse_body(b'{"model": "t", "prompt": "x", "seed": -9223372036854775808}', CompletionRequest)
    assert long.seed == -2**63
    with pytest.raises(RequestValidationError) as info:
        parse_body(json.dumps({"model": "t", "prompt": "x", "stop": "s" * 10**6}).encode(), CompletionRequest)
    assert len(request_error(info.value.errors()).message) < 1000  # the value is not echoed whole
