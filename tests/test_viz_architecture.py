"""The architecture diagrams: their shapes are the shapes a real forward pass produces."""
import matplotlib
import pytest
import torch
from conftest import SMALL, random_ids

from minillm import KVCache, get_config
from minillm.book.instruments import RecordingView
from minillm.book.viz.architecture import (
    BLOCK_ROWS,
    draw_decoder_block,
    draw_prefill_decode,
    format_shape,
    forward_stages,
    matmul_shapes,
)
from minillm.config import ModelConfig

matplotlib.use("Agg")
SMOLLM2 = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                      d_ff=1536, max_seq_len=8192, rope_theta=100000.0, tie_embeddings=True)


def _module_outputs(model, ids, names):
    """The output shape of each named module during one forward pass."""
    shapes, modules = {}, dict(model.named_modules())

    def record(name):
        def hook(module, args, out):  # returns None: the output is left as it is
            shapes.setdefault(name, tuple(out.shape))
        return hook

    hooks = [modules[name].register_forward_hook(record(name)) for name in names]
    with torch.inference_mode():
        model(ids)
    for h in hooks:
        h.remove()
    return shapes


def test_module_shapes_equal_a_real_forward_pass(small_model):
    ids = random_ids(SMALL.vocab_size, (2, 5))
    stages = [s for row in forward_stages(SMALL, batch=2, tokens=5, keys=5) for s in row]
    checked = [s for s in stages if s.module is not None]
    measured = _module_outputs(small_model, ids, {s.module for s in checked})
    assert len(checked) == 13  # embed, 2 norms, q/k/v/o, 3 MLP projections, the block, norm, lm_head
    for stage in checked:
        assert stage.shape == measured[stage.module], stage


def test_cache_and_attention_shapes_in_a_decode_step(small_model):
    """A decode step feeds T = 1 token and reads S = prompt + 1 positions."""
    cache = KVCache(SMALL, batch_size=2, max_len=8)
    recorder = RecordingView(cache)
    with torch.inference_mode():
        small_model(random_ids(SMALL.vocab_size, (2, 5)), cache=recorder)
        small_model(random_ids(SMALL.vocab_size, (2, 1), seed=1), cache=recorder)
    stages = forward_stages(SMALL, batch=2, tokens=1, keys=6)
    by_tensor = {s.tensor: s.shape for row in stages for s in row}
    assert by_tensor["weights"] == tuple(recorder.weights[0].shape) == (2, 6, 1, 6)
    assert by_tensor["K, V"] == tuple(cache.k[0][:, :, :6].shape) == (2, 2, 6, 10)
    assert by_tensor["logits"] == (2, 1, SMALL.vocab_size)


def test_rotated_keys_and_the_attention_output_in_a_prefill(small_model):
    """k after RoPE (B, Hkv, T, D) is what the cache stores; the heads' output (B, H, T, D) is what o_proj reads,
    joined as (B, T, H * D)."""
    attention = small_model.model.layers[0].self_attn
    seen = []
    hook = attention.o_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape) and None)
    cache = KVCache(SMALL, batch_size=2, max_len=5)
    with torch.inference_mode():
        small_model(random_ids(SMALL.vocab_size, (2, 5)), cache=cache)
    hook.remove()
    by_tensor = {s.tensor: s.shape for row in forward_stages(SMALL, batch=2, tokens=5, keys=5) for s in row}
    B, H, T, D = by_tensor["out"]
    assert (B, T, H * D) == tuple(seen[0]) and H == SMALL.n_heads and D == SMALL.head_dim
    assert by_tensor["k"] == tuple(cache.k[0].shape) == (2, SMALL.n_kv_heads, 5, SMALL.head_dim)


def test_symbolic_shapes_and_the_block_rows():
    rows = forward_stages(SMOLLM2)
    assert [format_shape(s.shape) for s in rows[-1]] == ["(B, T, 49,152)"]
    first, last = BLOCK_ROWS
    assert rows[first][0].module.endswith("input_layernorm") and rows[last][0].part == "residual"
    assert rows[first - 1][0].module == "model.embed_tokens" and rows[last + 1][0].module == "model.norm"
    assert "tied" in rows[-1][0].detail
    assert "tied" not in forward_stages(get_config("tiny"))[-1][0].detail


def _texts(ax):
    return [t.get_text() for t in ax.texts] + [ax.get_title()]


