"""A soak run: minutes of mixed load on ``python -m minillm serve --model tiny``, then the books are checked;
then victims beside hostile clients, against the same victims alone.

    python benchmarks/soak.py --seconds 60 --hostile-seconds 20 --rounds 3 --per-kind   # the README's run
    python benchmarks/soak.py --skip-mixed --hostile-seconds 20 --rounds 1 --kinds "record poller"
    python benchmarks/soak.py --seconds 20 --requests 60 --hostile-seconds 6 --rounds 1   # tests/test_soak.py

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

Then, on a second server with the default limits, ``VICTIMS`` clients stream greedy completions back to
back in windows of ``--hostile-seconds``: alone (the baseline) and beside hostile clients (``HOSTILE``),
in turn for ``--rounds`` rounds, after a warm-up that is not counted; with ``--per-kind``, then a window
alone and one beside each hostile kind by itself. The hostile clients (streams that stop reading, bodies
that drip a byte at a time before and after a response, headers that never end, bodies at the size limit
sent back to back, pollers of the engine's records, JSON nested 100,000 deep) run in a process of their
own at a lower scheduling priority (``run_hostile`` says why). For each window it prints the victims'
tokens/s, their longest gap between two tokens, ``/health``'s slowest answer, the engine's wall time per
step (the window over its steps), the server's CPU time per victim token and the hostile clients' CPU
seconds; then the server's peak resident memory (VmRSS sampled every 20 ms) alone and beside. It checks
that no victim lost or repeated a token (each stream's tokens equal ``generate()`` alone), that the server
kept its memory within what its limits allow (``memory_bound_mb``) and that it still serves. The speed
targets (victims keep ``TARGET_SHARE`` of their tokens/s, the median over the rounds, and no gap over
``TARGET_GAP_S``) are printed met or missed; ``--strict-targets`` makes a missed one fail the run.

Traffic goes to 127.0.0.1 only; the run is bounded in time (``--seconds``, then ``--hostile-seconds`` times
twice the rounds, plus twice the kinds with ``--per-kind``, plus the checks) and in count.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import socket
import subprocess
import sys
import threading
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

VICTIMS, VICTIM_TOKENS = 4, 200  # clients streaming greedy completions of this many tokens, back to back
HOSTILE = {  # kind: clients of that kind
    "stalled reader": 2,  # streams of 2,000 tokens with 20 log-probs each (3 MB), never read; a new one each 11 s
    "dripping body": 4,  # a body's bytes, one every 0.5 s
    "dripping after a response": 2,  # GET /health with a chunked body that never ends
    "headers that never end": 2,  # one header byte every 0.5 s
    "body at the size limit": 2,  # 4 MiB of token ids, sent back to back
    "record poller": 3,  # GET /minillm/requests, back to back
    "deep JSON": 1,  # [[[[... 100,000 deep, back to back
}
HOSTILE_NICE = 10  # the hostile clients' scheduling priority (see run_hostile)
WARM_UP_S = 3.0  # victims alone before the first window, not counted: the server's first requests cost more
TARGET_SHARE, TARGET_GAP_S = 0.8, 1.0  # victims keep 80% of their tokens/s; no gap between tokens over 1 s


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
    parser.add_argument("--hostile-seconds", type=float, default=30.0,
                        help="each window of victims alone or beside hostile clients (default 30; 0: skip them)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="windows alone and beside every hostile kind, in turn (default 3; the median counts)")
    parser.add_argument("--per-kind", action="store_true",
                        help="then a window alone and one beside each hostile kind by itself")
    parser.add_argument("--kinds", type=lambda text: tuple(text.split(",")), default=None,
                        help="only these hostile kinds, comma-separated (default: all of " + ", ".join(HOSTILE) + ")")
    parser.add_argument("--skip-mixed", action="store_true", help="only the hostile windows, not the mixed load")
    parser.add_argument("--strict-targets", action="store_true",
                        help="a missed speed target (victims' tokens/s, longest gap) fails the run")
    parser.add_argument("--hostile", nargs=3, metavar=("PORT", "SECONDS", "KINDS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("seconds", "requests", "concurrency", "num_blocks", "request_timeout", "rounds"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.kinds is not None and not set(args.kinds) <= set(HOSTILE):
        parser.error(f"--kinds: unknown {sorted(set(args.kinds) - set(HOSTILE))}; known: {', '.join(HOSTILE)}")
    if args.skip_mixed and not args.hostile_seconds > 0:
        parser.error("--skip-mixed leaves nothing to run without --hostile-seconds")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.hostile:  # this script, started by run_window: be the hostile clients
        port, seconds, kinds = args.hostile
        print(json.dumps(run_hostile(int(port), float(seconds), kinds.split(","))))
        return 0
    if args.skip_mixed:
        return hostile_phase(args)
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
    status = report(args, books, before, after, rss_start, rss_end, duration, health_latency, server_alive, preempted)
    if args.hostile_seconds > 0:
        status |= hostile_phase(args)
    return status


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



# ---- victims beside hostile clients -----------------------------------------------------------------------
@dataclass
class Window:
    """What the victims saw in one run of ``--hostile-seconds`` (beside the hostile clients of ``kinds``)."""

    kinds: tuple[str, ...] = ()
    streams: list[Outcome] = field(default_factory=list)
    tokens: int = 0  # tokens of the victims' streams that arrived within the window
    longest_gap: float = 0.0  # s, the longest wait for the next token of a stream
    health: list[float] = field(default_factory=list)  # s, /health's answers
    peak_rss_kb: int = 0
    seconds: float = 0.0
    server_cpu: float = 0.0  # s of CPU the server process used in the window
    steps: int = 0  # steps the engine took in the window
    hostile_cpu: float = 0.0  # s of CPU the hostile clients' process used
    hostile: dict = field(default_factory=dict)  # what the hostile clients did (their process's summary)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def ms_per_step(self) -> float:
        """The window over the engine's steps, in ms: the wall time of a step, as the engine barely idles while
        four victims stream back to back (nan if it took no step)."""
        return 1e3 * self.seconds / self.steps if self.steps else float("nan")

    @property
    def cpu_per_token_ms(self) -> float:
        """The server's CPU time per victim token, in ms: what the hostile clients made it spend beside them."""
        return 1e3 * self.server_cpu / max(self.tokens, 1)

    @property
    def worst_health_ms(self) -> float:
        return 1e3 * max(self.health, default=float("nan"))


