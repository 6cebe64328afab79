"""A trained model's tokenizer: byte-level BPE (the ``tokenizers`` library) plus special tokens and a chat template.

The tiny random model uses ``ByteTokenizer`` (one token per UTF-8 byte). A trained LLaMA such as SmolLM2
uses byte-level BPE: text is split into words and digits, each word's UTF-8 bytes are mapped to
printable characters, and merges learned in training join them into the 49,152 tokens of its vocabulary.
The merging itself runs in the ``tokenizers`` library (Rust); this module builds it from a checkpoint's
files and adds what generation needs: the end-of-turn token and the chat template.
"""
from __future__ import annotations

import functools
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

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Text -> token ids. Special tokens written in the text (``<|im_start|>``) become their ids."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        add_bos = self.add_bos_token if add_bos is None else add_bos
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

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
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: list[dict] | str, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation (a str is one user message), ready for the assistant's reply."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_bos=False)
