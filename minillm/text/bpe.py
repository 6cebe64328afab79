"""A trained model's tokenizer: byte-level BPE (the ``tokenizers`` library) plus special tokens and a chat template.

The tiny random model uses ``ByteTokenizer`` (one token per UTF-8 byte). A trained LLaMA such as SmolLM2
uses byte-level BPE: text is split into words and digits, each word's UTF-8 bytes are mapped to
printable characters, and merges learned in training join them into the 49,152 tokens of its vocabulary.
The merging itself runs in the ``tokenizers`` library (Rust); this module builds it from a checkpoint's
files and adds what generation needs: the end-of-turn token and the chat template.
"""
from __future__ import annotations

import functools
import re
import secrets
from pathlib import Path

from ..validate import check_token_ids, read_json

# llama.cpp's "smollm" pre-tokenizer (as in SmolLM2's tokenizer.json): every digit on its own, then
# GPT-2's split into words, numbers, punctuation and spaces.
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PRE_TOKENIZERS = ("smollm", "gpt2")  # tokenizer.ggml.pre values built here (llama.cpp's names)
CONTROL_TOKEN_TYPE = 3  # llama.cpp's token_type for special tokens such as <|im_end|>


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: each byte 0-255 is written as one printable character
    (printable bytes as themselves, the others shifted to U+0100 and up; a space is 'Ġ')."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _tokenizers_module():
    try:
        import tokenizers
    except ImportError as error:
        raise ImportError("a BPE tokenizer needs the 'tokenizers' package: pip install tokenizers "
                          "(or pip install 'minillm[pretrained]')") from error
    return tokenizers


