"""minillm.checkpoints.hf: Hugging Face LLaMA checkpoints load into minillm and compute the same thing.

The reference is ``transformers.LlamaForCausalLM`` built from tiny random configs (offline): same
logits in float32 within 1e-5 (absolute, plus 1e-5 relative: logits reach ~25 here, where float32
rounding alone differs by ~1e-6), and the same greedy tokens as ``generate`` with and without minillm's cache.
"""
import json
import math
import pickle

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import CausalLM, build_model, generate, get_config
from minillm.checkpoints.hf import config_from_hf, config_to_hf, load_checkpoint, load_state_dict_into, to_transformers

BASE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
            pad_token_id=0, attn_implementation="eager")
CONFIGS = {
    "gqa": dict(num_key_value_heads=2),
    "mqa-tied": dict(num_key_value_heads=1, tie_word_embeddings=True),
    "mha": dict(num_key_value_heads=4),
    "head_dim-12": dict(num_key_value_heads=2, head_dim=12),
    "rope-theta-100": dict(num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
}
CLOSE = dict(atol=1e-5, rtol=1e-5)
PROMPT = [3, 17, 42, 8, 55]
NEW_TOKENS = 24


def hf_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A random LlamaForCausalLM whose greedy tokens vary (not one token repeated).

    Embeddings ~ N(0, 1), linear weights ~ N(0, 4/fan_in), norm weights ~ U(0.5, 1.5) (not 1, so a norm
    weight that is not copied shows up in the logits). The gain of 2 on the linear layers lets each block
    change the residual stream enough that a tied model does not just repeat its last token.
    """
    model = LlamaForCausalLM(LlamaConfig(**{**BASE, **overrides}))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=gen)
            else:
                p.normal_(0.0, 1.0 if "embed_tokens" in name else 2 * p.shape[1] ** -0.5, generator=gen)
    return model.eval()


def minillm_from(hf: LlamaForCausalLM) -> CausalLM:
    """minillm with the config and weights of ``hf``, through minillm.checkpoints.hf."""
    model = CausalLM(config_from_hf(hf.config.to_dict()))
    return load_state_dict_into(model, hf.state_dict()).eval()


def hf_greedy(hf: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy generate (with its KV cache): the n new tokens."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_and_greedy_tokens_match_transformers(name):
    hf = hf_model(**CONFIGS[name])
    ours = minillm_from(hf)
    ids = torch.randint(0, BASE["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits  # (2, 20, vocab)
        got = ours(ids)
    assert got.shape == expected.shape == (2, 20, BASE["vocab_size"])
    torch.testing.assert_close(got, expected, **CLOSE)

    reference = hf_greedy(hf, PROMPT, NEW_TOKENS)
    assert len(reference) == NEW_TOKENS and len(set(reference)) > 5  # greedy output is not one token repeated
    assert generate(ours, PROMPT, NEW_TOKENS, use_cache=True) == reference
    assert generate(ours, PROMPT, NEW_TOKENS, use_cache=False) == reference


def test_config_mapping():
    cfg = config_from_hf(hf_model(**CONFIGS["head_dim-12"], rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 5e5}).config.to_dict())
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff,
            cfg.max_seq_len, cfg.rope_theta, cfg.norm_eps, cfg.tie_embeddings) == \
        (96, 32, 2, 4, 2, 12, 64, 128, 5e5, 1e-6, False)


def test_old_style_config_json_of_llama_7b():
    """transformers 4 wrote rope_theta at the top level (or not at all) and no num_key_value_heads."""
    llama_7b = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                "hidden_size": 4096, "intermediate_size": 11008, "max_position_embeddings": 2048,
                "num_attention_heads": 32, "num_hidden_layers": 32, "rms_norm_eps": 1e-06,
                "tie_word_embeddings": False, "vocab_size": 32000, "rope_scaling": None}
    assert config_from_hf(llama_7b) == get_config("llama-7b")
    assert config_from_hf({**llama_7b, "rope_theta": 5e5}).rope_theta == 5e5


@pytest.mark.parametrize("preset", ["tiny", "llama2-70b"])
def test_config_to_hf_round_trip(preset):
    config = get_config(preset, tie_embeddings=True, rope_theta=1e6)
    assert config_from_hf(LlamaConfig(**config_to_hf(config)).to_dict()) == config


def test_to_transformers_computes_the_same_logits():
    model = build_model(get_config("tiny", n_layers=2, max_seq_len=64), seed=3)
    hf = to_transformers(model, attn_implementation="eager")
    ids = torch.randint(0, 258, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, **CLOSE)


def test_missing_config_field_is_named():
    hf_config = hf_model(**CONFIGS["gqa"]).config.to_dict()
    del hf_config["intermediate_size"]
    with pytest.raises(ValueError, match=r"config has no \['intermediate_size'\]"):
        config_from_hf(hf_config)


@pytest.mark.parametrize("field, value, match", [
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}, "rope_type='llama3'"),
    ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling.rope_type='linear'"),
    ("attention_bias", True, "attention_bias=True"),
    ("mlp_bias", True, "mlp_bias=True"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("model_type", "gpt2", "model_type='gpt2'"),
])
def test_unsupported_fields_are_refused(field, value, match):
    hf_config = {**hf_model(**CONFIGS["gqa"]).config.to_dict(), field: value}
    with pytest.raises(ValueError, match=match):
        config_from_hf(hf_config)


@pytest.mark.parametrize("name, shard", [("gqa", None), ("mqa-tied", None), ("gqa", "20KB")])
def test_save_pretrained_round_trip(tmp_path, name, shard):
    hf = hf_model(**CONFIGS[name])
    hf.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    files = sorted(p.name for p in tmp_path.iterdir())
    if shard:
        assert "model.safetensors.index.json" in files and len([f for f in files if f.endswith(".safetensors")]) > 1
    else:
        assert "model.safetensors" in files
    ours = load_checkpoint(tmp_path)
    assert ours.config.tie_embeddings == (name == "mqa-tied")
    assert not ours.training and not any(p.requires_grad for p in ours.parameters())
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, **CLOSE)


def test_pytorch_model_bin_is_read_with_weights_only(tmp_path):
    hf = hf_model(**CONFIGS["mha"])
    hf.config.to_json_file(tmp_path / "config.json")
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    ours = load_checkpoint(tmp_path, dtype="bfloat16")
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours.model.embed_tokens.weight, hf.model.embed_tokens.weight.bfloat16())

    # A pickle that would run code when loaded is refused, not executed.
    torch.save({"model.embed_tokens.weight": math.pi, "payload": print}, tmp_path / "pytorch_model.bin")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_checkpoint(tmp_path)


def test_missing_directory_contents_are_named(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_model(**CONFIGS["gqa"]).config.to_dict()))
    with pytest.raises(ValueError, match="model.safetensors"):
        load_checkpoint(tmp_path)


def test_state_dict_keys_are_checked():
    hf = hf_model(**CONFIGS["gqa"])
    target = CausalLM(config_from_hf(hf.config.to_dict()))
    state = hf.state_dict()

    extra = {**state, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}  # old checkpoints
    load_state_dict_into(target, extra)
    assert torch.equal(target.lm_head.weight, hf.lm_head.weight)

    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"1 missing keys \['model.norm.weight'\]"):
        load_state_dict_into(target, missing)
    unexpected = {**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}
    with pytest.raises(ValueError, match=r"1 unexpected keys \['model.layers.0.self_attn.q_proj.bias'\]"):
        load_state_dict_into(target, unexpected)
    wrong = {**state, "model.norm.weight": torch.ones(33)}
    with pytest.raises(ValueError, match=r"model.norm.weight: checkpoint shape \(33,\) != model shape \(32,\)"):
        load_state_dict_into(target, wrong)


def test_tied_checkpoint_with_or_without_lm_head():
    hf = hf_model(**CONFIGS["mqa-tied"])
    target = CausalLM(config_from_hf(hf.config.to_dict()))
    state = hf.state_dict()
    assert "lm_head.weight" in state  # transformers lists the tied tensor under both names
    load_state_dict_into(target, state)
    load_state_dict_into(target, {k: v for k, v in state.items() if k != "lm_head.weight"})
    assert target.lm_head.weight is target.model.embed_tokens.weight
    assert torch.equal(target.lm_head.weight, hf.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        load_state_dict_into(target, {**state, "lm_head.weight": state["lm_head.weight"] + 1})
