"""The static decode step: equal to CausalLM.forward, compiled equal to eager, and the backend switch."""
import os
import subprocess
import sys

import pytest
import torch
from conftest import SMALL, random_ids

from minillm import KVCache, SamplingParams, build_model, generate, stream_generate
from minillm.book.instruments import count_ops
from minillm.fast.compiled import StaticDecoder, choose_backend, cpu_options, decode_step, find_compiler

CPU = torch.device("cpu")
# Compiling imports parts of torch that still use torch.jit.script_method (torch's warning, not ours).
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")]


def test_static_step_equals_the_model_for_rows_at_different_positions(small_model):
    """Two rows, prompts of 7 and 3 tokens: each step must give CausalLM.forward's logits."""
    full = random_ids(SMALL.vocab_size, (2, 12), seed=4)
    reference = KVCache(SMALL, 2, 16)
    static = KVCache(SMALL, 2, 16)  # the static step reads all 16 positions every call
    small_model(full[:, :7], cache=reference)
    small_model(full[:, :7], cache=static)
    position = torch.tensor([7, 3])  # row 1's positions 3..6 hold padding; the step overwrites them
    for _ in range(4):
        token = full[torch.arange(2), position][:, None]  # (2, 1)
        expected = small_model(token, positions=position[:, None], cache=reference)[:, 0]  # (2, V)
        logits = decode_step(small_model, static.k, static.v, token, position)
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
        position = position + 1
    for layer in range(SMALL.n_layers):  # the same keys were written where the model wrote them
        torch.testing.assert_close(static.k[layer][0, :, :11], reference.k[layer][0, :, :11])
        torch.testing.assert_close(static.k[layer][1, :, :7], reference.k[layer][1, :, :7])


def test_eager_static_decoder_gives_generate_tokens(tiny_model):
    prompt = random_ids(258, (16,)).tolist()
    decoder = StaticDecoder(tiny_model, 80, backend="eager")
    assert decoder.backend == "eager"
    assert decoder.generate(prompt, 48) == generate(tiny_model, prompt, 48)
    assert decoder.cache.lengths.tolist() == [16 + 47]  # the last token is never fed back


def events(stream) -> list[tuple[int, int, str]]:
    return [(e.token_id, e.index, e.phase) for e in stream]


@pytest.mark.parametrize("sampling, seed", [(None, None), (SamplingParams(temperature=0.8, top_k=20), 3)])
def test_stream_gives_stream_generate_s_events(tiny_model, sampling, seed):
    """The command line streams from the static step: the same tokens, indices and phases as
    stream_generate, sampled ones included (the same seed draws the same tokens)."""
    prompt = random_ids(258, (12,)).tolist()
    decoder = StaticDecoder(tiny_model, 64, backend="eager")
    ours = events(decoder.stream(prompt, 24, sampling, seed=seed))
    assert ours == events(stream_generate(tiny_model, prompt, 24, sampling=sampling, seed=seed))
    assert len({token for token, _, _ in ours}) > 3


def test_the_cpu_compile_checks_neither_weights_nor_sizes_each_call():
    """Guards on the model's modules re-checked SmolLM2's 450 weights before every step (1 ms of a 7 ms
    int4 step); the wrapper's size asserts were another call per buffer."""
    options = cpu_options()
    assert options["size_asserts"] is False and options["cpp.simdlen"] >= 0
    if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):
        assert options["guard_filter_fn"] is torch.compiler.skip_guard_on_all_nn_modules_unsafe


@pytest.fixture(scope="module")
def compiled():
    """One compiled decoder (compiling takes tens of seconds: once for the whole module)."""
    model = build_model(SMALL)
    return model, StaticDecoder(model, 48)


def test_the_backend_follows_the_c_compiler(compiled):
    _, decoder = compiled
    assert decoder.backend == ("compile" if find_compiler(CPU) else "eager")
    assert ("C++ compiler" in decoder.reason) == (decoder.backend == "compile")


def test_compiled_equals_eager(compiled):
    model, decoder = compiled
    eager = StaticDecoder(model, 48, backend="eager")
    for seed, prompt_len in [(0, 5), (1, 11)]:  # another prompt length, same compiled step
        prompt = random_ids(SMALL.vocab_size, (prompt_len,), seed).tolist()
        tokens = decoder.generate(prompt, 30)
        assert tokens == eager.generate(prompt, 30) == generate(model, prompt, 30)
        assert len(set(tokens)) > 3
    assert events(decoder.stream(prompt, 30)) == events(stream_generate(model, prompt, 30))


AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}  # a laptop without AVX-512
COMPILED_VS_GENERATE = """
import torch
from minillm import build_model, generate, get_config
from minillm.fast.compiled import StaticDecoder
torch.set_num_threads(1)
model, prompt = build_model(get_config("tiny", n_layers=1)), list(range(16))
decoder = StaticDecoder(model, 20)
print(decoder.backend, decoder.generate(prompt, 4) == generate(model, prompt, 4))
"""


def run_compiled_vs_generate(cache_dir, isa: dict[str, str]) -> str:
    """'backend agrees' from a fresh process with the CPU capability ``isa`` (none: native)."""
    env = {k: v for k, v in os.environ.items() if k not in AVX2}
    env.update(isa, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    done = subprocess.run([sys.executable, "-c", COMPILED_VS_GENERATE], env=env,
                          capture_output=True, text=True, timeout=300)
    return done.stdout.strip() or done.stderr[-500:]  # a crash reports its error


def test_compiled_step_gives_generate_tokens_under_avx2_after_a_native_run(tmp_path):
    """The AVX2 run reads the inductor cache the native (on this CPU AVX-512) run filled. Its key
    left out the vector width: the AVX2 run rebuilt 16-lane loops with 8-lane vectors and
    decoded from NaN logits, token 0 instead of generate's second token."""
    backend = "compile" if find_compiler(CPU) else "eager"
    assert run_compiled_vs_generate(tmp_path, {}) == f"{backend} True"
    assert run_compiled_vs_generate(tmp_path, AVX2) == f"{backend} True"


def test_eos_stops_the_static_decoder(tiny_model):
    prompt = [5, 6, 7]
    free = generate(tiny_model, prompt, 10)
    decoder = StaticDecoder(tiny_model, 16, backend="eager")
    assert decoder.generate(prompt, 10, eos_token_id=free[3]) == generate(tiny_model, prompt, 10,
                                                                          eos_token_id=free[3])


def test_without_a_compiler_the_cpu_falls_back_to_eager_and_says_why(monkeypatch, capsys):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr("minillm.fast.compiled.shutil.which", lambda name: None)
    backend, reason = choose_backend(CPU)
    assert backend == "eager" and "no C++ compiler" in reason and "g++" in reason
    decoder = StaticDecoder(build_model(SMALL), 8, verbose=True)
    assert decoder.backend == "eager" and decoder.step is decode_step
    assert "decode step: eager: no C++ compiler" in capsys.readouterr().out
    with pytest.raises(ValueError, match="backend='compile' needs a C\\+\\+ compiler"):
        choose_backend(CPU, "compile")


@pytest.mark.parametrize("make, match", [
    (lambda m: choose_backend(CPU, "tensorrt"), "backend='tensorrt'.*auto.*compile.*eager"),
    (lambda m: StaticDecoder(m, 65), "max_len=65 exceeds the model's max_seq_len=64"),
    (lambda m: StaticDecoder(m, 0), "max_len=0"),
    (lambda m: StaticDecoder(m, 8, backend="eager").generate([1, 2, 3], 6),
     "3 \\+ max_new_tokens 6 = 9 exceeds the decoder's max_len=8"),
    (lambda m: StaticDecoder(m, 8, backend="eager").generate([], 2), "empty"),
])
def test_bad_arguments(small_model, make, match):
    with pytest.raises(ValueError, match=match):
        make(small_model)


def test_count_ops_counts_kernels_not_views():
    x = torch.ones(3, 4)
    assert count_ops(lambda: x + 1) == 1
    assert count_ops(lambda: x.t().unsqueeze(0)[0, :2]) == 0  # views move no data
    assert count_ops(lambda: (x @ x.t()).relu().sum()) == 3


def test_a_decode_step_runs_the_same_operations_in_every_layer():
    """The count grows by the same number per layer: what a GPU would launch, step after step."""
    counts = []
    for n_layers in (1, 2, 3):
        model = build_model(SMALL.with_(n_layers=n_layers))
        cache = KVCache(model.config, 1, 8)
        model(torch.tensor([[1, 2, 3]]), cache=cache)
        counts.append(count_ops(lambda model=model, cache=cache: model(torch.tensor([[4]]), cache=cache)))
    assert counts[1] - counts[0] == counts[2] - counts[1] > 20
