"""minillm: a small LLaMA-style decoder for learning how LLM inference works."""
from .bpe import BPETokenizer
from .cache import KVCache
from .config import PRESETS, ModelConfig, get_config
from .device import resolve_device, resolve_dtype
from .generate import TokenEvent, generate, stream_generate
from .model import CausalLM, build_model
from .pretrained import load_pretrained
from .sampling import SamplingParams, filtered_probs, sample
from .timing import now, synchronize
from .tokenizer import ByteTokenizer

__version__ = "0.1.0"
__all__ = [
    "BPETokenizer", "ByteTokenizer", "CausalLM", "KVCache", "ModelConfig", "PRESETS", "SamplingParams", "TokenEvent",
    "build_model", "filtered_probs", "generate", "get_config", "load_pretrained", "now", "resolve_device", "resolve_dtype",
    "sample", "stream_generate", "synchronize",
]
