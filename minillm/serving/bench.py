"""``python -m minillm bench``: a load generator for any OpenAI-compatible server (minillm, vLLM, SGLang,
llama.cpp), measuring what its users see.

    python -m minillm bench --url http://127.0.0.1:8000/v1 --request-rate 8 --num-requests 64
    python -m minillm bench --url http://gpu-host:8000/v1 --model meta-llama/Llama-3.1-8B-Instruct \\
        --concurrency 16 --prompt-len 512 1024 --output-len 128 256 --vocab-size 32000 --json run.json

The workload is ``minillm.analysis.workload``'s: prompts of random token ids (sent as the ``prompt`` of
``/v1/completions``, so every server sees the same number of tokens), output lengths drawn in a range
and produced in full (``ignore_eos``, as vLLM's random benchmark), arrivals from a Poisson (gamma)
process at ``--request-rate``, or ``--concurrency`` users in a closed loop. Every request streams; the
client stamps each chunk when it arrives and computes TTFT, TPOT, ITL, E2E, throughput and goodput
with ``minillm.analysis.metrics`` (vLLM's definitions). A chunk counts one token, or as many as its
``token_ids`` lists when the server sends them. ``--compare-engine`` (minillm servers only) also reads
the engine's own timestamps of the same requests and prints what HTTP and streaming added. The client
needs neither torch nor the engine.

A request counts as completed only when its stream carried tokens and a ``finish_reason`` (OpenAI's streams
always end with one; ``[DONE]`` alone is what llama-cpp-python sends when a newer request interrupts a
stream: start it with ``--interrupt_requests False`` to measure it under load). Anything else (an HTTP
error, a stream cut short, a chunk that is not OpenAI's shape, more tokens than ``max_tokens``, a line longer
than ``MAX_LINE_CHARS``, no token for ``--timeout`` seconds (response headers included), more than
``--request-timeout`` seconds in all) makes it a failed request with its reason; the run goes on, and always
ends with its table (and its ``--json``). The side requests (``/v1/models``, the engine's records) have
``--timeout`` seconds each, in all.

Prompts go as token ids, or as text (``--prompt-format``): random ids decoded with the served model's
tokenizer (``--tokenizer``; by default the one the model's name points at: a packaged model or a .gguf
file, as llama-cpp-python names its model). Output tokens are counted from the chunks, or with
``--count-tokens usage`` from the usage the server reports; the table's last line says which.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

try:
    import httpx
except ImportError:  # the serve extra is missing: main() says what to install
    httpx = None

from ..analysis.metrics import (
    SLO,
    RequestTiming,
    ServingMetrics,
    Summary,
    e2e_latency,
    serving_metrics,
    summarize,
    ttft,
)
from ..analysis.workload import LENGTH_DISTS, poisson_arrivals, random_requests
from ..request import Request, RequestSummary, Status
from ..sampling import SamplingParams

MAX_LINE_CHARS = 2**20  # the longest SSE line the client reads (a token's chunk is a few hundred characters)


@dataclass(frozen=True)
class ClientRecord:
    """One request as the client saw it. Times: seconds from the start of the run, on the client's clock."""

    request_id: int | str
    prompt_len: int
    arrival_time: float  # when the request was sent
    token_times: list[float]  # when each output token arrived (k tokens in one chunk: k equal times); [] if failed
    response_id: str | None = None
    usage_tokens: int | None = None  # completion_tokens as the server reported them
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None
    counted_by: str = "chunks"  # what its output tokens were counted from: token_ids, usage or chunks


@dataclass(frozen=True)
class BenchResult:
    """A run: per-request records (in the workload's order), its wall time, and its metrics."""

    url: str
    model: str
    records: list[ClientRecord]
    duration: float  # s, first send to last byte
    metrics: ServingMetrics

    @property
    def counted_by(self) -> dict[str, int]:
        """Completed requests by what their output tokens were counted from (token_ids, usage, chunks)."""
        return dict(Counter(r.counted_by for r in self.records if not r.error))

    @property
    def count_mismatches(self) -> int:
        """Requests whose chunks carried a different number of tokens than the server's usage says."""
        return sum(r.usage_tokens is not None and not r.error and r.counted_by != "usage"
                   and r.usage_tokens != len(r.token_times) for r in self.records)

    def to_json(self) -> dict:
        return {"url": self.url, "model": self.model, "count_mismatches": self.count_mismatches,
                "counted_by": self.counted_by,
                "metrics": metrics_dict(self.metrics), "requests": [asdict(r) for r in self.records]}


