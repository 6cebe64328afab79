"""Architecture diagrams: the data flow of one forward pass with its tensor shapes, and prefill
against decode as the shapes of one matrix multiplication.

The shapes come from ``forward_stages`` and ``matmul_shapes``, plain data computed from a
``ModelConfig``; the tests check them against the shapes a real forward pass produces, so a diagram
cannot show a shape the model does not have.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...config import ModelConfig
from ...validate import check_int
from . import axes_or_new

PART_COLORS = {"io": "0.92", "attention": "#c6dbef", "mlp": "#fdd0a2", "norm": "#e5e5e5",
               "cache": "#c7e9c0"}  # the residual additions are drawn as circles
Dim = int | str  # a size, or a symbol such as "B", "T", "S"


@dataclass(frozen=True)
class Stage:
    """One operation of the forward pass and the shape of what it outputs.

    ``module``: the minillm module (Hugging Face name, layer 0) whose output has ``shape``, or None
    where no module outputs exactly this tensor (RoPE, the KV cache, the attention weights, the
    first residual sum).
    """

    label: str
    detail: str
    shape: tuple[Dim, ...]
    part: str
    module: str | None = None
    tensor: str = ""  # the output's name where it is not the residual stream x


def _check_dim(name: str, value: Dim) -> Dim:
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{name} is an empty string; give a size or a symbol such as 'T'")
        return value
    return check_int(name, value)


def forward_stages(config: ModelConfig, batch: Dim = "B", tokens: Dim = "T",
                   keys: Dim = "S") -> list[list[Stage]]:
    """The stages of one forward pass, in rows; stages in one row run side by side.

    ``tokens``: positions fed in this call (the prompt length in prefill, 1 in decode); ``keys``: the
    positions attention reads (with a cache: all positions cached so far, new ones included). Rows
    between the first and the last norm belong to one decoder block, repeated ``n_layers`` times.
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    B, T, S = _check_dim("batch", batch), _check_dim("tokens", tokens), _check_dim("keys", keys)
    c = config
    d, D, H, Hkv, V = c.d_model, c.head_dim, c.n_heads, c.n_kv_heads, c.vocab_size
    layer = "model.layers.0"
    tied = " (tied to embed)" if c.tie_embeddings else ""
    return [
        [Stage("token ids", "", (B, T), "io", tensor="ids")],
        [Stage("embed_tokens", f"{V:,} x {d:,} table", (B, T, d), "io", "model.embed_tokens", "x")],
        [Stage("RMSNorm", "input_layernorm", (B, T, d), "norm", f"{layer}.input_layernorm")],
        [Stage("q_proj", f"{d:,} -> {H} x {D}", (B, T, H * D), "attention",
               f"{layer}.self_attn.q_proj", "q"),
         Stage("k_proj", f"{d:,} -> {Hkv} x {D}", (B, T, Hkv * D), "attention",
               f"{layer}.self_attn.k_proj", "k, v"),
         Stage("v_proj", f"{d:,} -> {Hkv} x {D}", (B, T, Hkv * D), "attention",
               f"{layer}.self_attn.v_proj", "k, v")],
        [Stage("RoPE on q", "rotate by position", (B, H, T, D), "attention", tensor="q"),
         Stage("RoPE on k", "rotate by position", (B, Hkv, T, D), "attention", tensor="k")],
        [Stage("KV cache", "write new k, v; read all", (B, Hkv, S, D), "cache", tensor="K, V")],
        [Stage("weights", f"softmax(q K^T / sqrt({D})), causal", (B, H, T, S), "attention",
               tensor="weights")],
        [Stage("weights @ V", "each head's mix of values", (B, H, T, D), "attention", tensor="out")],
        [Stage("o_proj", f"{H} x {D} -> {d:,}", (B, T, d), "attention", f"{layer}.self_attn.o_proj")],
        [Stage("+", "residual", (B, T, d), "residual")],
        [Stage("RMSNorm", "post_attention_layernorm", (B, T, d), "norm",
               f"{layer}.post_attention_layernorm")],
        [Stage("gate_proj", f"{d:,} -> {c.d_ff:,}", (B, T, c.d_ff), "mlp", f"{layer}.mlp.gate_proj"),
         Stage("up_proj", f"{d:,} -> {c.d_ff:,}", (B, T, c.d_ff), "mlp", f"{layer}.mlp.up_proj")],
        [Stage("SiLU(gate) * up", "SwiGLU", (B, T, c.d_ff), "mlp")],
        [Stage("down_proj", f"{c.d_ff:,} -> {d:,}", (B, T, d), "mlp", f"{layer}.mlp.down_proj")],
        [Stage("+", "residual", (B, T, d), "residual", layer)],
        [Stage("RMSNorm", "norm (final)", (B, T, d), "norm", "model.norm")],
        [Stage("lm_head", f"{d:,} -> {V:,}{tied}", (B, T, V), "io", "lm_head", "logits")],
    ]


BLOCK_ROWS = (2, 14)  # the first and last row of forward_stages that belong to the decoder block


