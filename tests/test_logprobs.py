"""Log-probs: the engine gives each sampled token's log-prob and the top K (only to the requests that ask), and
the server returns them in OpenAI's shapes, ``/v1/completions`` (``logprobs: N``) and ``/v1/chat/completions``
(``logprobs: true, top_logprobs: K``). The values are checked against ``log_softmax`` of the tiny model's own
logits from a plain forward pass over the tokens ``generate`` chose."""
import json
import math

import openai
import pytest
import torch
from fastapi.exceptions import RequestValidationError
from starlette.testclient import TestClient

from minillm import ByteTokenizer, generate
from minillm.engine import Engine, EngineConfig, Request, StepOutput, TokenLogprob
from minillm.sampling import SamplingParams
from minillm.serving.app import create_app
from minillm.serving.output import OutputProcessor, token_label
from minillm.serving.prepare import chat_prompt_ids
from minillm.serving.protocol import (
    NO_LOGPROB,
    ChatCompletionRequest,
    CompletionRequest,
    EndpointFormat,
    parse_body,
    request_error,
)

TOL = 1e-4  # paged attention against a plain forward pass: float32 rounding only
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def client(tiny_model):
    """The app in this process (its engine thread starts with the client), over the tiny model."""
    tokenizer = ByteTokenizer()
    engine = Engine(tiny_model, EngineConfig(max_batch_size=4, num_blocks=24, eos_token_id=tokenizer.eos_token_id))
    with TestClient(create_app(tokenizer, engine, "tiny"), base_url="http://localhost") as test_client:
        yield test_client


def reference(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """(greedy tokens from ``generate``, the log-probs (n, V) each was chosen from, by one forward pass)."""
    tokens = generate(model, prompt, n)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens[:-1]]))[0, len(prompt) - 1:]  # (n, V)
    return tokens, torch.log_softmax(logits.float(), dim=-1)


def label(tokenizer, token_id: int) -> str:
    """A token's label as the server sends it: its text, or its bytes where they are part of a character."""
    return token_label(tokenizer, token_id, 0.0).text


def post(client, path: str, body: dict):
    response = client.post(path, json={"model": "tiny", "temperature": 0, "ignore_eos": True} | body)
    assert response.status_code == 200, response.text
    return response.json()


def stream(client, path: str, body: dict) -> list[dict]:
    """The chunks of a streamed request (without [DONE])."""
    with client.stream("POST", path, json={"model": "tiny", "temperature": 0, "ignore_eos": True, "stream": True}
                       | body) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_greedy_completion_logprobs_are_log_softmax_of_the_models_logits(client, tiny_model, tokenizer):
    prompt = tokenizer.encode("Once upon a time")
    tokens, logprobs = reference(tiny_model, prompt, 12)
    choice = post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "logprobs": 5,
                                              "return_token_ids": True})["choices"][0]
    assert choice["token_ids"] == tokens
    got = choice["logprobs"]
    assert got["tokens"] == [label(tokenizer, t) for t in tokens]
    assert got["token_logprobs"] == pytest.approx([float(logprobs[i, t]) for i, t in enumerate(tokens)], abs=TOL)
    for i, (top, token) in enumerate(zip(got["top_logprobs"], tokens)):
        best = torch.topk(logprobs[i], 5)
        assert list(top) == [label(tokenizer, t) for t in best.indices.tolist()]  # most likely first
        assert list(top.values()) == pytest.approx(best.values.tolist(), abs=TOL)
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert next(iter(top)) == label(tokenizer, token)  # greedy: the chosen token leads
    text, offsets = choice["text"], got["text_offset"]  # token i's text: text[offsets[i]:offsets[i + 1]]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
    for i, (end, token) in enumerate(zip(offsets[1:] + [len(text)], tokens)):
        assert tokenizer.decode(tokens[:i]).startswith(text[:offsets[i]])  # made by the tokens before it
        if token < 128:  # an ASCII byte completes its own character, which ends its text
            assert text[end - 1] == chr(token)