def summary_ms(s: Summary) -> dict:
    """A ``Summary`` of seconds as JSON: its count and its mean, p50, p90, p99 in ms (None: no values)."""
    return {"n": s.n} | {k: None if getattr(s, a) is None else getattr(s, a) * 1e3
                         for k, a in (("mean", "mean"), ("p50", "median"), ("p90", "p90"), ("p99", "p99"))}


def metrics_dict(m: ServingMetrics) -> dict:
    """A ``ServingMetrics`` as JSON: counts, throughputs per second, latencies in ms."""
    out = {"requests": m.n_requests, "completed": m.n_completed, "failed": m.n_failed, "duration_s": m.duration,
           "prompt_tokens": m.prompt_tokens, "output_tokens": m.output_tokens,
           "request_throughput": m.request_throughput, "output_throughput": m.output_throughput,
           "total_token_throughput": m.total_token_throughput,
           **{f"{name}_ms": summary_ms(getattr(m, name)) for name in ("ttft", "tpot", "itl", "e2e")}}
    if m.slo is not None:
        out |= {"slo_s": asdict(m.slo), "good_requests": m.n_good, "goodput": m.goodput}
    return out


def payload(model: str, request: Request, prompt: str | None = None, min_tokens: bool = False) -> dict:
    """The ``/v1/completions`` body for one workload request (top_k and ignore_eos: vLLM's extensions).
    ``prompt``: the request's prompt as text (default: its token ids); ``min_tokens``: also ask for
    ``min_tokens = max_tokens`` with ignore_eos (vLLM's and llama-cpp-python's way to go past EOS)."""
    body = {"model": model, "prompt": request.prompt_ids if prompt is None else prompt,
            "max_tokens": request.max_tokens,
            "temperature": request.sampling.temperature, "top_p": request.sampling.top_p,
            "stream": True, "stream_options": {"include_usage": True}}
    if request.sampling.top_k:
        body["top_k"] = request.sampling.top_k
    if request.seed is not None:
        body["seed"] = request.seed
    if request.ignore_eos:
        body["ignore_eos"] = True
        if min_tokens:
            body["min_tokens"] = request.max_tokens
    return body


# ---- text prompts: random token ids decoded with the served model's tokenizer ----------------------
class TextPrompts:
    """Turns a workload's random prompt ids into text that the served model's tokenizer reads back as about
    as many tokens (vLLM's random dataset does the same), for servers that take only text (llama.cpp's).

    ``tokenizer``: ``"bytes"`` (minillm's byte-level tokenizer, the tiny model's: printable ASCII, one token
    per character), a model name minillm packages (``smollm2-135m-instruct``), a ``.gguf`` file or a
    Hugging Face folder (their BPE tokenizer)."""

    def __init__(self, tokenizer: str):
        self.name = tokenizer
        if tokenizer == "bytes":
            from ..text.byte import ByteTokenizer

            self.tokenizer, self.vocab_size = ByteTokenizer(), 95
        else:
            self.tokenizer = load_tokenizer(tokenizer)
            self.vocab_size = self.tokenizer.vocab_size

    def encode(self, text: str) -> list[int]:
        if self.name == "bytes":
            return self.tokenizer.encode(text, bos=False)
        return self.tokenizer.encode(text, add_bos=False, special=False)

    def text(self, ids: list[int]) -> tuple[str, int]:
        """The prompt text for ``ids`` (drawn in [0, vocab_size)) and its length in tokens, re-encoded."""
        if self.name == "bytes":
            text = "".join(chr(32 + i % 95) for i in ids)
            return text, len(text)
        text = self.tokenizer.decode([i % self.vocab_size for i in ids], skip_special_tokens=True)
        tokens = self.encode(text)
        if len(tokens) > len(ids):  # decoding and encoding again may merge or split: cut to the length asked
            text = self.tokenizer.decode(tokens[:len(ids)], skip_special_tokens=True)
            tokens = self.encode(text)
        return text, len(tokens)


