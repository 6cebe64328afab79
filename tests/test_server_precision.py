"""``python -m minillm serve --precision``: the flag is parsed, reaches the model the server loads (the tiny
model as a float32, bfloat16 or int8 variant; SmolLM2 from its GGUF file's own 4-bit weights), the engine
serves that model, and bad values are refused before anything loads."""
import pytest
import torch
import torch.nn as nn

from minillm import generate
from minillm.cli_common import load_from_args, weights_name, weights_text
from minillm.engine import Engine, EngineConfig, Request
from minillm.fast.int4 import kernels_used
from minillm.fast.quant import Int8Linear, MatVecLinear
from minillm.serving.cli import parse_args

pytestmark = pytest.mark.slow  # serves SmolLM2


def served_tokens(model, prompt: list[int], n: int) -> list[int]:
    return Engine(model, EngineConfig(max_batch_size=2)).run([Request(0, prompt, n)]).requests[0].output_ids


def load(args):
    return load_from_args(args, seed=args.seed)


@pytest.mark.parametrize("precision, dtype, layer", [
    ("float32", torch.float32, nn.Linear), ("bfloat16", torch.bfloat16, MatVecLinear),
    ("int8", torch.bfloat16, Int8Linear)])
def test_the_tiny_model_is_loaded_in_the_precision_asked_and_served(precision, dtype, layer):
    args = parse_args(["--model", "tiny", "--device", "cpu", "--precision", precision])
    model, _, _ = load(args)
    assert model.dtype == dtype
    assert type(model.lm_head) is layer and type(model.model.layers[0].mlp.down_proj) is layer
    assert weights_text(args, model).startswith(f"precision: {precision} (")
    prompt = [256, 72, 105]
    assert served_tokens(model, prompt, 6) == generate(model, prompt, 6)


def test_without_precision_the_dtype_decides():
    args = parse_args(["--model", "tiny", "--device", "cpu"])
    assert (args.precision, args.dtype, weights_name(args)) == (None, None, "float32")
    model, _, _ = load(parse_args(["--model", "tiny", "--device", "cpu", "--dtype", "bfloat16"]))
    assert model.dtype == torch.bfloat16 and type(model.lm_head) is nn.Linear


def test_int4_serves_smollm2_from_the_files_own_4bit_weights():
    model, tokenizer, _ = load(parse_args(["--device", "cpu", "--precision", "int4"]))
    assert model.dtype == torch.float32  # around the block kernel, which rounds the activations to int8 itself
    assert kernels_used(model) == {"blockdot (Q4_1 blocks, int8 activations)": 210,
                                   "blockdot (Q8_0 blocks, int8 activations)": 1}
    prompt = tokenizer.encode("The capital of France is")
    assert served_tokens(model, prompt, 3) == generate(model, prompt, 3)


@pytest.mark.parametrize("argv, words", [
    (["--precision", "fp8"], "invalid choice: 'fp8'"),
    (["--precision", "int4", "--model", "tiny"], "the tiny model has no file"),
    (["--precision", "int8", "--dtype", "bfloat16"], "not both"),
])
def test_bad_precisions_are_refused_by_the_argument_parser(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2 and words in capsys.readouterr().err
