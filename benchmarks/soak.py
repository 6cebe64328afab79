"""A soak run: minutes of mixed load on ``python -m minillm serve --model tiny``, then the books are checked.

    python benchmarks/soak.py --seconds 180            # the README's run
    python benchmarks/soak.py --seconds 20 --requests 60   # tests/test_soak.py

The server runs as a child process on 127.0.0.1 (``minillm.serving.launch_server``) with a KV pool small
enough that requests are preempted (``--num-blocks``). ``--concurrency`` clients send, until ``--seconds``
have passed or ``--requests`` have been sent, a random mix of:

- greedy completions and chat completions, streaming or not, asking ``ignore_eos`` and
  ``return_token_ids`` (the server's token ids, prompt and output, are what is checked);
- seeded sampled requests (temperature 0.8, top_p 0.95);
- streams the client drops after a few chunks, and non-streaming requests it abandons at a short
  timeout (both are aborts on the server);
- bad requests (invalid JSON, max_tokens 0, a token id outside the vocabulary, an unknown model): each
  must get its 400 or 404;
- degenerate sampling values (temperature and top_p of 1e-300: greedy, not NaN).

At the end it checks, prints its figures, and exits 1 if a check fails:

1. every request got exactly one outcome (none lost, none counted twice), none an unexpected one (a 5xx,
   a stream without [DONE] or with two finish_reasons, a response id seen twice), and the server's own
   books agree: its finished + aborted requests went up by exactly the requests that reached the engine,
   and its failed ones not at all;
2. every completed greedy request's tokens equal ``generate()`` alone for the same prompt, and every
   seeded sampled one's equal ``generate()`` with the same seed (prompts, chat texts and seeds come from
   small fixed pools, so that one ``generate()`` run, as long as the longest output asked, checks every
   request of its case: with ``ignore_eos`` a shorter output must be its first tokens);
3. all KV blocks are free (``/health``: kv_blocks_used 0, nothing running or waiting);
4. the server's resident memory (VmRSS, /proc/PID/status) grew by at most ``--max-rss-growth-mb`` from
   after the warm-up to the end.

Traffic goes to 127.0.0.1 only; the run is bounded in time (``--seconds`` plus the checks) and in count.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

MODEL_NAME = "tiny"
KINDS = {  # kind: weight in the mix
    "completion": 4, "completion-stream": 4, "chat": 2, "chat-stream": 3, "sampled": 2, "sampled-stream": 2,
    "disconnect": 2, "abandon": 1, "bad": 2, "degenerate": 1,
}
BAD = ("invalid-json", "max-tokens-0", "token-out-of-vocab", "unknown-model")
# Prompts come from small pools, so that the check runs generate() once per distinct case (the longest output
# asked), not once per request: with ignore_eos, a greedy or seeded output of n tokens is the first n of it.
POOL_SEED = 12345
_pool = random.Random(POOL_SEED)
PROMPTS = [[_pool.randrange(256) for _ in range(_pool.randint(4, 48))] for _ in range(32)]
CHAT_TEXTS = ["".join(chr(_pool.randrange(32, 127)) for _ in range(_pool.randint(4, 40))) for _ in range(16)]
SAMPLED = [(_pool.randrange(len(PROMPTS)), _pool.randrange(2**31)) for _ in range(12)]  # (prompt, seed)


@dataclass
class Outcome:
    """What one request came to, as the client saw it."""

    request_id: int
    kind: str
    outcome: str  # completed, disconnected, abandoned, rejected, error
    detail: str = ""
    reached_engine: bool = True
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    max_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    response_id: str | None = None
    seconds: float = 0.0


class Books:
    """Every request's outcome, recorded once; a second record for one request is counted, not kept."""

    def __init__(self):
        self.outcomes: dict[int, Outcome] = {}
        self.sent: set[int] = set()
        self.duplicates = 0

    def record(self, outcome: Outcome) -> None:
        if outcome.request_id in self.outcomes:
            self.duplicates += 1
        else:
            self.outcomes[outcome.request_id] = outcome