def load_tokenizer(name_or_path: str):
    """The BPE tokenizer of a packaged model name, a ``.gguf`` file or a Hugging Face folder."""
    from pathlib import Path

    from ..checkpoints.pretrained import PACKAGED, gguf_checkpoint, gguf_tokenizer
    from ..text.bpe import BPETokenizer

    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return BPETokenizer.from_hf_folder(path)
    if str(name_or_path).lower() in PACKAGED or (path.is_file() and path.suffix.lower() == ".gguf"):
        return gguf_tokenizer(gguf_checkpoint(name_or_path))
    raise ValueError(f"no tokenizer for {name_or_path!r}: give --tokenizer bytes, one of {sorted(PACKAGED)}, "
                     "a .gguf file or a Hugging Face folder")


def tokenizer_for(model: str) -> str | None:
    """The ``TextPrompts`` tokenizer a served model's name points at (a packaged name or a .gguf path, as
    llama-cpp-python names its model), or None."""
    from pathlib import Path

    path = Path(model).expanduser()
    if (path.is_file() and path.suffix.lower() == ".gguf") or (path.is_dir() and (path / "tokenizer.json").is_file()):
        return model
    try:  # minillm reads the packaged models' files with torch, which this client does not need otherwise
        from ..checkpoints.pretrained import PACKAGED
    except ImportError:
        return None
    return model if model.lower() in PACKAGED else None


class StreamError(ValueError):
    """A server's answer the client cannot count as a completed request (the message says why)."""


def _check_chunk(chunk) -> tuple[list[dict], dict | None]:
    """A chunk's choices and usage, or StreamError when the chunk is not shaped like OpenAI's."""
    if not isinstance(chunk, dict):
        raise StreamError(f"a chunk is a JSON {type(chunk).__name__}, not an object: {str(chunk)[:100]}")
    if "error" in chunk:
        raise StreamError(f"the server failed mid-stream: {str(chunk['error'])[:300]}")
    choices, usage = chunk.get("choices"), chunk.get("usage")
    if choices is not None and not (isinstance(choices, list) and all(isinstance(c, dict) for c in choices)):
        raise StreamError(f"a chunk's choices is not a list of objects: {str(choices)[:100]}")
    if usage is not None and not isinstance(usage, dict):
        raise StreamError(f"a chunk's usage is not an object: {str(usage)[:100]}")
    for choice in choices or []:
        ids = choice.get("token_ids")
        if ids is not None and not isinstance(ids, list):
            raise StreamError(f"a choice's token_ids is not a list: {str(ids)[:100]}")
    return choices or [], usage


async def sse_lines(chunks, max_chars: int = MAX_LINE_CHARS):
    """The lines of a server-sent event stream, split as the SSE format says: at CR LF, LF or CR only (not at
    U+2028 or U+0085, which a server may send raw inside a JSON string). ``chunks``: an async iterator of text.
    Each chunk is searched once (a long line costs time linear in its length); a line longer than
    ``max_chars`` is a StreamError."""
    pending: list[str] = []  # the pieces of the line not yet ended
    size = 0
    async for chunk in chunks:
        if pending and pending[-1].endswith("\r"):  # a CR that ended the last chunk: join it to a LF here
            chunk, pending[-1] = "\r" + chunk, pending[-1][:-1]
        held = chunk.endswith("\r")  # maybe the first half of a CR LF: wait for the next chunk
        first, *lines = re.split(r"\r\n|\n|\r", chunk[:-1] if held else chunk)
        if lines:
            yield "".join(pending) + first
            pending, size, last = [], 0, lines.pop()
            for line in lines:
                yield line
        else:
            last = first
        pending.append(last + ("\r" if held else ""))
        size += len(last)
        if size > max_chars:
            raise StreamError(f"a line longer than {max_chars} characters (not a server-sent event stream?)")
    rest = "".join(pending).rstrip("\r")
    if rest:
        yield rest


class _Stream:
    """What one request has received so far (kept when a deadline cuts it)."""

    def __init__(self, prompt_len: int, max_tokens: int):
        self.times, self.text, self.prompt_len, self.max_tokens = [], [], prompt_len, max_tokens
        self.has_ids = False  # some chunk carried token_ids
        self.response_id = self.usage_tokens = self.finish = None
        self.done = False  # saw data: [DONE]