def test_greedy_chat_logprobs_hold_each_token_its_bytes_and_the_top_k(client, tiny_model, tokenizer):
    prompt = chat_prompt_ids(tokenizer, MESSAGES)
    tokens, logprobs = reference(tiny_model, prompt, 8)
    choice = post(client, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "logprobs": True,
                                                   "top_logprobs": 3})["choices"][0]
    content = choice["logprobs"]["content"]
    assert [e["bytes"] for e in content] == [[t] for t in tokens]  # the byte tokenizer: one byte a token
    assert [e["logprob"] for e in content] == pytest.approx([float(logprobs[i, t]) for i, t in enumerate(tokens)],
                                                            abs=TOL)
    for i, entry in enumerate(content):
        top = entry["top_logprobs"]
        best = torch.topk(logprobs[i], 3).indices.tolist()
        assert [e["bytes"] for e in top] == [list(tokenizer.token_bytes(t)) for t in best]
        assert [e["logprob"] for e in top] == sorted((e["logprob"] for e in top), reverse=True)
        assert (top[0]["token"], top[0]["logprob"]) == (entry["token"], entry["logprob"])  # greedy


def test_logprobs_are_of_the_raw_distribution_not_the_sampled_one(client, tiny_model, tokenizer):
    """top_k=1 samples the argmax with probability 1 in the filtered distribution (log-prob 0); the log-prob
    returned is the model's own (vLLM's default), the same as for a greedy request."""
    prompt = tokenizer.encode("Hi")
    tokens, logprobs = reference(tiny_model, prompt, 4)
    body = {"prompt": prompt, "max_tokens": 4, "logprobs": 1}
    sampled = post(client, "/v1/completions", body | {"temperature": 0.5, "top_k": 1, "seed": 3})
    got = sampled["choices"][0]["logprobs"]["token_logprobs"]
    assert got == pytest.approx([float(logprobs[i, t]) for i, t in enumerate(tokens)], abs=TOL)
    assert max(got) < -0.1  # a random model is unsure: far from the filtered distribution's 0


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Once upon", "logprobs": 2}),
    ("/v1/completions", {"prompt": "请介绍", "logprobs": 0}),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 4}),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True}),
])
def test_streamed_chunks_carry_the_logprobs_of_their_tokens_and_agree_with_the_whole_reply(client, path, body):
    body = body | {"max_tokens": 10, "return_token_ids": True}
    whole = post(client, path, body)["choices"][0]
    chunks = [c["choices"][0] for c in stream(client, path, body) if c["choices"]]
    if "messages" in body:
        assert chunks[0]["logprobs"] is None  # the role chunk carries no token
        chunks = chunks[1:]
        assert all(len(c["logprobs"]["content"]) == len(c["token_ids"]) == 1 for c in chunks)
        streamed = [e for c in chunks for e in c["logprobs"]["content"]]
        assert [e["token"] for e in streamed] == [e["token"] for e in whole["logprobs"]["content"]]
        assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in whole["logprobs"]["content"]])
        assert all(len(e["top_logprobs"]) == body.get("top_logprobs", 0) for e in streamed)
        return
    assert all(len(c["logprobs"]["tokens"]) == len(c["token_ids"]) == 1 for c in chunks)
    for key in ("tokens", "text_offset"):
        assert [v for c in chunks for v in c["logprobs"][key]] == whole["logprobs"][key]
    assert [v for c in chunks for v in c["logprobs"]["token_logprobs"]] == pytest.approx(
        whole["logprobs"]["token_logprobs"])
    assert [list(t) for c in chunks for t in c["logprobs"]["top_logprobs"]] == [
        list(t) for t in whole["logprobs"]["top_logprobs"]]
    assert all(len(t) == body["logprobs"] for t in whole["logprobs"]["top_logprobs"])
    assert "".join(c["text"] for c in chunks) == whole["text"]


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "Hi"}),
                                        ("/v1/completions", {"prompt": "Hi", "logprobs": False}),
                                        ("/v1/chat/completions", {"messages": MESSAGES}),
                                        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": False,
                                                                  "top_logprobs": 0})])
