"""Real weights: Hugging Face LLaMA folders (safetensors or torch files), GGUF files, and the packaged
SmolLM2-135M-Instruct behind ``load_pretrained``."""
from .pretrained import load_pretrained

__all__ = ["load_pretrained"]
