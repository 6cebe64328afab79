"""Model configuration: a validated dataclass and named presets."""
from __future__ import annotations

from dataclasses import dataclass, replace

from .validate import check_int, check_number


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a LLaMA-style decoder.

    ``head_dim`` defaults to ``d_model // n_heads``; it may differ (some checkpoints use a wider or
    narrower head than ``d_model / n_heads``). ``n_kv_heads < n_heads`` is grouped-query attention
    (GQA); ``n_kv_heads == 1`` is multi-query attention (MQA).
    """

    vocab_size: int = 258
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int | None = None
    d_ff: int = 688
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len")
        for name in sizes + (("head_dim",) if self.head_dim is not None else ()):
            check_int(name, getattr(self, name))
        if self.head_dim is None:
            if self.d_model % self.n_heads != 0:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        check_number("rope_theta", self.rope_theta)
        check_number("norm_eps", self.norm_eps)
        if not isinstance(self.tie_embeddings, bool):
            raise TypeError(f"tie_embeddings={self.tie_embeddings!r} must be True or False")

    @property
    def n_groups(self) -> int:
        """Query heads that share one key/value head."""
        return self.n_heads // self.n_kv_heads

    def param_counts(self) -> dict[str, int]:
        """Parameters by part, computed from the shapes alone (no allocation)."""
        d, hd = self.d_model, self.head_dim
        attn = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2  # q, o + k, v
        mlp = 3 * d * self.d_ff  # gate, up, down
        norms = 2 * d
        embed = self.vocab_size * d
        return {
            "embed_tokens": embed,
            "attention": self.n_layers * attn,
            "mlp": self.n_layers * mlp,
            "norms": self.n_layers * norms + d,
            "lm_head": 0 if self.tie_embeddings else embed,
        }

    @property
    def n_params(self) -> int:
        """Total parameter count (tied embeddings counted once)."""
        return sum(self.param_counts().values())

    def with_(self, **changes) -> ModelConfig:
        """A copy with some fields changed (validated again).

        A ``head_dim`` that was the default ``d_model // n_heads`` is derived again from the new
        shape unless ``head_dim`` itself is changed.
        """
        if "head_dim" not in changes and self.head_dim == self.d_model // self.n_heads:
            changes["head_dim"] = None
        return replace(self, **changes)


PRESETS: dict[str, ModelConfig] = {
    # ~2.9M parameters, GQA 8:2; byte-level vocabulary (256 bytes + BOS + EOS).
    "tiny": ModelConfig(),
    # Shape-only presets for the arithmetic chapters (never allocated in the book).
    "llama-7b": ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                            d_ff=11008, max_seq_len=2048, norm_eps=1e-6),
    "llama-13b": ModelConfig(vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, n_kv_heads=40,
                             d_ff=13824, max_seq_len=2048, norm_eps=1e-6),
    "llama2-70b": ModelConfig(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                              d_ff=28672, max_seq_len=4096, norm_eps=1e-5),
}


def get_config(name: str, **overrides) -> ModelConfig:
    """A preset by name, optionally with fields overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].with_(**overrides) if overrides else PRESETS[name]