def format_shape(shape: tuple[Dim, ...]) -> str:
    """(1, 'T', 49152) -> '(1, T, 49,152)'."""
    return "(" + ", ".join(f"{s:,}" if isinstance(s, int) else s for s in shape) + ")"


def _clean(ax) -> None:
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)
    for spine in ax.spines.values():
        spine.set_visible(False)


def draw_decoder_block(config: ModelConfig, name: str = "the model", ax=None, title: str | None = None):
    """One forward pass as a flow chart: each operation, its weights, and the shape of its output.

    B: rows in the batch; T: positions fed in this call; S: positions attention reads. Returns the
    axes; the box of row r, stage i has gid ``"stage-r-i"``, the block's frame ``"block"``.
    """
    from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch

    rows = forward_stages(config)
    ax = axes_or_new(ax, (7.5, 0.46 * len(rows) + 1.2))
    row_h, box_h, left, right, shape_x = 1.0, 0.62, 1.3, 6.3, 6.75
    first, last = BLOCK_ROWS

    def y_of(r: int) -> float:
        return -r * row_h

    mid, radius = (left + right) / 2, 0.24
    for r, stages in enumerate(rows):
        n, gap = len(stages), 0.15
        width = (right - left - gap * (n - 1)) / n
        for i, stage in enumerate(stages):
            x0 = left + i * (width + gap)
            if stage.part == "residual":  # an adder on the residual stream
                ax.add_patch(Circle((mid, y_of(r)), radius, facecolor="white", edgecolor="0.3",
                                    gid=f"stage-{r}-{i}"))
                ax.text(mid, y_of(r), "+", ha="center", va="center", fontsize=13)
                ax.text(mid + 0.4, y_of(r), "residual", ha="left", va="center", color="0.35",
                        fontsize=9.5)
                continue
            ax.add_patch(FancyBboxPatch((x0, y_of(r) - box_h / 2), width, box_h,
                                        boxstyle="round,pad=0,rounding_size=0.12",
                                        facecolor=PART_COLORS[stage.part], edgecolor="0.45",
                                        linewidth=0.8, gid=f"stage-{r}-{i}"))
            text = f"{stage.label}\n{stage.detail}" if n > 1 else f"{stage.label}: {stage.detail}"
            ax.text(x0 + width / 2, y_of(r), text if stage.detail else stage.label, ha="center",
                    va="center", fontsize=9.5 if n > 1 else 10, linespacing=0.95)
        shapes = dict.fromkeys(f"{s.tensor} {format_shape(s.shape)}".strip() for s in stages)
        ax.text(shape_x, y_of(r), "\n".join(shapes), ha="left", va="center", fontsize=9.5,
                family="monospace", linespacing=1.05)
        if r > 0:
            above = radius if rows[r - 1][0].part == "residual" else box_h / 2
            below = radius if stages[0].part == "residual" else box_h / 2
            ax.add_patch(FancyArrowPatch((mid, y_of(r - 1) - above), (mid, y_of(r) + below),
                                         arrowstyle="-|>", mutation_scale=9, color="0.35",
                                         linewidth=0.9, shrinkA=0, shrinkB=0))
    # the residual stream: it branches off before each half of the block and joins at its "+"
    adds = [r for r, stages in enumerate(rows) if stages[0].part == "residual"]
    rail = left - 0.55
    for start, add in zip([first - 1, adds[0]], adds):
        branch = y_of(start) - 0.5 * row_h
        ax.plot([mid, rail, rail], [branch, branch, y_of(add)], color="0.3", linewidth=1.0)
        ax.add_patch(FancyArrowPatch((rail, y_of(add)), (mid - radius, y_of(add)), arrowstyle="-|>",
                                     mutation_scale=9, color="0.3", linewidth=1.0, shrinkA=0,
                                     shrinkB=0))
    frame_top, frame_bottom = y_of(first) + 0.55, y_of(last) - 0.5
    ax.add_patch(FancyBboxPatch((left - 1.15, frame_bottom), right - left + 1.3,
                                frame_top - frame_bottom, boxstyle="round,pad=0,rounding_size=0.2",
                                facecolor="none", edgecolor="tab:blue", linewidth=1.4, linestyle="--",
                                gid="block"))
    ax.text(left - 1.3, (frame_top + frame_bottom) / 2,
            f"decoder block, repeated {config.n_layers} times", ha="right", va="center",
            rotation=90, color="tab:blue", fontsize=10)
    ax.text(shape_x, y_of(0) + 0.75, "output shape", ha="left", va="bottom", fontsize=10,
            fontweight="bold")
    ax.set_xlim(-0.45, 10.4)
    ax.set_ylim(y_of(len(rows) - 1) - 0.7, 1.35)
    _clean(ax)
    ax.set_title(title or f"One forward pass of {name}: the residual stream keeps the shape (B, T, "
                 f"{config.d_model:,})")
    return ax


