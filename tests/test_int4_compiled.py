"""The static decode step on the int4 model (the file's own 4-bit weights through the block kernel): eagerly it
gives the tokens of the int4 model's own ``generate`` (the tiny model's exactly, SmolLM2's up to a near tie);
compiled (where a C++ compiler exists) its logits agree within the activations' int8 rounding and its tokens
agree up to a near tie."""
import pytest
import torch
from conftest import STORY_PROMPT, TINY_GGUF, write_tiny_gguf

from minillm import KVCache, generate
from minillm.checkpoints.gguf import read_gguf
from minillm.demo import INT8_ACTIVATIONS_TIE as NEAR_TIE  # a top-2 gap under this can flip with the rounding
from minillm.fast.compiled import StaticDecoder, decode_step, find_compiler
from minillm.fast.int4 import RAW_TYPES, int4_model, kernels_used, load_int4

CPU = torch.device("cpu")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")]


@pytest.fixture(scope="module")
def tiny_int4(tmp_path_factory):
    """A 2-layer GGUF of Q4_1 weights (an untied Q4_1 head: the tied random one repeats a single token), loaded
    as it is: every matmul through the kernel."""
    path = tmp_path_factory.mktemp("int4") / "tiny.gguf"
    write_tiny_gguf(path, {}, tie=False)  # every matmul Q4_1, the default
    model = int4_model(read_gguf(path, RAW_TYPES))
    assert list(kernels_used(model)) == ["blockdot (Q4_1 blocks, int8 activations)"]
    return model


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def assert_same_up_to_a_near_tie(model, prompt: list[int], reference: list[int], tokens: list[int],
                                 minimum: int) -> None:
    """``tokens`` equal ``reference`` until a step where the eager model's two candidates are a near tie."""
    first = first_difference(reference, tokens)
    if first < len(reference):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + reference[:first]]))[0, -1].float()
        gap = abs(float(logits[reference[first]] - logits[tokens[first]]))
        assert gap < NEAR_TIE, (first, gap)
    assert first >= minimum, first


def test_the_eager_static_step_gives_the_tiny_int4_model_s_generate_tokens(tiny_int4):
    prompt = torch.randint(0, TINY_GGUF.vocab_size, (6,), generator=torch.Generator().manual_seed(2)).tolist()
    decoder = StaticDecoder(tiny_int4, 40, backend="eager")
    tokens = decoder.generate(prompt, 30)
    assert tokens == generate(tiny_int4, prompt, 30, eos_token_id=None)
    assert len(set(tokens)) > 3


def test_the_eager_static_step_gives_smollm2_int4_s_generate_tokens():
    """The static step attends over its whole fixed-length cache, masked; generate over the positions so far:
    the same sums in other shapes, in another order, and a last-bit difference can move an activation's int8
    step. The two agree up to a near tie (under demo.INT8_ACTIVATIONS_TIE): on an AMD EPYC they split at
    token 5, where the float32 model too is nearly undecided (its top two 0.10 apart at one thread)."""
    model, tokenizer = load_int4("smollm2-135m-instruct")
    prompt = tokenizer.encode(STORY_PROMPT)
    decoder = StaticDecoder(model, len(prompt) + 32, backend="eager")
    reference = generate(model, prompt, 32, eos_token_id=None)
    assert_same_up_to_a_near_tie(model, prompt, reference, decoder.generate(prompt, 32), minimum=4)


@pytest.mark.skipif(find_compiler(CPU) is None, reason="torch.compile needs a C++ compiler on the CPU")
def test_the_compiled_static_step_agrees_with_the_int4_model(tiny_int4):
    """Teacher-forced, each compiled step's logits are the eager step's within the rounding (the fused loops
    sum in another order, and the activations' int8 steps follow); free-running, the tokens agree up to a
    near tie."""
    model = tiny_int4
    prompt = torch.randint(0, TINY_GGUF.vocab_size, (6,), generator=torch.Generator().manual_seed(2)).tolist()
    compiled = StaticDecoder(model, 40)
    assert compiled.backend == "compile", compiled.reason
    reference = generate(model, prompt, 30, eos_token_id=None)
    assert_same_up_to_a_near_tie(model, prompt, reference, compiled.generate(prompt, 30), minimum=4)
    caches = [KVCache(model.config, 1, 40, CPU, model.dtype) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            model(torch.tensor([prompt]), cache=cache)
        position = torch.tensor([len(prompt)])
        for token in reference[:12]:
            ids = torch.tensor([[token]])
            eager = decode_step(model, caches[0].k, caches[0].v, ids, position).float()
            ours = compiled.step(model, caches[1].k, caches[1].v, ids, position).float()
            spread = float(eager.abs().max())
            assert float((ours - eager).abs().max()) < 0.05 * spread
            position = position + 1


def test_the_command_line_compiles_the_int4_step_where_it_can_and_says_so(tiny_int4):
    """``python -m minillm --precision int4`` decodes with the compiled static step on a CPU with a compiler
    (there it is the fast one), with the model's own forward otherwise, and the header line says which."""
    from minillm import build_model
    from minillm.fast.compiled import command_line_decoder

    assert tiny_int4.config.max_seq_len == 64
    decoder, text = command_line_decoder(tiny_int4, 10, 20)
    if find_compiler(CPU):
        assert decoder.backend == "compile" and decoder.cache.max_len == 64  # 30, rounded up to 256, capped
        assert text.startswith("the static step compiled for 64 positions, torch.compile")
    else:
        assert decoder is None and "cannot compile here" in text
    assert command_line_decoder(tiny_int4, 10, 20, "eager") == (None, "eager (CausalLM.forward, as asked)")
    float_model = build_model("tiny")  # no block kernel: compiling buys little, auto keeps the eager step
    decoder, text = command_line_decoder(float_model, 10, 20)
    assert decoder is None and "--step compiled compiles the static step" in text
    with pytest.raises(ValueError, match="step='jit'; choose one of"):
        command_line_decoder(tiny_int4, 10, 20, "jit")


def test_the_demo_prints_the_step_it_decodes_with(capsys):
    from minillm import demo

    assert demo.main(["--precision", "int4", "--max-new-tokens", "4", "--device", "cpu", "--step", "eager"]) == 0
    out = capsys.readouterr().out
    assert "decode step: eager (CausalLM.forward, as asked)" in out
    assert out.index("decode step:") < out.index("--- output")
