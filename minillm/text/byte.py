"""Byte-level UTF-8 tokenizer: ids 0-255 are bytes, then BOS and EOS."""
from __future__ import annotations

from ..validate import check_token_ids


class ByteTokenizer:
    """Lossless for any text: every UTF-8 byte is one token (a Chinese character is 3 tokens)."""

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        return ([self.bos_token_id] if bos else []) + ids + ([self.eos_token_id] if eos else [])

    def decode(self, ids, errors: str = "replace") -> str:
        """Special tokens are dropped; byte runs that are not valid UTF-8 become U+FFFD by default."""
        ids = [int(i) for i in ids]
        check_token_ids(ids, self.vocab_size)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors=errors)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for: its byte, or a special token's name (``<EOS>``)."""
        check_token_ids([int(token_id)], self.vocab_size)
        return bytes([token_id]) if token_id < 256 else self.token_strings([token_id])[0].encode()

    def token_strings(self, ids) -> list[str]:
        """A readable label per token: the byte as hex, the character where the byte is ASCII."""
        names = {self.bos_token_id: "<BOS>", self.eos_token_id: "<EOS>"}
        return [names.get(i, chr(i) if 32 <= i < 127 else f"0x{i:02X}") for i in map(int, ids)]
