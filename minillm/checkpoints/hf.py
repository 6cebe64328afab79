"""Load LLaMA-architecture checkpoints in Hugging Face's format into minillm (and back, for comparisons).

minillm's parameter names are Hugging Face's, so a checkpoint's state dict loads with no renaming table;
what needs translating is the config (``hidden_size`` -> ``d_model`` and so on). Anything the model does
not implement (RoPE scaling, biases, another activation) is refused with a ValueError rather than loaded
into a model that would compute something else.

Weights are read only from safe formats: ``*.safetensors``, or ``pytorch_model.bin`` through
``torch.load(weights_only=True)``, which never runs pickled code.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..model import CausalLM, empty_model
from ..validate import read_json

SUPPORTED_MODEL_TYPES = ("llama",)
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                   "max_position_embeddings", "rms_norm_eps")
IGNORED_KEY_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed from rope_theta; older checkpoints saved it
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _rope_theta(hf_config: dict) -> float:
    """rope_theta from transformers 5's ``rope_parameters`` or an older top-level field; only plain RoPE."""
    params = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    for field, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        rope_type = spec.get("rope_type", spec.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"{field}.rope_type={rope_type!r} is not supported; minillm implements only "
                             "plain RoPE (rope_type='default')")
    theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    return float(theta)


def config_from_hf(hf_config: dict) -> ModelConfig:
    """A Hugging Face LLaMA ``config.json`` (as a dict) -> ModelConfig.

    Raises ValueError for a field minillm does not implement: another model_type, RoPE scaling,
    attention or MLP biases, or an activation other than SiLU.
    """
    if not isinstance(hf_config, dict):
        raise TypeError(f"hf_config must be a dict (config.json), got {type(hf_config).__name__}")
    model_type = hf_config.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not supported; minillm loads {SUPPORTED_MODEL_TYPES}")
    for field in ("attention_bias", "mlp_bias"):
        if hf_config.get(field, False):
            raise ValueError(f"{field}={hf_config[field]!r} is not supported; minillm's linear layers have no bias")
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported; minillm's MLP is SwiGLU (hidden_act='silu')")
    missing = [field for field in REQUIRED_FIELDS if field not in hf_config]
    if missing:
        raise ValueError(f"config has no {missing}; a LLaMA config.json needs {REQUIRED_FIELDS}")
    n_heads = hf_config["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf_config["vocab_size"],
        d_model=hf_config["hidden_size"],
        n_layers=hf_config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf_config.get("num_key_value_heads") or n_heads,
        head_dim=hf_config.get("head_dim"),
        d_ff=hf_config["intermediate_size"],
        max_seq_len=hf_config["max_position_embeddings"],
        rope_theta=_rope_theta(hf_config),
        norm_eps=float(hf_config["rms_norm_eps"]),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
    )


def config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig -> the keyword arguments of ``transformers.LlamaConfig`` (the inverse of config_from_hf)."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.d_ff,
        "max_position_embeddings": config.max_seq_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }


def load_state_dict_into(model: CausalLM, state_dict: dict[str, torch.Tensor]) -> CausalLM:
    """Copy a Hugging Face-named state dict into ``model`` (cast to its dtype and device), checking every key.

    Rotary ``inv_freq`` buffers are ignored. With tied embeddings ``lm_head.weight`` may be absent; if it is
    present it must equal the embedding. Missing keys, unexpected keys or a shape mismatch raise ValueError.
    """
    state = {k: v for k, v in state_dict.items() if not k.endswith(IGNORED_KEY_SUFFIXES)}
    if model.config.tie_embeddings and "lm_head.weight" in state:
        lm_head, embed = state.pop("lm_head.weight"), state.get("model.embed_tokens.weight")
        if embed is not None and not torch.equal(lm_head, embed):
            raise ValueError("tie_word_embeddings is true but lm_head.weight differs from "
                             "model.embed_tokens.weight in the checkpoint")
    params = model.state_dict()
    if model.config.tie_embeddings:
        params.pop("lm_head.weight")  # the same tensor as model.embed_tokens.weight
    missing, unexpected = sorted(params.keys() - state.keys()), sorted(state.keys() - params.keys())
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: {len(missing)} missing keys {missing[:5]}, "
                         f"{len(unexpected)} unexpected keys {unexpected[:5]}")
    for name, tensor in state.items():
        if tensor.shape != params[name].shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape "
                             f"{tuple(params[name].shape)}")
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)
    return model


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    """One weight file -> state dict on the CPU, never unpickling code."""
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file), device="cpu")
    return torch.load(file, map_location="cpu", weights_only=True)


def _weight_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: a single file, or the shards listed by an index."""
    for name in INDEX_FILES:
        if (path / name).is_file():
            weight_map = read_json(path / name)["weight_map"]
            return [path / shard for shard in sorted(set(weight_map.values()))]
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return [path / name]
    raise ValueError(f"{path} holds none of {WEIGHT_FILES + INDEX_FILES}")


def load_checkpoint(path: str | Path, device="cpu", dtype="float32") -> CausalLM:
    """A directory with ``config.json`` and Hugging Face LLaMA weights -> CausalLM in eval mode."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json; give a Hugging Face checkpoint directory")
    model = empty_model(config_from_hf(read_json(path / "config.json")), device, dtype)
    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        state.update(_read_weights(file))
    return load_state_dict_into(model, state).eval().requires_grad_(False)


def to_transformers(model: CausalLM, attn_implementation: str = "sdpa", **config_overrides):
    """The same weights in a ``transformers.LlamaForCausalLM`` on the model's device and dtype (eval mode).

    ``config_overrides`` go to ``LlamaConfig`` (e.g. ``eos_token_id=None`` so generation never stops early).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(**config_to_hf(model.config), attn_implementation=attn_implementation,
                            **config_overrides)
    hf_model = LlamaForCausalLM(hf_config).to(device=model.device, dtype=model.dtype)
    hf_model.load_state_dict(model.state_dict())
    return hf_model.eval().requires_grad_(False)