def test_a_request_without_logprobs_gets_null(client, path, body):
    body = body | {"max_tokens": 3}
    assert post(client, path, body)["choices"][0]["logprobs"] is None
    assert all(c["choices"][0]["logprobs"] is None for c in stream(client, path, body) if c["choices"])


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": "Hi", "logprobs": 6}, "logprobs", ["between 0 and 5", "got 6"]),
    ("/v1/completions", {"prompt": "Hi", "logprobs": -1}, "logprobs", ["between 0 and 5", "got -1"]),
    ("/v1/completions", {"prompt": "Hi", "logprobs": True}, "logprobs", ["integer"]),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 2.0}, "logprobs", ["integer"]),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", ["needs logprobs: true"]),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     ["between 0 and 20", "got 21"]),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": 1}, "logprobs", ["boolean"]),
])
def test_out_of_range_logprobs_are_refused_by_name(client, path, body, param, words):
    response = client.post(path, json={"model": "tiny"} | body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and all(w in error["message"] for w in words), error


def test_the_parsed_request_asks_the_engine_for_what_the_client_asked():
    def count(raw: dict, model_class) -> int | None:
        return parse_body(json.dumps({"model": "t"} | raw).encode(), model_class).logprob_count

    assert count({"prompt": "x"}, CompletionRequest) is None
    assert [count({"prompt": "x", "logprobs": n}, CompletionRequest) for n in (0, 5)] == [0, 5]
    chat = {"messages": MESSAGES}
    assert count(chat, ChatCompletionRequest) is None
    assert count(chat | {"logprobs": True}, ChatCompletionRequest) == 0
    assert count(chat | {"logprobs": True, "top_logprobs": 20}, ChatCompletionRequest) == 20
    with pytest.raises(RequestValidationError) as info:
        parse_body(json.dumps({"model": "t", "prompt": "x", "logprobs": 6}).encode(), CompletionRequest)
    error = request_error(info.value.errors())
    assert (error.status, error.param) == (400, "logprobs")


def test_a_log_prob_json_cannot_carry_is_sent_as_openais_minus_9999(tokenizer):
    logprob = TokenLogprob(65, float("-inf"), [(66, -0.5), (65, float("-inf")), (67, float("nan"))])
    out = StepOutput("r", [65], False, None, 0.0, [logprob])
    tokens = OutputProcessor(tokenizer, []).process(out).logprobs
    completion = EndpointFormat(chat=False).logprobs(tokens)
    assert completion == {"tokens": ["A"], "token_logprobs": [NO_LOGPROB], "text_offset": [0],
                          "top_logprobs": [{"B": -0.5, "A": NO_LOGPROB, "C": NO_LOGPROB}]}
    chat = EndpointFormat(chat=True).logprobs(tokens)["content"][0]
    assert (chat["token"], chat["logprob"], chat["bytes"]) == ("A", NO_LOGPROB, [65])
    assert [e["logprob"] for e in chat["top_logprobs"]] == [-0.5, NO_LOGPROB, NO_LOGPROB]
    assert json.loads(json.dumps(completion, allow_nan=False)) == completion


def test_the_openai_sdk_reads_both_shapes(client, tiny_model, tokenizer):
    sdk = openai.OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=client, max_retries=0)
    prompt = tokenizer.encode("Once")
    tokens, logprobs = reference(tiny_model, prompt, 4)
    completion = sdk.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
                                        extra_body={"ignore_eos": True})
    got = completion.choices[0].logprobs
    assert got.token_logprobs == pytest.approx([float(logprobs[i, t]) for i, t in enumerate(tokens)], abs=TOL)
    assert all(len(top) == 2 for top in got.top_logprobs)
    chat = sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)


def test_the_engine_computes_logprobs_only_for_the_requests_that_ask(tiny_model):
    prompt = [5, 6, 7]
    tokens, logprobs = reference(tiny_model, prompt, 5)
    engine = Engine(tiny_model, EngineConfig(max_batch_size=2))
    engine.add_request(Request("asks", prompt, 5, logprobs=3))
    engine.add_request(Request("plain", prompt, 5))
    outputs = {"asks": [], "plain": []}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            outputs[out.request_id].append(out)
    assert all(out.logprobs is None for out in outputs["plain"])
    entries = [lp for out in outputs["asks"] for lp in out.logprobs]
    assert [e.token_id for e in entries] == tokens == [t for out in outputs["plain"] for t in out.new_token_ids]
    for i, entry in enumerate(entries):
        assert math.isclose(entry.logprob, float(logprobs[i, entry.token_id]), abs_tol=TOL)
        assert [t for t, _ in entry.top] == torch.topk(logprobs[i], 3).indices.tolist()
    with pytest.raises(ValueError, match="logprobs=-1"):
        Request("r", prompt, 5, logprobs=-1)
    with pytest.raises(TypeError, match="logprobs=True"):
        Request("r", prompt, 5, sampling=SamplingParams(), logprobs=True)
