"""Command-line demo: ``python -m minillm``.

``--model smollm2`` (the default): the trained SmolLM2-135M-Instruct (``minillm.load_pretrained``). A prompt
in, the text streamed out token by token as the cached path generates it; ``--chat`` wraps the prompt in the
chat template, and generation stops at the end-of-turn token ``<|im_end|>``. Then TTFT, TPOT and tokens/s of
the run. ``--compare`` also runs the naive path (the whole sequence recomputed every step) and checks that it
gives the same tokens. ``--precision {float32,bfloat16,int8,int4}`` picks the weights (``minillm.fast.precision.
PRECISIONS``): int4 is the GGUF file's own 4-bit weights through the block kernel (or PyTorch's int4 kernel).

``--speculative {int4,ngram}`` with ``--k K``: speculative decoding (``minillm.speculative``): the int4 weights or
prompt lookup guess K tokens, the loaded model checks them in one call; the reply is streamed from it, then
plain decode runs too, for its timings and (greedy) the same tokens, with the acceptance rate, the tokens per
target call and the speed-up.

``--model tiny``: a small model with RANDOM weights (so the text is gibberish); it always runs both paths
greedily, checks that they give the same tokens, and prints their timings side by side.

Exit status: 0 when all went well, 1 when the naive and cached paths disagree, 2 for a bad argument,
3 when the model is not installed (the message says what to install): ``minillm.cli_common``.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import NamedTuple

import torch

from .analysis.metrics import RequestTiming, e2e_latency, tpot, ttft
from .cli_common import (
    PRETRAINED,
    add_model_args,
    check_model_args,
    int_range,
    load_or_exit,
    weights_name,
    weights_text,
)
from .config import PRESETS
from .fast.blockdot import BlockLinear
from .fast.compiled import STEPS, command_line_decoder
from .fast.int4 import load_int4
from .generate import TokenEvent, stream_generate
from .sampling import SamplingParams
from .speculative import PromptLookup, SpeculativeStats, speculative_generate
from .text.byte import ByteTokenizer
from .text.stream import TextStream
from .timing import now
from .validate import check_lengths

EXAMPLE_PROMPT = "请介绍一下Transformer"  # the source documents' example request (the tiny demo's prompt)
DEFAULT_PROMPTS = {"chat": "What is the capital of France?", "text": "Once upon a time, in a small village,"}
BUILDABLE = [name for name, config in PRESETS.items() if config.n_params <= 100_000_000]
NEAR_TIE = {torch.float32: 1e-4, torch.bfloat16: 0.25, torch.float16: 0.05}  # logit gap rounding can flip
# Activations rounded to int8 (the block kernel): a float difference of one ulp can move an int8 step, so two
# paths' logits differ by about the rounding's own error; on SmolLM2 int4 (cached steps against full
# forwards, 128 tokens) the top-2 gap moved by up to 0.36 (95th percentile 0.28): twice that.
INT8_ACTIVATIONS_TIE = 0.75
WARMUP_TOKENS = 8
PATHS = {"naive": "naive  (recompute all every step)", "cached": "cached (KV cache: prefill, decode)",
         "speculative": "speculative (k guesses, 1 check)"}
DRAFTS = {"int4": "the file's own int4 weights", "ngram": "prompt lookup"}


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m minillm",
        description="Generate text with minillm: the trained SmolLM2-135M-Instruct (default; streamed, with "
                    "TTFT / TPOT / tokens/s), or a tiny random-weight model that compares naive and cached "
                    "generation.")
    parser.add_argument("text", nargs="?", default=None, metavar="PROMPT", help="the prompt (or use --prompt)")
    parser.add_argument("--prompt", default=None,
                        help=f"default: {DEFAULT_PROMPTS['chat']!r} with --chat, {DEFAULT_PROMPTS['text']!r} "
                             f"without; tiny: {EXAMPLE_PROMPT!r}")
    add_model_args(parser)
    parser.add_argument("--chat", action="store_true",
                        help="apply the chat template to the prompt; stops at <|im_end|> (smollm2 only)")
    parser.add_argument("--max-new-tokens", type=int_range(1), default=256,
                        help="most tokens to generate (default 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass to keep (default 1.0: all)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the sampler, and of the tiny model's random weights (default 0)")
    parser.add_argument("--compare", action="store_true",
                        help="also run the naive path and check it gives the same tokens (tiny: always)")
    parser.add_argument("--preset", choices=BUILDABLE, default=None,
                        help="the tiny demo's model shape (default tiny; the LLaMA presets are too big to build)")
    parser.add_argument("--speculative", choices=list(DRAFTS), default=None,
                        help="speculative decoding (smollm2): the file's int4 weights or prompt lookup guess --k "
                             "tokens, the model checks them in one call; also runs plain decode to compare")
    parser.add_argument("--k", type=int_range(1), default=4, help="guesses per round with --speculative (default 4)")
    parser.add_argument("--step", choices=STEPS, default="auto",
                        help="smollm2's decode step: compiled (the static step, torch.compile), eager (the model's "
                             "forward), or auto (default): compiled for int4 on a CPU, where it is the fast one")
    return parser, parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> tuple[str, SamplingParams]:
    """The prompt and the sampling parameters; ValueError for a bad or contradictory argument."""
    if args.text is not None and args.prompt is not None:
        raise ValueError("give the prompt once: as an argument or with --prompt, not both")
    prompt = args.text if args.text is not None else args.prompt
    if prompt is not None and not prompt.strip():
        raise ValueError(f"the prompt {prompt!r} is empty; give some text")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    check_model_args(args)
    if args.model == "tiny":
        if args.speculative is not None:
            raise ValueError("--speculative needs the trained model: use --model smollm2")
        if args.chat:
            raise ValueError("--chat needs a chat template: use --model smollm2 (the tiny model has none)")
        if not sampling.greedy:
            raise ValueError(f"--temperature {args.temperature}: the tiny demo decodes greedily, to compare the "
                             "naive and cached paths token for token; sample with --model smollm2")
        return (EXAMPLE_PROMPT if prompt is None else prompt), sampling
    if args.preset is not None:
        raise ValueError(f"--preset {args.preset} picks the shape of --model tiny; smollm2's shape is fixed")
    if args.speculative is not None and args.compare:
        raise ValueError("give --compare or --speculative, not both (--speculative compares with plain decode)")
    if args.speculative == "int4" and args.precision == "int4":
        raise ValueError("--speculative int4 drafts with the int4 weights for a float32, bfloat16 or int8 model; "
                         "the model is int4 already (drop --precision int4, or use --speculative ngram)")
    if args.compare and not sampling.greedy:
        raise ValueError(f"--compare checks token-for-token equality, which needs greedy decoding; got "
                         f"--temperature {args.temperature}")
    if prompt is None:
        prompt = DEFAULT_PROMPTS["chat" if args.chat else "text"]
    return prompt, sampling


class Run(NamedTuple):
    """Tokens and timings of one generation."""

    tokens: list[int]
    ttft: float  # s
    tpot: float | None  # s; None with one token
    rate: float  # tokens / s over the whole run
    total: float  # s


def collect(events, label: str, total: int, on_event=None) -> list[TokenEvent]:
    """Gather a run's events, calling ``on_event`` on each; without one, once the run has taken 2 s,
    show a token counter on stderr."""
    start, out, shown = time.perf_counter(), [], False
    tty = sys.stderr.isatty()  # a terminal gets one updating line, a log a line every 64 tokens
    every, begin, end = (16, "\r", "") if tty else (64, "", "\n")
    for event in events:
        out.append(event)
        n = len(out)
        if on_event is not None:
            on_event(event)
        elif time.perf_counter() - start > 2 and (n % every == 0 or n == total):
            print(f"{begin}  {label}: {n}/{total} tokens", end=end, file=sys.stderr, flush=True)
            shown = True
    if shown and tty:
        print(file=sys.stderr)
    return out


def timed_run(model, prompt_ids: list[int], max_new_tokens: int, use_cache: bool, label: str,
              on_event=None, decoder=None, **generate_kwargs) -> Run:
    """One run of ``stream_generate`` (or of ``decoder.stream``, the static step), timed from the request to
    each token (minillm.analysis.metrics)."""
    start = now(model.device)
    if decoder is not None:
        events = decoder.stream(prompt_ids, max_new_tokens, **generate_kwargs)
    else:
        events = stream_generate(model, prompt_ids, max_new_tokens, use_cache=use_cache, **generate_kwargs)
    return timed_events(start, events, label, max_new_tokens, on_event)


def timed_events(start: float, events, label: str, max_new_tokens: int, on_event=None) -> Run:
    """Collect a run's TokenEvents and time them from ``start``, the request's arrival."""
    events = collect(events, label, max_new_tokens, on_event)
    timing = RequestTiming(arrival_time=start, token_times=[e.time for e in events])
    total = e2e_latency(timing)
    return Run([e.token_id for e in events], ttft(timing), tpot(timing), len(events) / total, total)


def warm_up(model, prompt_ids: list[int], max_new_tokens: int, use_cache: bool, decoder=None) -> None:
    """A few untimed tokens first, so one-time costs (allocations, kernel selection, compiling ``decoder``'s
    step) stay out of the timings."""
    n = min(WARMUP_TOKENS, max_new_tokens)
    events = (decoder.stream(prompt_ids, n) if decoder is not None
              else stream_generate(model, prompt_ids, n, use_cache=use_cache))
    for _ in events:
        pass


def print_timings(runs: dict[str, Run]) -> None:
    print(f"{'path':<36}{'TTFT (ms)':>11}{'TPOT (ms)':>11}{'tokens/s':>11}{'total (s)':>11}")
    for name, run in runs.items():
        tpot_text = f"{run.tpot * 1e3:.2f}" if run.tpot is not None else "n/a"
        print(f"{PATHS[name]:<36}{run.ttft * 1e3:>11.2f}{tpot_text:>11}{run.rate:>11.1f}{run.total:>11.3f}")
    if "naive" in runs:
        print(f"speedup of the cache (tokens/s, cached / naive): {runs['cached'].rate / runs['naive'].rate:.2f}x")
    n = len(runs["cached"].tokens)
    print(f"TTFT = first token - start of the request; TPOT = mean gap over the {n - 1} decode tokens; "
          f"tokens/s = {n} / total")


def near_tie_gap(model, prompt_ids: list[int], common: list[int], a: int, b: int) -> float:
    """|logit(a) - logit(b)| where the two paths first chose differently (naive recompute)."""
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids + common], device=model.device)  # (1, T)
        logits = model(ids)[0, -1].float()  # (V,)
    return abs(float(logits[a] - logits[b]))


def report_agreement(model, prompt_ids: list[int], naive: list[int], cached: list[int], dtype_name: str) -> int:
    """Print whether the greedy paths gave the same tokens; 0 if they did (or split on a near tie), else 1."""
    if naive == cached:
        print(f"same tokens: yes, all {len(cached)} identical")
        return 0
    i = next(i for i, (a, b) in enumerate(zip(naive, cached)) if a != b)  # EOS ends both at a shared prefix
    gap = near_tie_gap(model, prompt_ids, naive[:i], naive[i], cached[i])
    tie, rounding = near_tie(model, dtype_name)
    verdict = (f"< {tie}: a near tie that {rounding} rounding flips, not a bug" if gap < tie
               else f">= {tie}: more than rounding explains, the paths disagree")
    print(f"same tokens: no, the first {i} agree; at token {i} the two candidates' logits differ by "
          f"{gap:.4f} {verdict}")
    return 0 if gap < tie else 1


def near_tie(model: torch.nn.Module, dtype_name: str) -> tuple[float, str]:
    """The logit gap under which rounding can flip a model's greedy token, and which rounding it is."""
    if any(isinstance(module, BlockLinear) for module in model.modules()):
        return INT8_ACTIVATIONS_TIE, "int8 activation"
    return NEAR_TIE[model.dtype], dtype_name


