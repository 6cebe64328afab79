"""Library and loader errors name the argument, the config.json field or the file;
values that make no sense are refused; a sharded index cannot reach files outside its checkpoint folder."""
import json
import os

import pytest
import torch
from conftest import write_tiny_gguf
from safetensors.torch import save_file

from minillm import CausalLM, generate
from minillm.checkpoints.gguf import read_gguf
from minillm.checkpoints.hf import config_from_hf, config_to_hf, load_checkpoint
from minillm.config import ModelConfig

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return CausalLM(CONFIG).eval()


# ---- the library: generate's arguments -----------------------------------------------------------
@pytest.mark.parametrize("prompt, error, words", [
    ([2**70], ValueError, "token id 1180591620717411303424 is outside the vocabulary [0, 64)"),
    (None, TypeError, "prompt_ids is None"),
    ([1, "a"], TypeError, "prompt_ids[1]='a' is not a token id"),
    ([1, None], TypeError, "prompt_ids[1]=None is not a token id"),
])
def test_generate_names_the_bad_prompt_id(model, prompt, error, words):
    with pytest.raises(error) as info:
        generate(model, prompt, 2)
    assert words in str(info.value)


@pytest.mark.parametrize("eos", ["5", True, 1.0])
def test_generate_refuses_an_eos_that_is_not_an_int(model, eos):
    with pytest.raises(TypeError, match="eos_token_id=.* must be an integer"):
        generate(model, [1, 2], 2, eos_token_id=eos)


# ---- config.json fields --------------------------------------------------------------------------
def hf_config(**changes) -> dict:
    return {**config_to_hf(CONFIG), "model_type": "llama", **changes}


@pytest.mark.parametrize("changes, error, words", [
    (dict(rope_parameters=None, rope_theta=None), TypeError, "rope_theta=None must be a number"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "big"}), TypeError,
     "rope_parameters.rope_theta='big' must be a number"),
    (dict(rope_parameters=None, rope_scaling="linear"), TypeError, "rope_scaling='linear' must be an object"),
    (dict(rope_parameters="default"), TypeError, "rope_parameters='default' must be an object"),
    (dict(rms_norm_eps="x"), TypeError, "rms_norm_eps='x' must be a number"),
    (dict(rms_norm_eps=True), TypeError, "rms_norm_eps=True must be a number"),
    (dict(tie_word_embeddings="false"), TypeError, "tie_word_embeddings='false' must be true or false"),
    (dict(max_position_embeddings=2**40), ValueError, "max_position_embeddings=1099511627776 is more than"),
    (dict(hidden_size="256"), TypeError, "d_model is hidden_size"),
    (dict(num_key_value_heads=0), ValueError, "n_kv_heads is num_key_value_heads"),
])
def test_config_errors_name_the_config_json_field(changes, error, words):
    with pytest.raises(error) as info:
        config_from_hf(hf_config(**changes))
    assert words in str(info.value) and "config.json" in str(info.value)


def test_a_config_without_num_key_value_heads_is_still_multi_head():
    config = hf_config()
    del config["num_key_value_heads"]
    assert config_from_hf(config).n_kv_heads == CONFIG.n_heads


# ---- checkpoint folders: shards, corrupt files -------------------------------------------------------
def write_checkpoint(folder, model, shards: int = 1, config: dict | None = None) -> dict:
    """model's weights in ``folder`` as Hugging Face would save them; ``shards`` > 1: with an index."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or hf_config()))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if shards == 1:
        save_file(state, str(folder / "model.safetensors"))
        return {}
    names, weight_map = sorted(state), {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({k: state[k] for k in part}, str(folder / file))
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


def test_a_sharded_checkpoint_loads_even_through_links_as_in_the_hub_cache(tmp_path, model):
    """The Hub cache keeps a snapshot's files as links into ../../blobs: links may lead out, names may not."""
    snapshot, blobs = tmp_path / "snapshots" / "abc", tmp_path / "blobs"
    index = write_checkpoint(blobs, model, shards=2)
    snapshot.mkdir(parents=True)
    for file in blobs.iterdir():
        os.symlink(os.path.relpath(file, snapshot), snapshot / file.name)
    loaded = load_checkpoint(snapshot)
    assert len(set(index["weight_map"].values())) == 2
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)


@pytest.mark.parametrize("where", ["../outside.safetensors", "sub/../../outside.safetensors", "ABSOLUTE"])
def test_an_index_cannot_name_a_shard_outside_the_folder(tmp_path, model, where):
    folder = tmp_path / "ckpt"
    index = write_checkpoint(folder, model, shards=2)
    outside = tmp_path / "outside.safetensors"
    first = sorted(set(index["weight_map"].values()))[0]
    (folder / first).rename(outside)  # a complete checkpoint, if the loader followed the path
    target = str(outside) if where == "ABSOLUTE" else where
    index["weight_map"] = {k: target if v == first else v for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        load_checkpoint(folder)


def test_an_index_without_a_weight_map_names_the_index(tmp_path, model):
    write_checkpoint(tmp_path, model, shards=2)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json has no weight_map"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("cut", ["half", "5 bytes", "not json header"])
def test_a_corrupt_safetensors_file_is_a_value_error_naming_it(tmp_path, model, cut):
    write_checkpoint(tmp_path, model)
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes({"half": data[:len(data) // 2], "5 bytes": data[:5],
                      "not json header": (16).to_bytes(8, "little") + b"{not json at all"}[cut])
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors weight file"):
        load_checkpoint(tmp_path)


def test_a_corrupt_pytorch_bin_is_a_value_error_naming_it(tmp_path, model):
    (tmp_path / "config.json").write_text(json.dumps(hf_config()))
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    data = (tmp_path / "pytorch_model.bin").read_bytes()
    (tmp_path / "pytorch_model.bin").write_bytes(data[:len(data) // 3])
    with pytest.raises(ValueError, match="pytorch_model.bin is not a readable PyTorch weight file"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("content, error, words", [
    (b"\xff\xfe{}", ValueError, "config.json is not valid JSON"),
    (b"[1, 2]", TypeError, "config.json holds a JSON list, not an object"),
    (json.dumps(hf_config(rms_norm_eps="x")).encode(), TypeError, "config.json: rms_norm_eps='x'"),
])
def test_a_bad_config_json_names_the_file(tmp_path, model, content, error, words):
    write_checkpoint(tmp_path, model)
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(error) as info:
        load_checkpoint(tmp_path)
    assert str(tmp_path) in str(info.value) and words in str(info.value)


def test_a_truncated_gguf_names_the_file_and_says_it_may_be_truncated(tmp_path):
    whole = tmp_path / "whole.gguf"
    write_tiny_gguf(whole, {})
    truncated = tmp_path / "half.gguf"
    truncated.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"half\.gguf is not a readable GGUF file \(truncated or corrupt\?\)"):
        read_gguf(truncated)


def test_an_upper_case_gguf_suffix_loads(tmp_path):
    from minillm.checkpoints.pretrained import gguf_path

    upper = tmp_path / "SMOL.GGUF"
    upper.symlink_to(gguf_path())
    assert gguf_path(upper) == upper


def test_an_eos_token_outside_the_vocabulary_is_refused_by_the_engine(tiny_model):
    from minillm.engine import Engine, EngineConfig

    with pytest.raises(ValueError, match=r"eos_token_id=258 is outside the model's vocabulary \[0, 258\)"):
        Engine(tiny_model, EngineConfig(eos_token_id=258))