def test_decoder_diagram_draws_every_stage_with_the_config_numbers():
    ax = draw_decoder_block(SMOLLM2, "SmolLM2-135M")
    texts = "\n".join(_texts(ax))
    gids = {p.get_gid() for p in ax.patches}
    n_stages = sum(len(row) for row in forward_stages(SMOLLM2))
    rows = forward_stages(SMOLLM2)
    assert {f"stage-{r}-{i}" for r, row in enumerate(rows) for i in range(len(row))} <= gids
    assert len([g for g in gids if g and g.startswith("stage-")]) == n_stages
    assert "block" in gids
    for piece in ("embed_tokens: 49,152 x 576 table", "q (B, T, 576)", "k, v (B, T, 192)", "q (B, 9, T, 64)",
                  "k (B, 3, T, 64)", "K, V (B, 3, S, 64)", "weights (B, 9, T, S)", "out (B, 9, T, 64)",
                  "repeated 30 times", "SmolLM2-135M"):
        assert piece in texts, piece
    assert not any("\u4e00" <= ch <= "\u9fff" for ch in texts), "no CJK glyphs in figures"
    assert ax.get_title().endswith("the residual stream keeps the shape (B, T, 576)")
    tiny = "\n".join(_texts(draw_decoder_block(get_config("tiny"))))
    assert "258 x 256 table" in tiny and "repeated 4 times" in tiny
    matplotlib.pyplot.close("all")


def test_matmul_shapes_prefill_and_decode():
    phases = matmul_shapes(SMOLLM2, 512)
    assert (phases["prefill"].rows, phases["decode"].rows) == (512, 1)
    assert phases["prefill"].flops == 2 * 512 * 576 * 576 == 512 * phases["decode"].flops
    gate = matmul_shapes(SMOLLM2, 7, "gate_proj")["decode"]
    assert (gate.d_in, gate.d_out) == (576, 1536)
    down = matmul_shapes(SMOLLM2, 7, "down_proj")["prefill"]
    assert (down.rows, down.d_in, down.d_out) == (7, 1536, 576)


def test_prefill_decode_diagram_is_drawn_to_scale():
    ax = draw_prefill_decode(SMOLLM2, 512)
    rects = {p.get_gid(): p for p in ax.patches}
    assert (rects["prefill-X"].get_width(), rects["prefill-X"].get_height()) == (576, 512)
    assert (rects["prefill-W"].get_width(), rects["prefill-W"].get_height()) == (576, 576)
    assert (rects["decode-W"].get_width(), rects["decode-W"].get_height()) == (576, 576)
    assert rects["decode-X"].get_width() == 576 and 1 <= rects["decode-X"].get_height() < 40
    texts = "\n".join(_texts(ax))
    assert "X (512 x 576)" in texts and "Y (1 x 576)" in texts and "1/512 of the prefill" in texts
    assert "339.7 MFLOP" in texts and "0.7 MFLOP" in texts  # 2 x 512 x 576 x 576 and 2 x 576 x 576
    matplotlib.pyplot.close("all")


@pytest.mark.parametrize("prompt_len", [512, 40, 4])
def test_prefill_decode_operator_signs_clear_the_headings(prompt_len):
    """The "@" and "=" between thin one-row matrices sit below the phase's heading lines, not on them."""
    ax = draw_prefill_decode(SMOLLM2, prompt_len)
    renderer = ax.figure.canvas.get_renderer()
    boxes = {}
    for text in ax.texts:
        boxes.setdefault(text.get_gid(), []).append(text.get_window_extent(renderer))
    for phase in ("prefill", "decode"):
        signs, headings = boxes[f"{phase}-op"], boxes[f"{phase}-heading"] + boxes[f"{phase}-uses"]
        assert len(signs) == 2 and len(headings) == 2
        assert not any(sign.overlaps(heading) for sign in signs for heading in headings), phase
    matplotlib.pyplot.close("all")


@pytest.mark.parametrize("call, error, message", [
    (lambda: matmul_shapes(SMOLLM2, 0), ValueError, "prompt_len=0 must be >= 1"),
    (lambda: matmul_shapes(SMOLLM2, 4, "o_proj"), ValueError, "weight='o_proj'; choose one of"),
    (lambda: matmul_shapes("smollm2", 4), TypeError, "config must be a ModelConfig"),
    (lambda: forward_stages(SMALL, tokens=0), ValueError, "tokens=0 must be >= 1"),
    (lambda: forward_stages(SMALL, batch=""), ValueError, "batch is an empty string"),
    (lambda: forward_stages(SMALL, keys=2.5), TypeError, "keys=2.5 must be an integer"),
])
def test_bad_input_is_named(call, error, message):
    with pytest.raises(error, match=message):
        call()