def rss_kb(pid: int) -> int:
    """VmRSS of a process in kB (Linux)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def parse_sse(line: str):
    """A data line's JSON (or "[DONE]"); None for anything else."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return data if data == "[DONE]" else json.loads(data)


async def one_request(client, base: str, rid: int, kind: str, rng: random.Random) -> Outcome:
    """Send one request of ``kind`` and say what came of it (never raises)."""
    t0 = time.monotonic()
    chat = kind.startswith("chat")
    stream = kind.endswith("-stream") or kind == "disconnect"
    prompt = rng.choice(PROMPTS[:8] if kind == "degenerate" else PROMPTS)
    long = rng.random() < 0.2  # long outputs fill the small pool: preemptions
    max_tokens = rng.randint(96, 128) if long else rng.randint(4, 48)
    body: dict = {"model": MODEL_NAME, "max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True,
                  "temperature": 0.0}
    out = Outcome(rid, kind, "error", max_tokens=max_tokens)
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(CHAT_TEXTS)}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        out.prompt_ids = prompt
        path = "/v1/completions"
    if kind.startswith("sampled"):
        index, seed = rng.choice(SAMPLED)
        prompt = PROMPTS[index]
        body.update(prompt=prompt, temperature=0.8, top_p=0.95, seed=seed)
        out.prompt_ids = prompt
        out.temperature, out.top_p, out.seed = 0.8, 0.95, body["seed"]
    if kind == "degenerate":
        body.update(rng.choice(({"temperature": 1e-300}, {"temperature": 0.7, "top_p": 1e-300})))
        out.temperature, out.top_p = body["temperature"], body.get("top_p", 1.0)
    if stream:
        body["stream"] = True
    content = None
    if kind == "bad":
        which = rng.choice(BAD)
        out.detail, out.reached_engine = which, False
        if which == "invalid-json":
            content = b'{"model": "tiny", "prompt": [1, 2'
        elif which == "max-tokens-0":
            body["max_tokens"] = 0
        elif which == "token-out-of-vocab":
            body["prompt"] = [1, 999, 2]
        else:
            body["model"] = "no-such-model"
    try:
        if kind == "bad":
            response = await client.post(base + path, content=content or json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
            expected = 404 if out.detail == "unknown-model" else 400
            ok = response.status_code == expected and "error" in response.json()
            out.outcome = "rejected" if ok else "error"
            out.detail += f" -> HTTP {response.status_code}"
        elif kind == "abandon":
            try:
                body["max_tokens"] = max(max_tokens, 100)
                await client.post(base + path, json=body, timeout=rng.uniform(0.05, 0.4))
                out.outcome, out.detail = "completed-unchecked", "finished before the client gave up"
            except Exception as error:  # httpx.TimeoutException: the client gives up, the server aborts
                out.outcome, out.detail = "abandoned", type(error).__name__
        elif stream:
            await _stream(client, base + path, body, out, chat, drop_after=rng.randint(1, 4)
                          if kind == "disconnect" else None)
        else:
            response = await client.post(base + path, json=body)
            if response.status_code != 200:
                out.detail = f"HTTP {response.status_code}: {response.text[:200]}"
            else:
                data = response.json()
                choice = data["choices"][0]
                out.response_id = data["id"]
                out.output_ids = choice["token_ids"]
                out.prompt_ids = data["prompt_token_ids"] if chat else choice["prompt_token_ids"]
                if len(out.output_ids) != body["max_tokens"] or choice["finish_reason"] != "length":
                    out.detail = f"{len(out.output_ids)} tokens, finish {choice['finish_reason']!r}"
                else:
                    out.outcome = "completed"
    except Exception as error:  # anything unexpected is this request's error outcome
        out.outcome, out.detail = "error", f"{type(error).__name__}: {error}"[:300]
    out.seconds = time.monotonic() - t0
    return out


async def _stream(client, url: str, body: dict, out: Outcome, chat: bool, drop_after: int | None) -> None:
    """A streaming request: its chunks' token ids, exactly one finish_reason, then [DONE]; or, with
    ``drop_after``, the connection closed after that many chunks."""
    finishes, done, chunks = [], 0, 0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            out.detail = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return
        async for line in response.aiter_lines():
            event = parse_sse(line)
            if event is None:
                continue
            if event == "[DONE]":
                done += 1
                continue
            if "error" in event:
                out.detail = f"error event: {event['error']}"[:300]
                return
            if chat and "prompt_token_ids" in event:
                out.prompt_ids = event["prompt_token_ids"]
            out.response_id = out.response_id or event.get("id")
            for choice in event["choices"]:
                if not chat and "prompt_token_ids" in choice:
                    out.prompt_ids = choice["prompt_token_ids"]
                out.output_ids += choice.get("token_ids") or []
                if choice.get("finish_reason") is not None:
                    finishes.append(choice["finish_reason"])
                if choice.get("token_ids"):
                    chunks += 1
            if drop_after is not None and chunks >= drop_after:
                out.outcome, out.detail = "disconnected", f"after {chunks} chunk(s)"
                return  # leaving the block closes the connection: the server must abort the request
    if drop_after is not None:  # it ended before the client could leave
        out.outcome = "completed-unchecked"
    elif done != 1 or finishes != ["length"] or len(out.output_ids) != body["max_tokens"]:
        out.detail = f"[DONE] x {done}, finish_reasons {finishes}, {len(out.output_ids)} tokens"
    else:
        out.outcome = "completed"


async def load(base: str, args, books: Books, health_latency: list[float]) -> float:
    """The clients and a /health pinger, until time or the request budget runs out; the seconds it took."""
    import httpx

    rng = random.Random(args.seed)
    kinds, weights = list(KINDS), list(KINDS.values())
    deadline = time.monotonic() + args.seconds
    counter = iter(range(args.requests))
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits, trust_env=False) as client:
        async def user(u: int) -> None:
            user_rng = random.Random(rng.randrange(2**32) + u)
            while time.monotonic() < deadline:
                rid = next(counter, None)
                if rid is None:
                    return
                books.sent.add(rid)
                books.record(await one_request(client, base, rid, user_rng.choices(kinds, weights)[0], user_rng))

        async def pinger(stop: asyncio.Event) -> None:
            while not stop.is_set():
                t = time.monotonic()
                try:
                    (await client.get(base + "/health", timeout=10)).raise_for_status()
                    health_latency.append(time.monotonic() - t)
                except Exception:  # a failed ping is the worst latency there is
                    health_latency.append(float("inf"))
                await asyncio.sleep(0.25)

        t0, stop = time.monotonic(), asyncio.Event()
        ping = asyncio.ensure_future(pinger(stop))
        await asyncio.gather(*(user(u) for u in range(args.concurrency)))
        stop.set()
        await ping
        return time.monotonic() - t0


