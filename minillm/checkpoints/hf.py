"""Load LLaMA-architecture checkpoints in Hugging Face's format into minillm (and back, for comparisons).

minillm's parameter names are Hugging Face's, so a checkpoint's state dict loads with no renaming table;
what needs translating is the config (``hidden_size`` -> ``d_model`` and so on). Anything the model does
not implement (RoPE scaling, biases, another activation) is refused with a ValueError rather than loaded
into a model that would compute something else.

Weights are read only from safe formats: ``*.safetensors``, or ``pytorch_model.bin`` through
``torch.load(weights_only=True)``, which never runs pickled code.
"""
from __future__ import annotations

import os
from numbers import Real
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
# The longest context a config may claim: 2**24 = 16M positions, beyond every released LLaMA-style model
# (Llama 4 Scout claims 10M); a larger max_position_embeddings is a corrupt or hostile config.json.
MAX_POSITION_EMBEDDINGS = 2**24
# config.json's names of the ModelConfig fields, so that an error names the field the user can see.
HF_NAMES = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
            "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
            "d_ff": "intermediate_size", "max_seq_len": "max_position_embeddings", "rope_theta": "rope_theta",
            "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings"}


def _number(field: str, value) -> float:
    """A config.json field that must be a real number (not a bool, a string or null), as a float."""
    if not isinstance(value, Real) or isinstance(value, bool):
        raise TypeError(f"config.json: {field}={value!r} must be a number")
    return float(value)


def _object(field: str, value) -> dict:
    """A config.json field that must be an object (or absent/null: {})."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"config.json: {field}={value!r} must be an object (or null)")
    return value


def _rope_theta(hf_config: dict) -> float:
    """rope_theta from transformers 5's ``rope_parameters`` or an older top-level field; only plain RoPE."""
    params = _object("rope_parameters", hf_config.get("rope_parameters"))
    scaling = _object("rope_scaling", hf_config.get("rope_scaling"))
    for field, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        rope_type = spec.get("rope_type", spec.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"{field}.rope_type={rope_type!r} is not supported; minillm implements only "
                             "plain RoPE (rope_type='default')")
    if "rope_theta" in params:
        return _number("rope_parameters.rope_theta", params["rope_theta"])
    return _number("rope_theta", hf_config.get("rope_theta", 10000.0))


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
    n_kv_heads = hf_config.get("num_key_value_heads")
    tie = hf_config.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):  # bool("false") is True: a string must not tie the embeddings
        raise TypeError(f"config.json: tie_word_embeddings={tie!r} must be true or false")
    context = hf_config["max_position_embeddings"]
    if isinstance(context, int) and not isinstance(context, bool) and context > MAX_POSITION_EMBEDDINGS:
        raise ValueError(f"config.json: max_position_embeddings={context} is more than {MAX_POSITION_EMBEDDINGS} "
                         "positions (2**24); a corrupt config.json?")
    try:
        return ModelConfig(
            vocab_size=hf_config["vocab_size"],
            d_model=hf_config["hidden_size"],
            n_layers=hf_config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=n_heads if n_kv_heads is None else n_kv_heads,
            head_dim=hf_config.get("head_dim"),
            d_ff=hf_config["intermediate_size"],
            max_seq_len=context,
            rope_theta=_rope_theta(hf_config),
            norm_eps=_number("rms_norm_eps", hf_config["rms_norm_eps"]),
            tie_embeddings=tie,
        )
    except (TypeError, ValueError) as error:  # ModelConfig's words name its fields: add config.json's names
        message = str(error)
        if message.startswith("config.json:"):
            raise
        names = ", ".join(f"{ours} is {theirs}" for ours, theirs in HF_NAMES.items() if ours == message.split("=")[0])
        raise type(error)(f"config.json: {message}" + (f" ({names} in config.json)" if names else "")) from error


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
    """One weight file -> state dict on the CPU, never unpickling code. A file that cannot be read is an
    error naming it: ValueError (pickle.UnpicklingError for a pickle that weights_only refuses)."""
    import pickle

    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such weight file")
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(file), device="cpu")
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:  # refused code: keep its type, add the file
        raise pickle.UnpicklingError(f"{file}: {error}") from error
    except Exception as error:  # SafetensorError, zip/pickle errors of a cut or corrupt file, ...
        raise ValueError(f"{file} is not a readable {'safetensors' if file.suffix == '.safetensors' else 'PyTorch'} "
                         f"weight file (cut short or corrupt?): {type(error).__name__}: {error}") from error
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{file} does not hold a state dict of tensors (it holds a {type(state).__name__})")
    return state


def _weight_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: a single file, or the shards listed by an index."""
    for name in INDEX_FILES:
        if (path / name).is_file():
            index = read_json(path / name)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
                raise ValueError(f"{path / name} has no weight_map of tensor names to shard file names")
            return [_shard(path, path / name, shard) for shard in sorted(set(weight_map.values()))]
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return [path / name]
    raise ValueError(f"{path} holds none of {WEIGHT_FILES + INDEX_FILES}")


def _shard(folder: Path, index: Path, shard: str) -> Path:
    """The file a sharded index names, which must lie inside the checkpoint folder (no absolute path, no
    ``..`` out of it): a downloaded checkpoint reads only its own files. The check is on the names, not on
    where links lead: in the Hugging Face cache every file of a snapshot is a link into ``../../blobs``."""
    base = Path(os.path.normpath(folder.absolute()))
    file = Path(os.path.normpath(base / shard))
    if Path(shard).is_absolute() or file == base or not file.is_relative_to(base):
        raise ValueError(f"{index} names the shard {shard!r}, outside the checkpoint folder {folder}; refused")
    return file


def load_checkpoint(path: str | Path, device="cpu", dtype="float32") -> CausalLM:
    """A directory with ``config.json`` and Hugging Face LLaMA weights -> CausalLM in eval mode."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json; give a Hugging Face checkpoint directory")
    hf_config = read_json(path / "config.json")
    if not isinstance(hf_config, dict):
        raise TypeError(f"{path / 'config.json'} holds a JSON {type(hf_config).__name__}, not an object")
    try:
        config = config_from_hf(hf_config)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{path / 'config.json'}: {str(error).removeprefix('config.json: ')}") from error
    model = empty_model(config, device, dtype)
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