async def _receive(client, url: str, body: dict, t0: float, clock, idle_timeout: float | None,
                   got: _Stream) -> None:
    """Stream one request into ``got``; stamp each chunk as its line arrives, before parsing it.
    ``idle_timeout``: seconds the stream may go without a token, its response headers included (a timer: SSE
    comments, empty events and bytes of a line not yet ended do not reset it, as they would httpx's per-read
    timeout)."""
    try:
        async with asyncio.timeout(idle_timeout) as idle:
            await _read_stream(client, url, body, t0, clock, idle_timeout, idle, got)
    except TimeoutError:
        if idle.expired():
            raise StreamError(f"no token for {idle_timeout:g} s (the server kept the stream open without one)") \
                from None
        raise


async def _read_stream(client, url: str, body: dict, t0: float, clock, idle_timeout: float | None, idle,
                       got: _Stream) -> None:
    async with client.stream("POST", f"{url}/completions", json=body) as response:
        if response.status_code != 200:
            body = (await response.aread())[:300].decode(errors="replace")
            raise ValueError(f"HTTP {response.status_code}: {body}")
        async for line in sse_lines(response.aiter_text()):
            now = clock() - t0
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                got.done = True
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                raise StreamError(f"a chunk is not JSON: {data[:100]!r}") from None
            choices, usage = _check_chunk(chunk)
            got.response_id = got.response_id or (chunk.get("id") if isinstance(chunk.get("id"), str) else None)
            for choice in choices:
                ids, text, finish = choice.get("token_ids"), choice.get("text"), choice.get("finish_reason")
                got.has_ids = got.has_ids or isinstance(ids, list)
                # without token_ids, a chunk is one token, except a last one with no text that only says why
                # the stream ended (llama.cpp's servers send one after the last token)
                n = len(ids) if isinstance(ids, list) else 0 if (finish is not None and not text) else 1
                got.times += [now] * n
                if len(got.times) > got.max_tokens:
                    raise StreamError(f"more tokens than the {got.max_tokens} asked (max_tokens): "
                                      f"{len(got.times)} so far")
                got.text.append(text if isinstance(text, str) else "")
                got.finish = finish if isinstance(finish, str) else got.finish
                if n and idle_timeout is not None:
                    idle.reschedule(asyncio.get_running_loop().time() + idle_timeout)
            if usage:
                tokens, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
                got.usage_tokens = tokens if isinstance(tokens, int) else got.usage_tokens
                got.prompt_len = prompt if isinstance(prompt, int) else got.prompt_len


async def send(client, url: str, model: str, request: Request, t0: float, clock,
               request_timeout: float | None = None, idle_timeout: float | None = None,
               prompt: tuple[str, int] | None = None, min_tokens: bool = False,
               count: str = "chunks") -> ClientRecord:
    """Send one streaming request and record it. Whatever goes wrong (HTTP errors, a stream cut short, a
    chunk of the wrong shape, a deadline) ends this request alone, as a failed record that says why.

    A request counts as completed only if its stream carried tokens and a choice's ``finish_reason``.
    ``request_timeout``: seconds for the whole request.
    ``prompt``: (text, its length in tokens) to send instead of the token ids.

    Output tokens are counted from the chunks: their ``token_ids`` when the server sends them, else one per
    chunk (a last chunk with no text and only a finish_reason counts none). ``count="usage"``: from the
    usage the server reports (``completion_tokens``) where it reports one, for servers whose chunks are not
    tokens; the token times are then the chunks' times, the last one repeated or cut to usage's count.
    ``counted_by`` says which count a record holds."""
    arrival = clock() - t0
    got = _Stream(len(request.prompt_ids) if prompt is None else prompt[1], request.max_tokens)
    body = payload(model, request, None if prompt is None else prompt[0], min_tokens)
    error = None
    try:
        await asyncio.wait_for(_receive(client, url, body, t0, clock, idle_timeout, got), request_timeout)
        if not got.times:
            error = "StreamError: the stream ended without a token" + (" ([DONE] only)" if got.done else "")
        elif not got.done and got.finish is None:
            error = (f"StreamError: the stream ended after {len(got.times)} token(s) without [DONE] or a "
                     "finish_reason (cut short?)")
        elif got.finish is None:  # llama-cpp-python ends a stream so when a newer request interrupts it
            error = (f"StreamError: the stream ended with [DONE] after {len(got.times)} token(s) but no choice "
                     "gave a finish_reason (interrupted by the server?)")
    except TimeoutError:
        error = f"TimeoutError: the request took more than {request_timeout:g} s ({len(got.times)} token(s) came)"
    except Exception as e:  # one request's failure, whatever it is, is that request's record
        error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    times, counted_by = got.times, "token_ids" if got.has_ids else "chunks"
    if count == "usage" and not error and got.usage_tokens is not None and got.usage_tokens > 0:
        n, counted_by = got.usage_tokens, "usage"
        times = times[:n] + [times[-1]] * (n - len(times))
    return ClientRecord(request.request_id, got.prompt_len, arrival, [] if error else times, got.response_id,
                        got.usage_tokens, got.finish, "".join(got.text), error, counted_by)


