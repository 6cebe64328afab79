"""Incremental detokenization, for streamed text: the demo's output and the server's events."""
from __future__ import annotations


class TextStream:
    """Token ids in, text out as soon as it is whole: a character split across tokens (a Chinese character
    is 3 UTF-8 bytes, which byte-level BPE may cut in two) is held back until its last byte arrives.

    vLLM's incremental detokenization: decode the tokens since the last printed piece, with that piece's
    tokens as context, and print what grew, unless it ends in U+FFFD (an incomplete character).
    """

    def __init__(self, tokenizer):
        self.tokenizer, self.ids = tokenizer, []
        self.prefix_offset = self.read_offset = 0  # ids[prefix_offset:read_offset] = the last printed piece

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (maybe "")."""
        self.ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """After the last token: whatever is held back (an invalid byte sequence prints as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(before):]
