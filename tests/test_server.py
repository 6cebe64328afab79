"""``python -m minillm serve`` on 127.0.0.1, started by these tests with the tiny model: the OpenAI SDK talks to
it, its greedy text equals ``generate``, concurrent streams lose and repeat no token, bad input gets an
OpenAI error and the server keeps serving, a client that leaves frees its KV blocks."""
import asyncio
import json
import random

import httpx
import openai
import pytest
from conftest import SERVER_BLOCK_SIZE, SERVER_NUM_BLOCKS, TIMEOUT, wait_until_idle

from minillm import ByteTokenizer, generate
from minillm.serving.launch import launch_server
from minillm.serving.prepare import chat_prompt_ids

pytestmark = pytest.mark.slow  # starts a server

MAX_TOTAL = SERVER_NUM_BLOCKS * SERVER_BLOCK_SIZE + 1  # the last token needs no slot
EOS = ByteTokenizer.eos_token_id


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=TIMEOUT)


def records(server) -> dict:
    return {r["id"]: r for r in httpx.get(f"{server.base}/minillm/requests", timeout=TIMEOUT).json()["requests"]}


def test_models_and_health(server, sdk):
    assert [m.id for m in sdk.models.list()] == ["tiny"]
    assert sdk.models.retrieve("tiny").id == "tiny"
    health = server.health()
    assert health["status"] == "ok" and health["kv_blocks_total"] == SERVER_NUM_BLOCKS


def test_the_openai_sdk_streams_a_chat_completion_equal_to_generate(sdk, tiny_model, tokenizer):
    messages = [{"role": "user", "content": "Hello"}]
    prompt = chat_prompt_ids(tokenizer, messages)
    expected = generate(tiny_model, prompt, 12, eos_token_id=EOS)
    chunks = list(sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == tokenizer.decode(expected)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == ("stop" if expected[-1] == EOS else "length") and set(finish[:-1]) == {None}
    assert chunks[-1].choices == []  # the usage chunk
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(prompt), len(expected))
    whole = sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == streamed and whole.usage.completion_tokens == len(expected)


@pytest.mark.parametrize("text", ["Once upon a time", "请介绍一下Transformer"])
def test_the_openai_sdk_streams_a_completion_equal_to_generate(sdk, tiny_model, tokenizer, text):
    expected = generate(tiny_model, tokenizer.encode(text), 20, eos_token_id=EOS)
    chunks = list(sdk.completions.create(model="tiny", prompt=text, max_tokens=20, temperature=0, stream=True,
                                         extra_body={"return_token_ids": True}))
    assert [c.choices[0].token_ids for c in chunks] == [[t] for t in expected]  # one chunk per token
    assert "".join(c.choices[0].text for c in chunks) == tokenizer.decode(expected)
    whole = sdk.completions.create(model="tiny", prompt=text, max_tokens=20, temperature=0)
    assert whole.choices[0].text == tokenizer.decode(expected)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(tokenizer.encode(text)), len(expected))


async def stream_tokens(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed greedy request with token ids: what arrived, chunk by chunk."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks = []
    async with client.stream("POST", f"{url}/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    tokens = [c["choices"][0]["token_ids"] for c in chunks if c["choices"]]
    return {"id": chunks[0]["id"], "tokens": tokens, "usage": chunks[-1]["usage"],
            "finish": chunks[-2]["choices"][0]["finish_reason"]}


def test_32_concurrent_streams_lose_and_repeat_no_token_and_free_every_block(server, tiny_model):
    rng = random.Random(0)
    work = [([rng.randrange(258) for _ in range(rng.randint(8, 24))], rng.randint(8, 24)) for _ in range(32)]

    async def all_at_once():
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=None)) as client:
            return await asyncio.gather(*(stream_tokens(client, server.url, p, n) for p, n in work))

    steps = server.health()["steps"]
    results = asyncio.run(all_at_once())
    kept = records(server)
    for (prompt, n), got in zip(work, results):
        assert all(len(t) == 1 for t in got["tokens"])
        assert [t for (t,) in got["tokens"]] == generate(tiny_model, prompt, n)
        assert got["usage"]["completion_tokens"] == n and got["finish"] == "length"
        assert kept[got["id"]]["status"] == "finished" and kept[got["id"]]["completion_tokens"] == n
    assert len({got["id"] for got in results}) == 32
    assert server.health()["steps"] - steps < sum(n for _, n in work)  # some steps served several requests
    assert wait_until_idle(server, 0)["kv_blocks_used"] == 0  # freed before the last token was sent


BAD_REQUESTS = [  # (path, body: dict, or bytes sent as they are), status, param, words in the message
    ("/v1/completions", b'{"model": "tiny", "prompt": "Hi"', 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "Hi"}, 404, "model", "'gpt-4' does not exist"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"model": "tiny", "prompt": []}, 400, "prompt", "empty"),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt", "Field required"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 300]}, 400, "prompt", "token id 300 is outside"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 3000}, 400, "max_tokens",
     "exceeds max_seq_len=2048"),
    ("/v1/completions", {"model": "tiny", "prompt": [7] * 100, "max_tokens": 300}, 400, "max_tokens",
     f"more than the whole pool of {SERVER_NUM_BLOCKS}"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", "greater than"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "temperature": -0.5}, 400, "temperature", "-0.5"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "temperature": 2.5}, 400, "temperature", "2.5"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "top_p": 0}, 400, "top_p", "greater than 0"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "top_p": "0.5"}, 400, "top_p", "valid number"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "top_k": -2}, 400, "top_k", "-2"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "stream": "yes"}, 400, "stream", "boolean"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "n": 2}, 400, "n", "not supported"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop",
     "at most 4 stop strings"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "logprobs": 6}, 400, "logprobs", "between 0 and 5"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "stream_options": {"include_usage": True}}, 400, None,
     "only allowed when stream is true"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages", "at least 1"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "Hi"}]}, 400,
     "messages", "role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x" * 400}]}, 400,
     "messages", "no room for a reply"),
    ("/v1/nothing", {}, 404, None, "Not Found"),
]