async def _run(url: str, model: str, requests: list[Request], concurrency: int | None, timeout: float, clock,
               transport, request_timeout: float | None, prompts: dict | None = None,
               min_tokens: bool = False, count: str = "chunks") -> tuple[list[ClientRecord], float]:
    prompts = prompts or {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
        t0 = clock()
        if concurrency is None:  # open loop: each request leaves at its arrival time, whatever the server does
            async def at(request: Request) -> ClientRecord:
                await asyncio.sleep(max(0.0, request.arrival_time - (clock() - t0)))
                return await send(client, url, model, request, t0, clock, request_timeout, timeout,
                                  prompts.get(request.request_id), min_tokens, count)

            records = await asyncio.gather(*(at(r) for r in requests))
        else:  # closed loop: each user sends its next request when its last one has ended
            queue, done = iter(requests), {}

            async def user() -> None:
                for request in queue:
                    done[request.request_id] = await send(client, url, model, request, t0, clock, request_timeout,
                                                          timeout, prompts.get(request.request_id), min_tokens,
                                                          count)

            await asyncio.gather(*(user() for _ in range(concurrency)))
            records = [done[r.request_id] for r in requests]
        return list(records), clock() - t0


def run_benchmark(url: str, model: str, requests: list[Request], *, concurrency: int | None = None,
                  slo: SLO | None = None, timeout: float = 600.0, request_timeout: float | None = None,
                  clock=time.perf_counter, transport=None, prompts: dict | None = None,
                  min_tokens: bool = False, count: str = "chunks") -> BenchResult:
    """Send ``requests`` to the server at ``url`` (ending in ``/v1``) and measure them.

    Open loop (``concurrency=None``): request i is sent at its ``arrival_time`` (seconds from the
    start). Closed loop: ``concurrency`` users, each sending its next request when its last one ends.
    ``timeout``: seconds any one read may wait, and a stream may go without a token; ``request_timeout``:
    seconds for a whole request (None: no limit). A request that fails in any way is a failed record with its
    reason in ``error``; the run itself does not raise. Works inside a running event loop (Jupyter) too.
    ``prompts``: request id -> (text, tokens) to send as the prompt instead of its ids (``TextPrompts``);
    ``min_tokens``: ask for ``min_tokens`` too (servers without ``ignore_eos``); ``count``: "chunks" or
    "usage", what output tokens are counted from (see ``send``).
    """
    if count not in ("chunks", "usage"):
        raise ValueError(f"count={count!r} must be 'chunks' or 'usage'")
    url = url.rstrip("/")
    if concurrency is not None and (not isinstance(concurrency, int) or concurrency < 1):
        raise ValueError(f"concurrency={concurrency!r} must be an integer >= 1 (or None: open loop)")
    for name, value in (("timeout", timeout), ("request_timeout", request_timeout)):
        if value is not None and not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"{name}={value!r} must be a number of seconds > 0")
    records, duration = run_sync(_run(url, model, requests, concurrency, timeout, clock, transport, request_timeout,
                                      prompts, min_tokens, count))
    return BenchResult(url, model, records, duration, serving_metrics(records, duration=duration, slo=slo))


