"""ModelConfig validation, presets and parameter counts."""
import pytest

from minillm import PRESETS, ModelConfig, build_model, get_config


@pytest.mark.parametrize("name, exact, billions, digits", [
    # Exact counts of the released checkpoints (Hugging Face LlamaForCausalLM, untied lm_head), and
    # the rounded figure the papers and model cards publish: 6.74B, 13.0B, 69.0B.
    ("llama-7b", 6_738_415_616, 6.74, 2),
    ("llama-13b", 13_015_864_320, 13.0, 1),
    ("llama2-70b", 68_976_648_192, 69.0, 1),
])
def test_shape_only_presets_match_published_parameter_counts(name, exact, billions, digits):
    n = get_config(name).n_params
    assert n == exact
    assert round(n / 1e9, digits) == billions


def test_llama_presets_shapes():
    c7, c13, c70 = (get_config(n) for n in ("llama-7b", "llama-13b", "llama2-70b"))
    assert (c7.n_layers, c7.n_heads, c7.n_kv_heads, c7.head_dim) == (32, 32, 32, 128)
    assert (c13.n_layers, c13.n_heads, c13.n_kv_heads, c13.head_dim) == (40, 40, 40, 128)
    assert (c70.n_layers, c70.n_heads, c70.n_kv_heads, c70.head_dim, c70.n_groups) == (80, 64, 8, 128, 8)


def test_tiny_preset_is_small_and_grouped():
    c = get_config("tiny")
    assert 1_000_000 <= c.n_params <= 10_000_000
    assert c.n_kv_heads < c.n_heads and c.n_groups == c.n_heads // c.n_kv_heads == 4
    assert c.vocab_size == 258  # byte-level tokenizer: 256 bytes + BOS + EOS


@pytest.mark.parametrize("config", [
    get_config("tiny"),
    ModelConfig(vocab_size=50, d_model=48, n_layers=2, n_heads=6, n_kv_heads=1, head_dim=10, d_ff=64,
                tie_embeddings=True),
])
def test_param_counts_equal_the_allocated_model(config):
    model = build_model(config)
    allocated = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    assert config.n_params == allocated
    assert config.param_counts()["lm_head"] == (0 if config.tie_embeddings else config.vocab_size * config.d_model)


@pytest.mark.parametrize("changes, kind, words", [
    (dict(n_heads=8, n_kv_heads=3), ValueError, ["n_heads=8", "n_kv_heads=3"]),
    (dict(n_heads=8, n_kv_heads=16), ValueError, ["n_heads=8", "n_kv_heads=16"]),
    (dict(d_model=100, n_heads=8), ValueError, ["d_model=100", "n_heads=8", "head_dim"]),
    (dict(head_dim=7), ValueError, ["head_dim=7", "even"]),
    (dict(d_model=0), ValueError, ["d_model=0", ">= 1"]),
    (dict(n_layers=-1), ValueError, ["n_layers=-1", ">= 1"]),
    (dict(n_heads=0), ValueError, ["n_heads=0", ">= 1"]),
    (dict(n_kv_heads=0), ValueError, ["n_kv_heads=0", ">= 1"]),
    (dict(vocab_size=0), ValueError, ["vocab_size=0", ">= 1"]),
    (dict(d_ff=0), ValueError, ["d_ff=0", ">= 1"]),
    (dict(max_seq_len=0), ValueError, ["max_seq_len=0", ">= 1"]),
    (dict(head_dim=0), ValueError, ["head_dim=0", ">= 1"]),
    (dict(rope_theta=0.0), ValueError, ["rope_theta=0.0", "> 0"]),
    (dict(norm_eps=-1e-5), ValueError, ["norm_eps=-1e-05", "> 0"]),
    (dict(d_model=256.0), TypeError, ["d_model=256.0", "integer"]),
    (dict(n_layers="4"), TypeError, ["n_layers='4'", "integer"]),
    (dict(tie_embeddings="yes"), TypeError, ["tie_embeddings='yes'"]),
])
def test_bad_config_names_the_value_and_the_limit(changes, kind, words):
    with pytest.raises(kind) as info:
        ModelConfig(**changes)
    for word in words:
        assert word in str(info.value)


def test_head_dim_may_differ_from_d_model_over_n_heads():
    c = ModelConfig(d_model=48, n_heads=6, n_kv_heads=2, head_dim=10)
    assert c.head_dim == 10 and c.d_model // c.n_heads == 8


def test_with_rederives_a_default_head_dim_and_keeps_an_explicit_one():
    tiny = get_config("tiny")
    assert tiny.head_dim == 32
    assert tiny.with_(d_model=512).head_dim == 64
    assert get_config("tiny", d_model=512).head_dim == 64
    assert tiny.with_(d_model=512, head_dim=16).head_dim == 16
    odd = ModelConfig(d_model=48, n_heads=6, n_kv_heads=2, head_dim=10)
    assert odd.with_(n_layers=1).head_dim == 10
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        tiny.with_(n_kv_heads=3)  # a changed copy is validated too


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"'llama-8b'.*llama-7b"):
        get_config("llama-8b")
    assert set(PRESETS) >= {"tiny", "llama-7b", "llama-13b", "llama2-70b"}