def threads_text(device: torch.device) -> str:
    return f", threads: {torch.get_num_threads()}" if device.type == "cpu" else ""


def run_tiny(parser, args, prompt: str) -> int:
    """The random-weight demo: naive and cached greedy generation, same tokens, timings side by side."""
    model, tokenizer, description = load_or_exit(parser.prog, args, args.seed, args.preset or "tiny")
    config, n_new = model.config, args.max_new_tokens
    prompt_ids = tokenizer.encode(prompt)
    print(f"minillm demo: {description}, so the text is gibberish;\n"
          "what it shows: naive and cached generation give the same tokens, and the cache's speedup.")
    print(f"model: {config.n_params / 1e6:.2f}M parameters, {config.n_layers} layers, {config.n_heads} query heads "
          f"sharing {config.n_kv_heads} KV heads, head_dim {config.head_dim}")
    print(f"device: {model.device.type}, {weights_text(args, model)}{threads_text(model.device)}")
    print(f"prompt: {prompt!r} = {len(prompt_ids)} tokens (BOS + {len(prompt_ids) - 1} UTF-8 bytes); "
          f"{n_new} new tokens, greedy; warm-up: {WARMUP_TOKENS} tokens a path, not timed")
    runs = {}
    for name in PATHS:
        warm_up(model, prompt_ids, n_new, name == "cached")
        runs[name] = timed_run(model, prompt_ids, n_new, name == "cached", name)
    print()
    print_timings(runs)
    status = report_agreement(model, prompt_ids, runs["naive"].tokens, runs["cached"].tokens, weights_name(args))
    print(f"text (cached path, random weights): {tokenizer.decode(runs['cached'].tokens)!r}")
    return status