def run_sync(coroutine):
    """Run ``coroutine`` to its end from synchronous code, inside a running event loop (Jupyter's) too."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1) as pool:  # a running event loop (a notebook's): run ours on a thread of its own
        return pool.submit(asyncio.run, coroutine).result()


async def get_json(client, url: str, timeout: float, **params):
    """``GET url`` as JSON within ``timeout`` seconds in all (a per-read timeout lets a server that drips its
    answer hold the client for ever)."""
    async with asyncio.timeout(timeout):
        response = await client.get(url, params=params)
        response.raise_for_status()
        return response.json()


def list_models(url: str, timeout: float = 10.0) -> list[str]:
    """The model names a server offers (``GET /v1/models``), within ``timeout`` seconds."""
    async def fetch():
        async with httpx.AsyncClient(timeout=timeout) as client:
            return await get_json(client, f"{url.rstrip('/')}/models", timeout)

    return [m["id"] for m in run_sync(fetch())["data"]]


# ---- minillm servers: the engine's own timestamps of the same requests ---------------------------------
def fetch_engine_records(url: str, timeout: float = 10.0) -> dict[str, RequestTiming]:
    """A minillm server's records of its latest finished requests (``GET /minillm/requests``, every page:
    each reply's ``next_offset`` asks for the page of older records, right after this one's, null after the
    oldest kept), by response id; each page within ``timeout`` seconds. Times are on the engine's clock: only
    differences of them compare with the client's."""
    base = url.rstrip("/").removesuffix("/v1")

    async def pages() -> dict[str, RequestTiming]:
        records, offset = {}, 0
        async with httpx.AsyncClient(timeout=timeout) as client:
            while offset is not None:
                page = await get_json(client, f"{base}/minillm/requests", timeout, offset=offset)
                rows = [RequestSummary.from_json(row) for row in page["requests"]]
                records |= {r.request_id: RequestTiming(r.arrival_time, r.token_times, r.prompt_len)
                            for r in rows if r.status == Status.FINISHED}
                next_offset = page["next_offset"]
                if next_offset is not None and (not rows or next_offset != offset + len(rows)):
                    raise ValueError(f"/minillm/requests answered next_offset={next_offset!r} to offset={offset} "
                                     f"with {len(rows)} records: not the page after this one")
                offset = next_offset
        return records

    return run_sync(pages())


@dataclass(frozen=True)
class EngineComparison:
    """The same requests seen by the client (over HTTP, streamed) and by the engine (in-process).

    Per request, client TTFT - engine TTFT = the request's trip to the engine + the first token's trip
    back; client E2E - engine E2E = the same trip in + the last token's trip back. Both are >= 0.
    """

    pairs: list[tuple[ClientRecord, RequestTiming]] = field(repr=False)
    client: ServingMetrics
    engine: ServingMetrics
    added_ttft: Summary  # s, per request
    added_e2e: Summary  # s, per request

    def table(self) -> str:
        lines = [f"{len(self.pairs)} requests seen by both; latencies in ms",
                 f"{'':<12}{'engine':>10}{'client':>10}{'added':>10}   (added: per request, client - engine)"]
        for name, added in (("ttft", self.added_ttft), ("e2e", self.added_e2e)):
            for stat in ("median", "p99"):
                e, c = getattr(self.engine, name), getattr(self.client, name)
                lines.append(f"{name.upper() + ' ' + stat:<12}{e.ms(stat):>10}{c.ms(stat):>10}{added.ms(stat):>10}")
        for stat in ("median", "p99"):
            lines.append(f"{'ITL ' + stat:<12}{self.engine.itl.ms(stat):>10}{self.client.itl.ms(stat):>10}")
        return "\n".join(lines)


def compare_with_engine(result: BenchResult, engine_records: dict[str, RequestTiming]) -> EngineComparison:
    """Pair the client's completed records with the engine's (by response id) and measure the difference."""
    pairs = [(r, engine_records[r.response_id]) for r in result.records
             if not r.error and r.response_id in engine_records]
    if not pairs:
        raise ValueError("no completed request of this run is in the engine's records (not a minillm server, "
                         "or the records were dropped)")
    client = serving_metrics([c for c, _ in pairs])
    engine = serving_metrics([e for _, e in pairs])
    return EngineComparison(pairs, client, engine, summarize(ttft(c) - ttft(e) for c, e in pairs),
                            summarize(e2e_latency(c) - e2e_latency(e) for c, e in pairs))


