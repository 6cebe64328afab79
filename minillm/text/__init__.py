"""Text to token ids and back: a byte-level tokenizer, SmolLM2's BPE with its chat template, and a streaming
detokenizer that never splits a character."""
from .bpe import BPETokenizer
from .byte import ByteTokenizer
from .stream import TextStream

__all__ = ["BPETokenizer", "ByteTokenizer", "TextStream"]