def run_smollm2(parser, args, prompt: str, sampling: SamplingParams) -> int:
    """The trained model: the reply streamed as it is generated, then its timings."""
    start = time.perf_counter()
    model, tokenizer, _ = load_or_exit(parser.prog, args)
    loaded = time.perf_counter() - start
    device = model.device
    prompt_ids = tokenizer.encode_chat(prompt) if args.chat else tokenizer.encode(prompt)
    try:
        check_lengths(len(prompt_ids), args.max_new_tokens, model.config.max_seq_len)
    except ValueError as error:
        parser.error(str(error))  # exits with status 2
    c, n_new, eos = model.config, args.max_new_tokens, tokenizer.eos_token_id
    eos_name = tokenizer.decode([eos], skip_special_tokens=False)
    how = "greedy" if sampling.greedy else (f"sampled (temperature {sampling.temperature}, top-k {sampling.top_k}, "
                                            f"top-p {sampling.top_p}, seed {args.seed})")
    print(f"minillm demo: SmolLM2-135M-Instruct (trained), loaded in {loaded:.1f} s")
    print(f"model: {c.n_params / 1e6:.1f}M parameters, {c.n_layers} layers, {c.n_heads} query heads sharing "
          f"{c.n_kv_heads} KV heads, head_dim {c.head_dim}")
    print(f"device: {device.type}, {weights_text(args, model)}{threads_text(device)}")
    if args.speculative is None:
        decoder, step_text = command_line_decoder(model, len(prompt_ids), n_new, args.step)
        print(f"decode step: {step_text}")
    print(f"prompt: {prompt!r}{' in the chat template' if args.chat else ''} = {len(prompt_ids)} tokens")
    print(f"up to {n_new} new tokens, {how}, stops at {eos_name}", flush=True)
    generate_kwargs = dict(sampling=sampling, eos_token_id=eos, seed=args.seed)
    stream = TextStream(tokenizer)

    def show(event: TokenEvent) -> None:
        print(stream.push(event.token_id), end="", flush=True)

    if args.speculative is not None:
        print("--- output (streamed as generated) ---", flush=True)
        return run_speculative(model, args, prompt_ids, stream, show, generate_kwargs, eos_name)
    paths = ["cached", "naive"] if args.compare else ["cached"]
    for name in paths:
        warm_up(model, prompt_ids, n_new, name == "cached", decoder if name == "cached" else None)
    print("--- output (streamed as generated) ---", flush=True)
    runs = {"cached": timed_run(model, prompt_ids, n_new, True, "cached", show, decoder, **generate_kwargs)}
    print(stream.flush())
    cached = runs["cached"].tokens
    stop = f"stopped at {eos_name}" if cached[-1] == eos else f"stopped at --max-new-tokens {n_new}"
    print(f"--- end: {len(cached)} tokens, {stop} ---\n")
    if args.compare:
        runs = {"naive": timed_run(model, prompt_ids, n_new, False, "naive", **generate_kwargs), **runs}
    print_timings(runs)
    if not args.compare:
        return 0
    return report_agreement(model, prompt_ids, runs["naive"].tokens, cached, weights_name(args))