# ---- the command line ------------------------------------------------------------------------------
def parse_slo(items: list[str] | None) -> SLO | None:
    """``["ttft:300", "tpot:30"]`` (milliseconds, vLLM's ``--goodput`` syntax) -> SLO in seconds."""
    if not items:
        return None
    limits = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2e") or not value:
            raise ValueError(f"--goodput {item!r}: expected ttft:MS, tpot:MS or e2e:MS")
        try:
            limits[name] = float(value) / 1e3
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
    return SLO(**limits)


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m minillm bench",
        description="Load an OpenAI-compatible server with a minillm.analysis.workload workload over streaming "
                    "/v1/completions and report TTFT, TPOT, ITL, E2E, throughput and goodput.")
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the API base, ending in /v1 "
                        "(default http://127.0.0.1:8000/v1)")
    parser.add_argument("--model", default=None, help="the model name (default: the first of GET /v1/models)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests to send (default 64)")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="open loop: mean arrivals per second (default inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the gaps between arrivals: 1 Poisson (default), < 1 burstier")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="closed loop: this many users, each sending its next request when its last ends")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 128), metavar=("LO", "HI"),
                        help="prompt tokens, drawn in [LO, HI] (default 32 128)")
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 64), metavar=("LO", "HI"),
                        help="output tokens, drawn in [LO, HI] (default 16 64)")
    parser.add_argument("--length-dist", choices=LENGTH_DISTS, default="uniform", help="default uniform")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="prompt token ids are drawn in [0, vocab-size) (default 256: valid for any model; "
                             "text prompts: the tokenizer's vocabulary)")
    parser.add_argument("--prompt-format", choices=("auto", "ids", "text"), default="auto",
                        help="send prompts as token ids or as text (random ids decoded with --tokenizer; "
                             "llama.cpp's servers take only text); auto (default): text when the served model "
                             "names a tokenizer minillm can read (a packaged model, a .gguf file), else ids")
    parser.add_argument("--tokenizer", default=None,
                        help="text prompts: 'bytes' (minillm's byte tokenizer), a packaged model name, a .gguf "
                             "file or a Hugging Face folder (default: the served model's name)")
    parser.add_argument("--min-tokens", action="store_true",
                        help="with ignore_eos also send min_tokens = max_tokens (llama-cpp-python has no "
                             "ignore_eos; minillm refuses min_tokens)")
    parser.add_argument("--count-tokens", choices=("chunks", "usage"), default="chunks",
                        help="count output tokens from the stream's chunks (their token_ids, else one per chunk; "
                             "default) or from the usage the server reports, where it does (servers without "
                             "ignore_eos, or whose chunks are not tokens)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the lengths, prompts and arrivals (default 0)")
    parser.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    parser.add_argument("--no-ignore-eos", action="store_true",
                        help="let requests stop at EOS (default: ask for ignore_eos, a vLLM extension)")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                        help="SLOs for goodput in ms, e.g. ttft:300 tpot:30 (also e2e:MS)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a stream may go without a token, and a side request may take (default 600)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds a whole request may take; past it, it counts as failed (default: no limit)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--compare-engine", action="store_true",
                        help="minillm servers: compare with the engine's own timestamps of the same requests")
    return parser, parser.parse_args(argv)