@dataclass(frozen=True)
class MatmulShapes:
    """X (rows x d_in) @ W (d_in x d_out) = Y (rows x d_out), and what it costs."""

    rows: int
    d_in: int
    d_out: int

    @property
    def flops(self) -> int:
        """2 FLOPs (a multiply and an add) per weight per row."""
        return 2 * self.rows * self.d_in * self.d_out


def matmul_shapes(config: ModelConfig, prompt_len: int,
                  weight: str = "q_proj") -> dict[str, MatmulShapes]:
    """The shapes of one weight's multiplication in prefill (``prompt_len`` rows) and decode (1 row)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    check_int("prompt_len", prompt_len)
    c = config
    outs = {"q_proj": (c.d_model, c.n_heads * c.head_dim),
            "k_proj": (c.d_model, c.n_kv_heads * c.head_dim),
            "gate_proj": (c.d_model, c.d_ff), "down_proj": (c.d_ff, c.d_model)}
    if weight not in outs:
        raise ValueError(f"weight={weight!r}; choose one of {sorted(outs)}")
    d_in, d_out = outs[weight]
    return {"prefill": MatmulShapes(prompt_len, d_in, d_out), "decode": MatmulShapes(1, d_in, d_out)}


def draw_prefill_decode(config: ModelConfig, prompt_len: int, weight: str = "q_proj", ax=None,
                        title: str | None = None):
    """Prefill (top) against decode (bottom): the same weight W times a (T x d) or a (1 x d) input.

    Drawn to scale, one unit per row or column (a 1-row matrix is thickened to stay visible).
    Returns the axes; the matrices have gids ``"prefill-X"``, ``"prefill-W"``, ``"decode-Y"``, ..., the
    operator signs ``"<phase>-op"`` and each phase's two heading lines ``"<phase>-heading"``, ``"<phase>-uses"``.
    """
    from matplotlib.patches import Rectangle

    phases = matmul_shapes(config, prompt_len, weight)
    p = phases["prefill"]
    gap = 0.2 * max(p.d_in, p.d_out)
    width = p.d_in + 2 * p.d_out + 2 * gap
    inch = width / 7.2  # data units per inch of the drawing
    min_h, label_h, header_h = 0.04 * inch, 0.32 * inch, 0.62 * inch
    heights = {phase: max(m.rows, min_h, m.d_in) for phase, m in phases.items()}
    total = sum(heights.values()) + 2 * (label_h + header_h)
    ax = axes_or_new(ax, (7.5, total / inch + 0.45))
    colors = {"X": "#fdd0a2", "W": "#c6dbef", "Y": "#c7e9c0"}
    top = 0.0
    for phase in ("prefill", "decode"):
        m = phases[phase]
        top -= header_h
        rows = max(m.rows, min_h)  # a 1-row matrix drawn thick enough to see
        sizes = {"X": (m.d_in, rows), "W": (m.d_out, m.d_in), "Y": (m.d_out, rows)}
        names = {"X": f"X ({m.rows:,} x {m.d_in:,})", "W": f"W = {weight} ({m.d_in:,} x {m.d_out:,})",
                 "Y": f"Y ({m.rows:,} x {m.d_out:,})"}
        x = 0.0
        for key, op in (("X", "@"), ("W", "="), ("Y", None)):
            w, h = sizes[key]
            ax.add_patch(Rectangle((x, top - h), w, h, facecolor=colors[key], edgecolor="0.3",
                                   linewidth=1.0, gid=f"{phase}-{key}"))
            ax.text(x + w / 2, top - h - 0.06 * inch, names[key], ha="center", va="top", fontsize=10)
            x += w
            if op:  # centred on the thinner matrix, but never up into the heading above it
                centre = max(min(sizes["X"][1], sizes["W"][1]) / 2, 0.18 * inch)
                ax.text(x + gap / 2, top - centre, op, ha="center", va="center", fontsize=16,
                        gid=f"{phase}-op")
                x += gap
        if phase == "prefill":
            head = f"Prefill: {m.rows:,} prompt tokens in one call"
        else:
            head = "Decode: one new token per call"
        uses = f"each weight read from memory is used for {m.rows:,} row{'s' if m.rows > 1 else ''}"
        ax.text(0, top + 0.3 * inch, head, ha="left", va="bottom", fontsize=10.5, fontweight="bold",
                gid=f"{phase}-heading")
        ax.text(0, top + 0.07 * inch, f"{uses}: {m.flops / 1e6:,.1f} MFLOP", ha="left", va="bottom",
                fontsize=10, gid=f"{phase}-uses")
        if phase == "decode":
            ax.text(x - m.d_out, top - 0.45 * m.d_in, f"the same W, the same bytes read,\n"
                    f"1/{p.rows:,} of the prefill's multiply-adds", ha="left", va="center", fontsize=10,
                    color="0.25")
        top -= heights[phase] + label_h
    ax.set_xlim(-0.01 * width, 1.01 * width)
    ax.set_ylim(top, 0)
    ax.set_aspect("equal")
    _clean(ax)
    ax.set_title(title or "The same weights times T rows (prefill) or one row (decode)")
    return ax