def run_speculative(model, args, prompt_ids: list[int], stream: TextStream, show, generate_kwargs: dict,
                    eos_name: str) -> int:
    """--speculative: the reply streamed from speculative decoding, then plain decode of the same prompt for
    its timings; the acceptance figures and the speed-up; 1 if greedy tokens differ beyond a near tie."""
    start = time.perf_counter()
    draft = PromptLookup() if args.speculative == "ngram" else load_int4(PRETRAINED, model.device)[0]
    n_new, stats, sampled = args.max_new_tokens, SpeculativeStats(), not generate_kwargs["sampling"].greedy

    def speculative(tokens: int, on_event=None, stats: SpeculativeStats | None = None) -> Run:
        begin = now(model.device)
        events = speculative_generate(model, draft, prompt_ids, args.k, tokens, stats=stats, **generate_kwargs)
        return timed_events(begin, events, "speculative", tokens, on_event)

    warm_up(model, prompt_ids, n_new, True)
    speculative(min(WARMUP_TOKENS, n_new))
    print(f"(draft: {DRAFTS[args.speculative]}, ready in {time.perf_counter() - start:.1f} s; k = {args.k})")
    spec = speculative(n_new, show, stats)
    print(stream.flush())
    stop = f"stopped at {eos_name}" if spec.tokens[-1] == generate_kwargs["eos_token_id"] else \
        f"stopped at --max-new-tokens {n_new}"
    print(f"--- end: {len(spec.tokens)} tokens, {stop} ---\n")
    plain = timed_run(model, prompt_ids, n_new, True, "cached", **generate_kwargs)
    print_timings({"cached": plain, "speculative": spec})
    if spec.tpot is None or plain.tpot is None:
        speed = "no decode step to compare (one token)"
    else:
        speed = f"{plain.tpot / spec.tpot:.2f}x plain decode (TPOT {plain.tpot * 1e3:.1f} -> {spec.tpot * 1e3:.1f} ms)"
    print(f"speculative, {DRAFTS[args.speculative]} drafting k = {args.k}: acceptance rate {stats.acceptance_rate:.3f} "
          f"({stats.accepted} of the {stats.judged} guesses the model judged), {stats.tokens_per_call:.2f} tokens "
          f"per target call ({len(stats.rounds)} calls); speed-up {speed}")
    if sampled:
        print("sampled: speculative decoding keeps the model's distribution, not plain decode's draws")
        return 0
    return report_agreement(model, prompt_ids, plain.tokens, spec.tokens, weights_name(args))


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    try:
        prompt, sampling = check_args(args)
        if args.model == "tiny":  # smollm2's context is known once it is loaded
            check_lengths(len(ByteTokenizer().encode(prompt)), args.max_new_tokens,
                          PRESETS[args.preset or "tiny"].max_seq_len)
    except (ValueError, TypeError) as error:
        parser.error(str(error))  # exits with status 2
    if args.model == "tiny":
        return run_tiny(parser, args, prompt)
    return run_smollm2(parser, args, prompt, sampling)


if __name__ == "__main__":
    sys.exit(main())