def workload(args: argparse.Namespace) -> tuple[list[Request], int | None]:
    """The requests and the concurrency (None: open loop) the arguments ask for; ValueError if they clash."""
    if args.concurrency is not None and args.request_rate is not None:
        raise ValueError("give --request-rate (open loop) or --concurrency (closed loop), not both")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency {args.concurrency}: give at least 1 user")
    rate = math.inf if args.request_rate is None else args.request_rate
    arrivals = poisson_arrivals(args.num_requests, rate, seed=args.seed, burstiness=args.burstiness)
    vocab = args.vocab_size if args.vocab_size is not None else getattr(args, "text_vocab", None) or 256
    requests = random_requests(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), seed=args.seed,
                               vocab_size=vocab, arrival_times=arrivals, length_dist=args.length_dist,
                               sampling=SamplingParams(temperature=args.temperature),
                               ignore_eos=not args.no_ignore_eos)
    return requests, args.concurrency


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    if httpx is None:
        print("python -m minillm bench: error: httpx is not installed; pip install 'minillm[serve]'",
              file=sys.stderr)
        return 3
    try:
        slo = parse_slo(args.goodput)
        requests, concurrency = workload(args)
        for name in ("timeout", "request_timeout"):
            value = getattr(args, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} {value} must be > 0 seconds")
    except (TypeError, ValueError) as error:
        parser.error(str(error))  # exits with status 2
    try:
        model = args.model or list_models(args.url, min(args.timeout, 10.0))[0]
    except Exception as error:  # any answer that is not a model list, in time
        print(f"python -m minillm bench: error: cannot list the models at {args.url}: {error}", file=sys.stderr)
        return 1
    prompts, prompt_note = None, "token ids"
    tokenizer = args.tokenizer or (tokenizer_for(model) if args.prompt_format != "ids" else None)
    if args.prompt_format == "text" or (args.prompt_format == "auto" and tokenizer):
        if not tokenizer:
            parser.error(f"--prompt-format text: no tokenizer for the model {model!r}; give --tokenizer")
        try:
            text_prompts = TextPrompts(tokenizer)
        except Exception as error:  # a bad path, a file that is not a tokenizer
            print(f"python -m minillm bench: error: --tokenizer {tokenizer}: {error}", file=sys.stderr)
            return 1
        args.text_vocab = text_prompts.vocab_size
        requests, concurrency = workload(args)
        del args.text_vocab
        prompts = {r.request_id: text_prompts.text(r.prompt_ids) for r in requests}
        prompt_note = f"text (random ids decoded with the {tokenizer} tokenizer)"
    rate = "inf" if args.request_rate is None else f"{args.request_rate:g}"
    load = (f"{concurrency} users, closed loop" if concurrency else
            f"{rate} req/s, open loop (gamma arrivals, burstiness {args.burstiness:g})")
    print(f"minillm bench: {args.num_requests} requests to {args.url}, model {model!r}")
    print(f"  load: {load}")
    ids_note = "" if prompts else f" (ids < {args.vocab_size or 256})"
    print(f"  prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens{ids_note}, sent as {prompt_note}")
    print(f"  outputs {args.output_len[0]}-{args.output_len[1]} tokens, {args.length_dist}; seed {args.seed}",
          flush=True)
    result = run_benchmark(args.url, model, requests, concurrency=concurrency, slo=slo, timeout=args.timeout,
                           request_timeout=args.request_timeout, prompts=prompts, min_tokens=args.min_tokens,
                           count=args.count_tokens)
    print(result.metrics.table())
    counted = ", ".join(f"{WHAT_COUNTED[k]} for {n}" for k, n in sorted(result.counted_by.items()))
    if counted:
        print(f"output tokens counted from:\n  {counted} completed request(s)")
    report_failures(result)
    if result.count_mismatches:
        print(f"{result.count_mismatches} request(s): chunks carried a different token count than usage")
    report = {"arguments": vars(args), **result.to_json()}
    status = 0 if result.metrics.n_completed else 1
    write_report(args.json, report)  # now, and again with the comparison: a comparison that fails loses nothing
    if args.compare_engine:
        try:
            comparison = compare_with_engine(result, fetch_engine_records(args.url, min(args.timeout, 10.0)))
        except Exception as error:  # not a minillm server, records dropped, a bad answer
            message = f"{type(error).__name__}: {error}"
            print(f"--compare-engine: no comparison: {message}")
            report["engine"] = {"error": message}
            status = 1
        else:
            print(comparison.table())
            report["engine"] = {"metrics": metrics_dict(comparison.engine),
                                "added_ttft_ms": summary_ms(comparison.added_ttft),
                                "added_e2e_ms": summary_ms(comparison.added_e2e)}
        write_report(args.json, report)
    if args.json:
        print(f"results written to {args.json}")
    return status


def write_report(path: str | None, report: dict) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


WHAT_COUNTED = {"token_ids": "the chunks' token_ids", "usage": "the server's usage (completion_tokens)",
                "chunks": "one token per chunk (no token_ids, no usage)"}


def report_failures(result: BenchResult, show: int = 5) -> None:
    """How many requests failed and why: each distinct reason with its count, the most common first."""
    reasons = Counter(r.error or "no token arrived" for r in result.records if r.error or not r.token_times)
    if not reasons:
        return
    print(f"{reasons.total()} request(s) failed:")
    ranked = reasons.most_common()
    for reason, count in ranked[:show]:
        print(f"  {count} x {reason[:300]}")
    if len(ranked) > show:
        print(f"  ... and {len(ranked) - show} other reason(s) (see --json)")

if __name__ == "__main__":
    sys.exit(main())
