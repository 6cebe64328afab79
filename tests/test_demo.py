"""The command-line demo `python -m minillm`: its report, its exit status, its argument errors."""
import dataclasses
import os
import re
import subprocess
import sys

import pytest

import minillm.demo as demo


def run_demo(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_demo_reports_both_paths_and_that_they_agree():
    result = run_demo("--max-new-tokens", "12", "--threads", "1", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "RANDOM weights" in out and "gibberish" in out
    assert "device: cpu, dtype: float32, threads: 1" in out
    assert "prompt: '请介绍一下Transformer' = 27 tokens" in out
    number = r"\s+(\d+\.\d+)"
    for path in ("naive", "cached"):
        row = re.search(rf"^{path}\s.*?\){number}{number}{number}{number}$", out, re.MULTILINE)
        assert row, f"no timing row for {path}:\n{out}"
        ttft, tpot, rate, total = map(float, row.groups())
        assert min(ttft, tpot, rate, total) > 0
        # total is printed to 0.5 ms, so 12 / total carries that rounding error
        assert 12 / (total + 0.0005) - 0.05 <= rate <= 12 / (total - 0.0005) + 0.05
    assert re.search(r"speedup of the cache \(tokens/s, cached / naive\): \d+\.\d\dx", out)
    assert "same tokens: yes, all 12 identical" in out
    assert result.stderr == ""  # a short run shows no progress counter


@pytest.mark.parametrize("args, message", [
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--max-new-tokens", "0"], "max_new_tokens=0 must be >= 1"),
    (["--max-new-tokens", "5000"], "exceeds max_seq_len=2048"),
    (["--threads", "0"], "--threads 0 must be >= 1"),
    (["--preset", "llama-7b"], "argument --preset: invalid choice: 'llama-7b'"),
])
def test_bad_arguments_exit_with_a_clear_message(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        demo.main(args)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


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
    assert demo.main(["--max-new-tokens", "6", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "same tokens: no, the first 2 agree" in out and "the paths disagree" in out
