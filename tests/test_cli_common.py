"""The flags `python -m minillm` and `python -m minillm serve` share: one definition, ranges checked as they are
parsed (the error names the flag, the value and the limit), and the model they name loaded the same way."""
import argparse

import pytest
import torch

from minillm.cli_common import (
    BAD_ARGUMENT,
    add_model_args,
    check_model_args,
    int_range,
    load_or_exit,
    seconds,
    weights_text,
)
from minillm.demo import parse_args as demo_args
from minillm.serving.cli import parse_args as serve_args


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prog")
    add_model_args(p)
    p.add_argument("--port", type=int_range(0, 65535))
    p.add_argument("--timeout", type=seconds())
    p.add_argument("--grace", type=seconds(zero_ok=True))
    return p


@pytest.mark.parametrize("argv, words", [
    (["--threads", "0"], "argument --threads: 0 must be >= 1"),
    (["--threads", "1.5"], "argument --threads: '1.5' is not an integer"),
    (["--port", "70000"], "argument --port: 70000 must be >= 0 and <= 65535"),
    (["--timeout", "0"], "argument --timeout: 0.0 must be a finite number > 0"),
    (["--timeout", "inf"], "argument --timeout: inf must be a finite number > 0"),
    (["--grace", "-1"], "argument --grace: -1.0 must be a finite number >= 0"),
    (["--grace", "soon"], "argument --grace: 'soon' is not a number"),
])
def test_a_value_out_of_range_is_refused_as_it_is_parsed(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        parser().parse_args(argv)
    assert info.value.code == BAD_ARGUMENT and words in capsys.readouterr().err


def test_in_range_values_parse_to_numbers():
    args = parser().parse_args(["--threads", "2", "--port", "0", "--timeout", "0.5", "--grace", "0"])
    assert (args.threads, args.port, args.timeout, args.grace) == (2, 0, 0.5, 0.0)


def test_the_demo_and_the_server_take_the_same_model_flags():
    argv = ["--model", "tiny", "--device", "cpu", "--precision", "int8", "--threads", "1"]
    demo, serve = demo_args(argv)[1], serve_args(argv)
    flags = ("model", "device", "dtype", "precision", "threads")
    assert [getattr(demo, f) for f in flags] == [getattr(serve, f) for f in flags] == ["tiny", "cpu", None, "int8", 1]


@pytest.mark.parametrize("argv, words", [
    (["--precision", "int8", "--dtype", "bfloat16"], "give --precision or --dtype, not both"),
    (["--model", "tiny", "--precision", "int4"], "the tiny model has no file"),
])
def test_contradicting_model_flags_are_refused(argv, words):
    with pytest.raises(ValueError, match=words):
        check_model_args(parser().parse_args(argv))


@pytest.mark.parametrize("argv, dtype, words", [
    ([], torch.float32, "dtype: float32"),
    (["--dtype", "bfloat16"], torch.bfloat16, "dtype: bfloat16"),
    (["--precision", "bfloat16"], torch.bfloat16, "precision: bfloat16 ("),
])
def test_the_tiny_model_is_loaded_as_the_flags_say(argv, dtype, words):
    args = parser().parse_args(["--model", "tiny", "--device", "cpu", *argv])
    model, tokenizer, description = load_or_exit("prog", args, seed=3)
    assert model.dtype == dtype and tokenizer.vocab_size == model.config.vocab_size
    assert description == "the 'tiny' preset with RANDOM weights (seed 3)"
    assert weights_text(args, model).startswith(words)


def test_a_device_that_is_not_there_exits_with_a_bad_argument(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        load_or_exit("prog", parser().parse_args(["--model", "tiny", "--device", "cuda"]))
    assert info.value.code == BAD_ARGUMENT and "prog: error: device='cuda'" in capsys.readouterr().err