@pytest.mark.parametrize("path, body, status, param, words", BAD_REQUESTS,
                         ids=[f"{i}:{w}" for i, (*_, w) in enumerate(BAD_REQUESTS)])
def test_bad_input_gets_an_openai_error_and_the_next_request_succeeds(server, path, body, status, param, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.base}{path}", content=content, timeout=TIMEOUT,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"]
    good = httpx.post(f"{server.url}/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3,
                                                            "ignore_eos": True},  # sampled: EOS may come early
                      timeout=TIMEOUT)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3


def test_the_sdk_raises_the_servers_errors(sdk):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        sdk.completions.create(model="nope", prompt="Hi")
    with pytest.raises(openai.BadRequestError, match="exceeds max_seq_len"):
        sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5000)


# A request of the tiny model's whole context (2048 tokens), about 2.5 s of work on one thread: long enough that
# the tests below see it running whatever the load beside them (the shared server's pool ends one in 0.4 s).
LONG = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2045, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def long_server():
    """A server whose KV pool holds ``LONG`` whole."""
    args = ["--model", "tiny", "--device", "cpu", "--threads", "1", "--num-blocks", "128", "--no-access-log"]
    with launch_server(args, startup_timeout=60) as s:
        yield s


def test_a_client_that_leaves_mid_stream_frees_its_blocks(long_server):
    server = long_server
    with httpx.Client(timeout=TIMEOUT) as client:
        with client.stream("POST", f"{server.url}/completions", json=LONG | {"stream": True}) as response:
            lines = response.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            assert server.health()["kv_blocks_used"] > 0
        # leaving the block closes the connection, after one token of thousands
    health = wait_until_idle(server)
    assert (health["running"], health["kv_blocks_used"]) == (0, 0)
    record = records(server)[first["id"]]
    assert record["status"] == "aborted" and record["completion_tokens"] < LONG["max_tokens"]


def test_a_client_that_leaves_a_whole_response_frees_its_blocks(long_server):
    server = long_server
    aborted = server.health()["aborted"]

    async def leave_once_running():
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            request = asyncio.ensure_future(client.post(f"{server.url}/completions", json=LONG))
            while server.health()["running"] == 0:
                await asyncio.sleep(0.01)
            request.cancel()  # closes the connection

    asyncio.run(leave_once_running())
    health = wait_until_idle(server)
    assert (health["running"], health["kv_blocks_used"], health["aborted"]) == (0, 0, aborted + 1)


def test_bad_server_arguments_exit_with_status_2(capsys):
    from minillm.serving.cli import main

    for argv, words in ((["--threads", "0"], "argument --threads: 0 must be >= 1"),
                        (["--port", "70000"], "argument --port: 70000 must be >= 0 and <= 65535")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and words in capsys.readouterr().err
    assert main(["--model", "tiny", "--max-num-batched-tokens", "2"]) == 2
    assert "must be >= max_batch_size=8" in capsys.readouterr().err


def test_the_frontend_asks_the_engine_what_fits_the_pool(tiny_model, tokenizer):
    """One rule for "does this request fit": ``Engine.max_total_tokens``, which ``rejection`` applies and the
    frontend reads (it used to recompute the pool's capacity itself)."""
    from minillm.engine import Engine, EngineConfig, Request
    from minillm.serving.limits import ServerLimits
    from minillm.serving.prepare import Prepare

    engine = Engine(tiny_model, EngineConfig(num_blocks=SERVER_NUM_BLOCKS, block_size=SERVER_BLOCK_SIZE))
    assert engine.max_total_tokens == MAX_TOTAL
    assert Prepare(tokenizer, engine, "tiny", ServerLimits()).max_total == engine.max_total_tokens
    assert engine.rejection(Request(0, [1] * 10, MAX_TOTAL - 10)) is None
    assert "more than the whole pool" in engine.rejection(Request(0, [1] * 10, MAX_TOTAL - 9)).message


def test_the_servers_default_pool_is_the_engines(tiny_model):
    """The default KV pool size is decided once, by the engine: the server's arguments without --num-blocks
    give the pool ``Engine`` gives by default."""
    from minillm.engine import Engine, EngineConfig
    from minillm.serving.cli import engine_config, parse_args

    config = engine_config(parse_args(["--model", "tiny", "--max-batch-size", "3"]), EOS)
    assert config.num_blocks is None and config.eos_token_id == EOS
    served = Engine(tiny_model, config)
    assert served.blocks.num_blocks == Engine(tiny_model, EngineConfig(max_batch_size=3)).blocks.num_blocks
    assert served.blocks.num_blocks == config.pool_blocks(tiny_model.config.max_seq_len)