async def victims(base: str, seconds: float, window: Window) -> None:
    """``VICTIMS`` clients streaming greedy completions back to back for ``seconds``, and a /health pinger."""
    import httpx

    end = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=60, trust_env=False, limits=httpx.Limits(max_connections=None)) as client:
        async def victim(v: int) -> None:
            rng = random.Random(1000 + v)
            while time.monotonic() < end:
                prompt = rng.choice(PROMPTS)
                out = Outcome(len(window.streams), "victim", "error", prompt_ids=prompt, max_tokens=VICTIM_TOKENS)
                window.streams.append(out)
                body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": VICTIM_TOKENS, "ignore_eos": True,
                        "return_token_ids": True, "temperature": 0.0, "stream": True}
                last = None
                try:
                    async with client.stream("POST", base + "/v1/completions", json=body) as response:
                        done = 0
                        async for line in response.aiter_lines():
                            event = parse_sse(line)
                            if event == "[DONE]":
                                done += 1
                            elif isinstance(event, dict) and event.get("choices"):
                                now = time.monotonic()
                                ids = event["choices"][0].get("token_ids") or []
                                out.output_ids += ids
                                if now < end:
                                    window.tokens += len(ids)
                                if last is not None and ids:
                                    window.longest_gap = max(window.longest_gap, now - last)
                                last = now if ids else last
                    out.outcome = "completed" if done == 1 and len(out.output_ids) == VICTIM_TOKENS else "error"
                    out.detail = f"[DONE] x {done}, {len(out.output_ids)} tokens, HTTP {response.status_code}"
                except Exception as error:  # a victim's failure is counted, never raised
                    out.detail = f"{type(error).__name__}: {error}"[:200]

        async def pinger() -> None:
            while time.monotonic() < end:
                t = time.monotonic()
                try:
                    (await client.get(base + "/health", timeout=10)).raise_for_status()
                    window.health.append(time.monotonic() - t)
                except Exception:  # a failed ping is the worst latency there is
                    window.health.append(float("inf"))
                await asyncio.sleep(0.1)

        start = time.monotonic()
        await asyncio.gather(pinger(), *(victim(v) for v in range(VICTIMS)))
        window.seconds = min(seconds, time.monotonic() - start)


def sample_rss(pid: int, stop: threading.Event, window: Window) -> None:
    while not stop.wait(0.02):
        try:
            window.peak_rss_kb = max(window.peak_rss_kb, rss_kb(pid))
        except (OSError, RuntimeError):  # the server has exited
            return