def reference_mismatches(books: Books, seed: int) -> tuple[int, int, list[str], int]:
    """(checked, mismatched, examples, generate() runs): completed requests whose tokens differ from
    generate() alone. One run per distinct (prompt, sampling, seed), as long as the longest output asked
    of it: a shorter request's tokens must be its first ones (ignore_eos: no EOS ends either early)."""
    import torch

    from minillm import build_model, generate
    from minillm.sampling import SamplingParams

    torch.set_num_threads(1)
    model = build_model("tiny", device="cpu", dtype="float32", seed=seed)
    completed = [o for o in books.outcomes.values() if o.outcome == "completed"]
    longest: dict[tuple, int] = {}
    for out in completed:
        key = (tuple(out.prompt_ids), out.temperature, out.top_p, out.seed)
        longest[key] = max(longest.get(key, 0), len(out.output_ids))
    reference = {key: generate(model, list(key[0]), n, sampling=SamplingParams(temperature=key[1], top_p=key[2]),
                               seed=key[3]) for key, n in longest.items()}
    checked, bad, examples = 0, 0, []
    for out in completed:
        expected = reference[(tuple(out.prompt_ids), out.temperature, out.top_p, out.seed)][:len(out.output_ids)]
        checked += 1
        if expected != out.output_ids:
            bad += 1
            if len(examples) < 3:
                examples.append(f"request {out.request_id} ({out.kind}): got {out.output_ids[:8]}..., "
                                f"generate() {expected[:8]}...")
    return checked, bad, examples, len(reference)