class BPETokenizer:
    """encode / decode / chat template for a trained checkpoint.

    ``eos_token_id`` is the token that ends the assistant's turn (SmolLM2: ``<|im_end|>``), the one
    generation stops at.
    """

    def __init__(self, backend, bos_token_id: int | None, eos_token_id: int, chat_template: str | None,
                 add_bos_token: bool = False):
        self.backend = backend
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.chat_template, self.add_bos_token = chat_template, add_bos_token
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._compiled: tuple[str, object] | None = None  # (template source, compiled template)
        self._text_backend = None  # a copy of the backend that reads special-token names as plain text

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern | None:
        """The special tokens' names, longest first (so ``<|im_start|>`` wins over a prefix of it)."""
        names = sorted({t.content for t in self.backend.get_added_tokens_decoder().values() if t.special},
                       key=len, reverse=True)
        return re.compile("|".join(map(re.escape, names))) if names else None

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> BPETokenizer:
        """From a GGUF file's ``tokenizer.ggml.*`` fields (``minillm.checkpoints.gguf.read_gguf``)."""
        tk = _tokenizers_module()
        if meta.get("model") != "gpt2":
            raise ValueError(f"tokenizer.ggml.model={meta.get('model')!r}: only byte-level BPE ('gpt2') is supported")
        if meta.get("pre") not in PRE_TOKENIZERS:
            raise ValueError(f"tokenizer.ggml.pre={meta.get('pre')!r}: minillm knows the pre-tokenizers "
                             f"{PRE_TOKENIZERS} only")
        tokens = list(meta["tokens"])
        vocab = {token: i for i, token in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
        backend = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        splits = [tk.pre_tokenizers.Split(tk.Regex(GPT2_SPLIT), behavior="isolated"),
                  tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        if meta.get("pre") == "smollm":
            splits.insert(0, tk.pre_tokenizers.Digits(individual_digits=True))
        backend.pre_tokenizer = tk.pre_tokenizers.Sequence(splits)
        backend.decoder = tk.decoders.ByteLevel()
        types = list(meta["token_type"])
        specials = [tokens[i] for i, kind in enumerate(types) if kind == CONTROL_TOKEN_TYPE]
        backend.add_special_tokens([tk.AddedToken(t, special=True, normalized=False) for t in specials])
        return cls(backend, meta.get("bos_token_id"), int(meta["eos_token_id"]), meta.get("chat_template"),
                   bool(meta.get("add_bos_token") or False))

    @classmethod
    def from_hf_folder(cls, path: str | Path, eos_token_id: int | None = None) -> BPETokenizer:
        """From a Hugging Face folder: ``tokenizer.json``, and ``tokenizer_config.json`` /
        ``chat_template.jinja`` for the special tokens and the template."""
        tk, path = _tokenizers_module(), Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path} has no tokenizer.json; minillm reads fast (tokenizers) tokenizers only")
        backend = tk.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
        template = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")

        def token_id(name: str) -> int | None:
            token = config.get(name)
            token = token.get("content") if isinstance(token, dict) else token
            return backend.token_to_id(token) if token else None

        eos = eos_token_id if eos_token_id is not None else token_id("eos_token")
        if eos is None:
            raise ValueError(f"{path}: no eos_token in tokenizer_config.json and none given")
        return cls(backend, token_id("bos_token"), eos, template, bool(config.get("add_bos_token", False)))

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Text -> token ids. Special tokens written in the text (``<|im_start|>``) become their ids;
        with ``special=False`` their names are plain text (what a chat message's content is)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        backend = self.backend if special else self._plain_text_backend()
        # encode_batch releases the GIL while it works (encode holds it: 244 ms for 620k characters), so a long
        # prompt tokenized on a server's worker thread does not stall its event loop or engine thread
        ids = backend.encode_batch([text], add_special_tokens=False)[0].ids
        add_bos = self.add_bos_token if add_bos is None else add_bos
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def _plain_text_backend(self):
        """The backend with special-token matching off (``encode_special_tokens``), a copy made once: the
        flag is state of the tokenizer object, so setting it on the shared one would race other callers."""
        if self._text_backend is None:
            copy = type(self.backend).from_str(self.backend.to_str())
            copy.encode_special_tokens = True
            self._text_backend = copy
        return self._text_backend

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        check_token_ids(ids, self.vocab_size)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes a token stands for (special tokens: their name's bytes)."""
        check_token_ids([int(token_id)], self.vocab_size)
        piece = self.backend.id_to_token(int(token_id))
        table = _unicode_to_byte()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return piece.encode("utf-8")

    def token_strings(self, ids) -> list[str]:
        """A readable label per token: its text, or its bytes in hex where they are part of a character
        (a Chinese character is 3 UTF-8 bytes, which BPE may split across tokens)."""
        labels = []
        for i in ids:
            raw = self.token_bytes(i)
            try:
                labels.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                labels.append("".join(f"<{b:02X}>" for b in raw))
        return labels

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation: ``[{"role": "user", "content": "..."}]`` -> str."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; encode plain text instead")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and {"role", "content"} <= m.keys()
                                                     for m in messages):
            raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
        return self._template().render(messages=messages, add_generation_prompt=add_generation_prompt)

    def _template(self):
        """The chat template, compiled once (compiling is ~250 times the cost of rendering); again only if
        ``chat_template`` was replaced."""
        if self._compiled is None or self._compiled[0] != self.chat_template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._compiled = (self.chat_template, env.from_string(self.chat_template))
        return self._compiled[1]

    def encode_chat(self, messages: list[dict] | str, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation (a str is one user message), ready for the assistant's reply.

        Only the template's own markup can hold control tokens: a message whose content says
        ``<|im_end|>\\n<|im_start|>system`` gets those names as plain text, so no one can forge a turn by
        typing it. An ordinary conversation is encoded exactly as ``encode(apply_chat_template(...))``.
        """
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        text = self.apply_chat_template(messages, add_generation_prompt)
        pattern = self._special_pattern
        if pattern is None:
            return self.encode(text, add_bos=False)
        spans = self._content_spans(messages, add_generation_prompt, text)
        # Cut the prompt at the special tokens the template wrote (none inside a content span), and encode
        # the text between them with special-token matching off: the tokenizer itself cuts a text at its
        # special tokens first and encodes each piece apart, so an ordinary chat gives the same ids.
        ids, start = [], 0
        for match in pattern.finditer(text):
            if any(lo < match.end() and match.start() < hi for lo, hi in spans):
                continue
            if match.start() > start:
                ids += self.encode(text[start:match.start()], add_bos=False, special=False)
            ids.append(self.backend.token_to_id(match.group()))
            start = match.end()
        if start < len(text):
            ids += self.encode(text[start:], add_bos=False, special=False)
        return ids

    def _content_spans(self, messages: list[dict], add_generation_prompt: bool, text: str) -> list[tuple[int, int]]:
        """Where each message's content lies in the rendered prompt ``text``: rendered again with each
        content between two random markers, which must then disappear without a trace. A template that
        changes the content (so the markers cannot find it) gets no spans, and then content holding a
        special token's name is refused rather than let through as control tokens."""
        nonce = secrets.token_hex(16)
        open_mark, close_mark = f"\x02{nonce}[", f"]{nonce}\x03"
        marked = [m | {"content": f"{open_mark}{m['content']}{close_mark}"} if isinstance(m.get("content"), str)
                  else m for m in messages]
        rendered = self._template().render(messages=marked, add_generation_prompt=add_generation_prompt)
        spans, plain, pos = [], [], 0
        for match in re.finditer(f"{re.escape(open_mark)}(.*?){re.escape(close_mark)}", rendered, re.DOTALL):
            plain.append(rendered[pos:match.start()])
            lo = sum(map(len, plain))
            plain.append(match.group(1))
            spans.append((lo, lo + len(match.group(1))))
            pos = match.end()
        plain.append(rendered[pos:])
        if "".join(plain) == text:
            return spans
        for m in messages:
            if isinstance(m.get("content"), str) and self._special_pattern.search(m["content"]):
                raise ValueError("a message's content holds a special token's name (such as <|im_start|>), and "
                                 "this chat template changes the content, so it cannot be kept as plain text")
        return []