def cpu_seconds(pid: int) -> float:
    """The user + system CPU time a process has used so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_window(server, seconds: float, kinds: tuple[str, ...] = ()) -> Window:
    """The victims for ``seconds``, beside the hostile clients of ``kinds`` (in a process of their own)."""
    window, stop = Window(kinds), threading.Event()
    sampler = threading.Thread(target=sample_rss, args=(server.process.pid, stop, window))
    sampler.start()
    cpu_before, steps_before = cpu_seconds(server.process.pid), server.health()["steps"]
    clients = subprocess.Popen([sys.executable, __file__, "--hostile", str(server.port), str(seconds), ",".join(kinds)],
                               stdout=subprocess.PIPE, text=True) if kinds else None
    try:
        asyncio.run(victims(server.base, seconds, window))
    finally:
        window.server_cpu = cpu_seconds(server.process.pid) - cpu_before
        window.steps = server.health()["steps"] - steps_before
        if clients is not None:
            out, _ = clients.communicate(timeout=seconds + 120)
            window.hostile = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"error": "no summary"}
            window.hostile_cpu = window.hostile.pop("cpu seconds", float("nan"))
        stop.set()
        sampler.join()
    return window


def memory_bound_mb() -> float:
    """How much more resident memory than without them the hostile clients may cost the server: the bodies
    in transit (``--max-transit-bytes``), one body being parsed (the parser's values and the list of Python
    ints: about 20 times the bytes of a body of token ids), the stalled streams' outputs (at most two open
    per client, ``max_buffered_outputs`` each of about 4 KB with 20 log-probs), and 64 MB for allocator slack
    and thread stacks."""
    from minillm.serving.limits import ServerLimits

    limits = ServerLimits()
    stalled = 2 * HOSTILE["stalled reader"] * limits.max_buffered_outputs * 4000
    return (limits.max_transit_bytes + 20 * limits.max_body_bytes + stalled) / 2**20 + 64


def hostile_phase(args) -> int:
    """Victims alone and beside the hostile clients, window after window, on a server with the default
    limits; the figures, the checks and the targets. Returns 1 if a check (or, with --strict-targets, a
    target) failed."""
    from minillm.serving import launch_server

    server_args = ["--model", "tiny", "--seed", str(args.seed), "--device", "cpu", "--threads", str(args.threads),
                   "--max-batch-size", str(args.max_batch_size), "--no-access-log"]
    kinds = tuple(HOSTILE) if args.kinds is None else args.kinds
    print(f"\nhostile: python -m minillm serve {' '.join(server_args)}")
    print(f"  {VICTIMS} victims streaming {VICTIM_TOKENS}-token greedy completions back to back, in windows of "
          f"{args.hostile_seconds:g} s, alone and beside: " + ", ".join(f"{HOSTILE[k]} x {k}" for k in kinds))
    print(f"  the hostile clients run in a process of their own at nice {HOSTILE_NICE} (an attacker's CPU is "
          "not the server's); their CPU seconds are printed", flush=True)
    with launch_server(server_args) as server:
        run_window(server, WARM_UP_S)
        rounds = [(run_window(server, args.hostile_seconds), run_window(server, args.hostile_seconds, kinds))
                  for _ in range(args.rounds)]
        each = [(run_window(server, args.hostile_seconds), run_window(server, args.hostile_seconds, (kind,)))
                for kind in kinds] if args.per_kind else []
        after = wait_idle(server.base)
        alive = server.process.poll() is None
    return hostile_report(args, rounds, each, after, alive)


def window_rows(pairs: list[tuple[Window, Window]], labels: list[str]) -> float:
    """One row per (alone, beside) pair, under its label; the median share of the victims' tokens/s kept."""
    print(f"  {'':<28}{'tokens/s':>19}{'kept':>6}{'longest gap ms':>16}{'/health ms':>12}{'engine ms/step':>16}"
          f"{'server CPU ms/tok':>19}{'hostile':>9}")
    print(f"  {'':<28}{'alone':>9}{'beside':>10}{'':>6}{'alone':>8}{'beside':>8}{'beside':>12}{'alone':>8}"
          f"{'beside':>8}{'alone':>9}{'beside':>10}{'CPU s':>9}")
    shares = []
    for label, (alone, beside) in zip(labels, pairs):
        shares.append(beside.tokens_per_s / alone.tokens_per_s if alone.tokens else 0.0)
        print(f"  {label:<28}{alone.tokens_per_s:>9.0f}{beside.tokens_per_s:>10.0f}{100 * shares[-1]:>5.0f}%"
              f"{1e3 * alone.longest_gap:>8.0f}{1e3 * beside.longest_gap:>8.0f}{beside.worst_health_ms:>12.0f}"
              f"{alone.ms_per_step:>8.2f}{beside.ms_per_step:>8.2f}{alone.cpu_per_token_ms:>9.3f}"
              f"{beside.cpu_per_token_ms:>10.3f}{beside.hostile_cpu:>9.1f}")
    return sorted(shares)[len(shares) // 2]


def hostile_report(args, rounds: list[tuple[Window, Window]], each: list[tuple[Window, Window]], after: dict,
                   alive: bool) -> int:
    windows = [w for pair in rounds + each for w in pair]
    books = Books()
    for out in (o for w in windows for o in w.streams):
        out.request_id = len(books.outcomes)
        books.record(out)
    checked, mismatched, examples, _ = reference_mismatches(books, args.seed)
    failed_streams = [o for o in books.outcomes.values() if o.outcome != "completed"]
    alone_rss = rounds[0][0].peak_rss_kb  # the first window, before any hostile client (freed memory stays mapped)
    beside_rss = max(w.peak_rss_kb for w in windows)
    growth = (beside_rss - alone_rss) / 1024
    print("  every hostile kind together, round by round:")
    share = window_rows(rounds, [f"round {i + 1}" for i in range(len(rounds))])
    if each:
        print("  each hostile kind alone:")
        window_rows(each, [beside.kinds[0] for _, beside in each])
    beside = [w for _, w in rounds]
    gap = max(w.longest_gap for w in beside)
    print(f"  victims kept {100 * share:.0f}% of their tokens/s (median of {len(rounds)} round(s)); server peak RSS "
          f"{alone_rss / 1024:.1f} MB before any hostile client, {beside_rss / 1024:.1f} MB at most after "
          f"({growth:+.1f} MB; bound "
          f"{memory_bound_mb():.0f} MB)")
    print("  hostile clients, last round: " + ", ".join(f"{k} {v}" for k, v in beside[-1].hostile.items()))
    checks = [
        ("no victim lost or repeated a token (each stream equals generate() alone, [DONE] once)",
         not failed_streams and mismatched == 0 and checked > 0,
         f"{len(failed_streams)} failed ({'; '.join(o.detail for o in failed_streams[:3])}), "
         f"{mismatched} of {checked} differ; " + "; ".join(examples)),
        (f"the server's peak memory grew by at most {memory_bound_mb():.0f} MB", growth <= memory_bound_mb(),
         f"{growth:+.1f} MB"),
        ("all KV blocks free after the hostile clients, the server still running",
         alive and (after["kv_blocks_used"], after["running"], after["waiting"]) == (0, 0, 0), str(after)),
    ]
    targets = [
        (f"victims keep >= {100 * TARGET_SHARE:.0f}% of their tokens/s", share >= TARGET_SHARE, f"{100 * share:.0f}%"),
        (f"no victim waits more than {TARGET_GAP_S:g} s for a token", gap <= TARGET_GAP_S, f"{gap:.2f} s"),
    ]
    failed = 0
    for name, ok, detail in checks:
        failed += not ok
        print(f"  {'PASS' if ok else 'FAIL'}  {name}" + ("" if ok else f": {detail}"))
    for name, ok, detail in targets:
        failed += args.strict_targets and not ok
        print(f"  TARGET {'met' if ok else 'MISSED'}: {name} ({detail})")
    print("hostile: " + ("all checks passed" if not failed else f"{failed} check(s) FAILED"))
    return 1 if failed else 0


# ---- the hostile clients (run in a process of their own: `soak.py --hostile PORT SECONDS KINDS`) -----------
def run_hostile(port: int, seconds: float, kinds: list[str]) -> dict:
    """The ``HOSTILE`` clients of ``kinds``, each on a thread, for ``seconds``; what they got, counted, and the
    CPU seconds this process used.

    The process runs at nice ``HOSTILE_NICE``: on a real server an attacker's clients run on the attacker's
    machines, while here they share the CPU with the server, and their own work (building and sending 4 MiB
    bodies, reading pages of records) would count as the server's weakness. The server's CPU time per victim
    token is what shows what they made it spend."""
    os.nice(HOSTILE_NICE)
    end, tally, lock = time.monotonic() + seconds, Counter(), threading.Lock()

    def count(what: str) -> None:
        with lock:
            tally[what] += 1

    def connect() -> socket.socket:
        return socket.create_connection(("127.0.0.1", port), timeout=5)

    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"

    def status_of(sock: socket.socket) -> str:
        """The response's status; after a 429 or 503 (or a connection closed on it) wait for its Retry-After
        (1 s), as HTTP asks of any client."""
        try:
            reply = sock.recv(64)
            status = reply.split(b" ")[1].decode() if reply.startswith(b"HTTP/1.1 ") else "closed"
        except OSError:
            status = "closed"
        if status in ("429", "503", "closed"):
            time.sleep(1.0)
        return status

    def until_closed(sock: socket.socket, drip: bytes) -> None:
        """Send ``drip`` every 0.5 s until the server closes the connection (or the run ends); then wait 0.5 s
        more before the next connection (a client that reconnects at once is a flood of requests, which only
        a limit per client address stops, and every client here is 127.0.0.1)."""
        sock.settimeout(0.5)
        while time.monotonic() < end:
            try:
                sock.sendall(drip)
                if sock.recv(65536) == b"":
                    break
            except TimeoutError:
                continue
            except OSError:
                break
        count("dripping connections closed by the server")
        time.sleep(0.5)

    def stalled() -> None:
        """A stream nobody reads; once the server has given up on it (``--send-timeout``, 10 s), the next."""
        body = json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2000,
                           "ignore_eos": True, "logprobs": True, "top_logprobs": 20, "stream": True}).encode()
        while time.monotonic() < end:
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(("127.0.0.1", port))
                sock.sendall(head.replace(b"/v1/completions", b"/v1/chat/completions")
                             + b"Content-Length: %d\r\n\r\n" % len(body) + body)
                count("stalled streams")
                time.sleep(min(11.0, max(0.0, end - time.monotonic())))

    def dripping_body() -> None:
        while time.monotonic() < end:
            with connect() as sock:
                sock.sendall(head + b"Content-Length: 100000\r\n\r\n{")
                until_closed(sock, b" ")

    def dripping_after_response() -> None:
        while time.monotonic() < end:
            with connect() as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n")
                until_closed(sock, b"1\r\nx\r\n")

    def endless_headers() -> None:
        while time.monotonic() < end:
            with connect() as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                until_closed(sock, b"a")

    from minillm.serving.limits import ServerLimits

    limit = ServerLimits.max_body_bytes  # the server's default
    ids = json.dumps({"model": MODEL_NAME, "prompt": [7] * (limit // 3), "max_tokens": 1}).encode()
    big = ids[:ids.rfind(b",", 0, limit - 32)] + b"], \"max_tokens\": 1}"  # just under the limit

    def body_at_the_limit() -> None:
        while time.monotonic() < end:
            try:
                with connect() as sock:
                    sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(big) + big)
                    count(f"bodies at the limit: {status_of(sock)}")
            except OSError:  # refused before the body was all sent
                count("bodies at the limit: closed while sending")
                time.sleep(1.0)

    deep = head + b"Content-Length: 100000\r\n\r\n" + b"[" * 100_000

    def deep_json() -> None:
        while time.monotonic() < end:
            try:
                with connect() as sock:
                    sock.sendall(deep)
                    count(f"deep JSON: {status_of(sock)}")
            except OSError:
                count("deep JSON: closed while sending")
                time.sleep(1.0)

    def poller() -> None:
        request = b"GET /minillm/requests HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        while time.monotonic() < end:
            try:
                with connect() as sock:
                    sock.sendall(request)
                    status = status_of(sock)
                    sock.settimeout(10)
                    while sock.recv(1 << 20):
                        pass
                    count(f"record pages: {status}")
            except OSError:
                count("record pages: failed")
                time.sleep(1.0)

    clients = {"stalled reader": stalled, "dripping body": dripping_body,
             "dripping after a response": dripping_after_response, "headers that never end": endless_headers,
             "body at the size limit": body_at_the_limit, "record poller": poller, "deep JSON": deep_json}
    threads = [threading.Thread(target=clients[kind], daemon=True) for kind in kinds for _ in range(HOSTILE[kind])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, end - time.monotonic()) + 30)
    used = resource.getrusage(resource.RUSAGE_SELF)
    return dict(sorted(tally.items())) | {"cpu seconds": used.ru_utime + used.ru_stime}


if __name__ == "__main__":
    sys.exit(main())