def get_json(url: str) -> dict:
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as response:
        return json.load(response)


def wait_idle(base: str, seconds: float = 30.0) -> dict:
    """/health once nothing runs or waits and no block is held (or the last answer after ``seconds``)."""
    end = time.monotonic() + seconds
    while True:
        health = get_json(base + "/health")
        if (health["running"], health["waiting"], health["kv_blocks_used"]) == (0, 0, 0) or time.monotonic() > end:
            return health
        time.sleep(0.2)


def preemptions(base: str) -> str:
    """Preemptions over the engine's records of its latest requests (``/minillm/requests``), as text."""
    try:
        page = get_json(base + "/minillm/requests?limit=1000&token_times=false")
        records = page["requests"]
        return f"{sum(r.get('preemptions', 0) for r in records)} over the engine's last {len(records)} records"
    except Exception as error:  # an older or newer server: the figure is only informative
        return f"n/a ({type(error).__name__})"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="how long the load runs (default 180)")
    parser.add_argument("--requests", type=int, default=100_000, help="at most this many requests (default 100000)")
    parser.add_argument("--concurrency", type=int, default=12, help="clients sending at once (default 12)")
    parser.add_argument("--num-blocks", type=int, default=24,
                        help="the server's KV pool, in blocks of 16 tokens (default 24: requests are preempted)")
    parser.add_argument("--max-batch-size", type=int, default=8, help="default 8")
    parser.add_argument("--seed", type=int, default=0, help="seed of the mix and of the tiny model (default 0)")
    parser.add_argument("--request-timeout", type=float, default=120.0,
                        help="seconds any one request may take before it counts as an error (default 120)")
    parser.add_argument("--max-rss-growth-mb", type=float, default=100.0,
                        help="the server's RSS may grow this much from the warm-up to the end (default 100)")
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads (default 1)")
    args = parser.parse_args(argv)
    for name in ("seconds", "requests", "concurrency", "num_blocks", "request_timeout"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from minillm.serving import launch_server

    server_args = ["--model", "tiny", "--seed", str(args.seed), "--device", "cpu", "--threads", str(args.threads),
                   "--max-batch-size", str(args.max_batch_size), "--num-blocks", str(args.num_blocks)]
    print(f"soak: python -m minillm serve {' '.join(server_args)}")
    print(f"  {args.concurrency} clients, up to {args.seconds:g} s and {args.requests} requests; mix "
          + ", ".join(f"{k} {w}" for k, w in KINDS.items()), flush=True)
    books, health_latency = Books(), []
    with launch_server(server_args) as server:
        base, pid = server.base, server.process.pid
        warm = Books()  # a few requests first, so that the RSS baseline holds a warmed-up server
        warm_args = argparse.Namespace(**{**vars(args), "seconds": 60.0, "requests": 8, "concurrency": 4})
        asyncio.run(load(base, warm_args, warm, []))
        before, rss_start = wait_idle(base), rss_kb(pid)
        duration = asyncio.run(load(base, args, books, health_latency))
        after = wait_idle(base)
        rss_end = rss_kb(pid)
        preempted = preemptions(base)
        server_alive = server.process.poll() is None
    return report(args, books, before, after, rss_start, rss_end, duration, health_latency, server_alive, preempted)


def report(args, books: Books, before: dict, after: dict, rss_start: int, rss_end: int,
           duration: float, health_latency: list[float], server_alive: bool, preempted: str = "n/a") -> int:
    outcomes = Counter(o.outcome for o in books.outcomes.values())
    lost = len(books.sent - books.outcomes.keys())
    errors = [o for o in books.outcomes.values() if o.outcome == "error"]
    ids = [o.response_id for o in books.outcomes.values() if o.response_id]
    repeated_ids = len(ids) - len(set(ids))
    reached = sum(o.reached_engine for o in books.outcomes.values())
    ended = (after["finished"] + after["aborted"]) - (before["finished"] + before["aborted"])
    failed = after.get("failed", 0) - before.get("failed", 0)
    t_check = time.monotonic()
    checked, mismatched, examples, runs = reference_mismatches(books, args.seed)
    t_check = time.monotonic() - t_check
    kinds = Counter(o.kind for o in books.outcomes.values())
    completed_tokens = sum(len(o.output_ids) for o in books.outcomes.values() if o.outcome == "completed")
    finite = sorted(x for x in health_latency if x != float("inf"))
    worst_health = max(health_latency) if health_latency else float("nan")
    growth_mb = (rss_end - rss_start) / 1024

    print(f"\nsoak: {len(books.sent)} requests in {duration:.1f} s ({len(books.sent) / duration:.1f} req/s), "
          f"{completed_tokens} output tokens checked over {checked} completed requests "
          f"(against {runs} generate() runs, {t_check:.0f} s)")
    print("  kinds:    " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    print("  outcomes: " + ", ".join(f"{k} {n}" for k, n in sorted(outcomes.items())))
    print(f"  server:   finished+aborted +{ended} (requests that reached the engine: {reached}), failed +{failed}, "
          f"steps {after['steps'] - before['steps']}; preemptions {preempted}")
    print(f"  /health:  {len(health_latency)} pings during the load, p50 {1e3 * finite[len(finite) // 2]:.0f} ms, "
          f"worst {1e3 * worst_health:.0f} ms" if finite else "  /health: no ping answered")
    print(f"  KV pool:  {after['kv_blocks_used']} of {after['kv_blocks_total']} blocks used at the end; running "
          f"{after['running']}, waiting {after['waiting']}")
    print(f"  RSS:      {rss_start / 1024:.1f} MB after warm-up -> {rss_end / 1024:.1f} MB at the end "
          f"({growth_mb:+.1f} MB)")
    checks = [
        ("every request has exactly one outcome (none lost, none twice)", lost == 0 and books.duplicates == 0,
         f"lost {lost}, recorded twice {books.duplicates}"),
        ("no unexpected outcome (5xx, bad stream, wrong status)", not errors,
         "; ".join(f"#{o.request_id} {o.kind}: {o.detail}" for o in errors[:3])),
        ("no response id seen twice", repeated_ids == 0, f"{repeated_ids} repeated"),
        ("the server's books: finished+aborted = requests that reached the engine, none failed",
         ended == reached and failed == 0, f"+{ended} vs {reached}, failed +{failed}"),
        ("greedy and seeded tokens equal generate() alone", mismatched == 0 and checked > 0,
         f"{mismatched} of {checked} differ; " + "; ".join(examples)),
        ("all KV blocks free, nothing running or waiting",
         (after["kv_blocks_used"], after["running"], after["waiting"]) == (0, 0, 0), str(after)),
        (f"RSS growth <= {args.max_rss_growth_mb:g} MB", growth_mb <= args.max_rss_growth_mb, f"{growth_mb:+.1f} MB"),
        ("the server is still running", server_alive, "it exited"),
    ]
    failed_checks = 0
    for name, ok, detail in checks:
        failed_checks += not ok
        print(f"  {'PASS' if ok else 'FAIL'}  {name}" + ("" if ok else f": {detail}"))
    print("soak: " + ("all checks passed" if not failed_checks else f"{failed_checks} check(s) FAILED"))
    return 1 if failed_checks else 0


if __name__ == "__main__":
    sys.exit(main())
