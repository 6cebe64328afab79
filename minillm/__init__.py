"""minillm: a small LLaMA-style decoder for learning how LLM inference works."""
from .cache import KVCache
from .checkpoints.pretrained import load_pretrained
from .config import PRESETS, ModelConfig, get_config
from .device import resolve_device, resolve_dtype
from .generate import TokenEvent, generate, stream_generate
from .model import CausalLM, build_model
from .sampling import SamplingParams, filtered_probs, sample
from .text.bpe import BPETokenizer
from .text.byte import ByteTokenizer
from .timing import now, synchronize

__version__ = "0.1.0"
__all__ = [
    "BPETokenizer", "ByteTokenizer", "CausalLM", "KVCache", "ModelConfig", "PRESETS", "SamplingParams",
    "TokenEvent", "build_model", "filtered_probs", "generate", "get_config", "load_pretrained", "now",
    "resolve_device", "resolve_dtype", "sample", "stream_generate", "synchronize",
]
