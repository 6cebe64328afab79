"""Lab 2.1: rotary embedding, causal attention with grouped KV heads, and the sampling filter.

The learner writes ``apply_rope``, ``causal_attention`` and ``next_token_probs``. The hidden cases compare
them with minillm's own model and sampler; ``learner_attention`` puts the first two inside any
``CausalLM`` (the tiny model in the checks, SmolLM2 in the lab), and ``write_text`` is the lab's payoff.
Each function's catalogue (:mod:`.diagnosis`) holds the bugs learners write, as code.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ...cache import KVCache, causal_mask
from ...generate import generate
from ...model import Attention, RotaryEmbedding, apply_rotary
from ...sampling import SamplingParams, filtered_probs
from .cases import assert_close, encode_prompt, randint, randn, show_text, tiny_model
from .checker import LearnerError, Mismatch, Property, Task, call, expect_tensor, register
from .diagnosis import Bug, Catalogue

BHTD = ("row", "head", "position", "element")


# --- references (minillm's own pieces) -------------------------------------------------------------

def _rope_reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    cos, sin = RotaryEmbedding(x.shape[-1], theta)(positions, x.dtype)  # (B, 1, T, D)
    return apply_rotary(x, cos, sin)


def _attention_reference(q, k, v, positions):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # (B, H, S, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(positions, k.shape[2]))


# --- apply_rope and its known bugs ------------------------------------------------------------------

def _rope_bug(x, positions, theta, layout="half", exponent=2.0, sign=1.0):
    """RoPE with one of the usual slips (the defaults: no slip)."""
    D = x.shape[-1]
    inv_freq = theta ** (-exponent * torch.arange(D // 2, dtype=torch.float32) / D)
    angles = sign * positions[:, None, :, None].float() * inv_freq  # (B, 1, T, D/2)
    cos, sin = angles.cos(), angles.sin()
    if layout == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    a, b = x[..., : D // 2], x[..., D // 2:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def _rope_probes():
    return [(randn(2, 2, 3, 8, seed=300), torch.tensor([[0, 5, 9], [3, 4, 100]]), 100000.0),
            (randn(1, 3, 2, 16, seed=301), torch.tensor([[7, 2]]), 10000.0)]


ROPE_BUGS = Catalogue("apply_rope", _rope_reference, (
    Bug("rope.interleaved", "pairing each element with its neighbour (i, i + 1)",
        "LLaMA and SmolLM2 pair element i with element i + D/2 (the rotate-half layout).",
        lambda x, p, t: _rope_bug(x, p, t, layout="interleaved")),
    Bug("rope.frequency", "an exponent of -i / D", "Pair i turns at theta to the power -2i / D: the "
        "exponent counts the pairs in steps of 2 out of D.", lambda x, p, t: _rope_bug(x, p, t, exponent=1.0)),
    Bug("rope.direction", "a rotation the wrong way round", "Check the signs: the first half becomes "
        "a cos - b sin, the second a sin + b cos.", lambda x, p, t: _rope_bug(x, p, t, sign=-1.0)),
    Bug("rope.theta", "a theta fixed at 10000", "Use the theta you are given in the frequencies.",
        lambda x, p, t: _rope_bug(x, p, 10000.0)),
    Bug("rope.index", "rotating by the index along T instead of the positions",
        "Rotate by the positions given: a decode step's one token sits at its position, not at 0.",
        lambda x, p, t: _rope_bug(x, torch.arange(p.shape[1]).expand(p.shape), t)),
    Bug("rope.row0", "rotating every row by row 0's positions", "Each row turns by its own positions.",
        lambda x, p, t: _rope_bug(x, p[:1].expand(p.shape), t)),
), _rope_probes)


def _rope(fns, x, positions, theta=10000.0):
    out = call(fns["apply_rope"], x.clone(), positions.clone(), theta)
    return expect_tensor("apply_rope", out, tuple(x.shape))


def _rope_compare(fns, x, positions, theta, what):
    assert_close(_rope(fns, x, positions, theta), _rope_reference(x, positions, theta), what, dims=BHTD,
                 explain=lambda: ROPE_BUGS.hint(fns, x, positions, theta))


def _rope_shape(fns):
    _rope(fns, randn(2, 3, 5, 8, seed=1), torch.arange(5).expand(2, 5))


def _rope_zero(fns):
    x, positions = randn(1, 2, 3, 8, seed=2), torch.zeros(1, 3, dtype=torch.long)
    _rope_compare(fns, x, positions, 10000.0, "the output at position 0")


def _rope_length(fns):
    x, positions = randn(1, 2, 6, 8, seed=3), randint(500, (1, 6), seed=3)
    out = _rope(fns, x, positions)
    assert_close(out.norm(dim=-1), x.norm(dim=-1), "the length of each vector", atol=1e-3, dims=BHTD[:3])


def _rope_matches(theta):
    def run(fns):
        x, positions = randn(1, 2, 7, 16, seed=4), torch.tensor([[0, 1, 2, 3, 10, 100, 1000]])
        _rope_compare(fns, x, positions, theta, f"the rotated vectors (theta={theta:g})")
    return run


def _rope_rows(fns):
    x, positions = randn(2, 3, 4, 8, seed=5), torch.tensor([[0, 1, 2, 3], [7, 8, 9, 10]])
    _rope_compare(fns, x, positions, 10000.0, "the rotated vectors of rows at different positions")


def _rope_relative(fns):
    q, k = randn(1, 1, 1, 8, seed=6), randn(1, 1, 1, 8, seed=7)
    dots = []
    for shift in (0, 5, 50):
        rq = _rope(fns, q, torch.tensor([[3 + shift]]))
        rk = _rope(fns, k, torch.tensor([[1 + shift]]))
        dots.append(float((rq * rk).sum()))
    if max(dots) - min(dots) > 1e-3:
        raise Mismatch(f"q at position 3 and k at position 1 give q.k = {dots[0]:.4f}; shifted by 5 and by 50 "
                       f"positions they give {dots[1]:.4f} and {dots[2]:.4f} (expected the same)")


ROPE = Task("apply_rope", "2.1", ("apply_rope",), (
    Property("returns a tensor shaped like x, (B, H, T, D)",
             "Check what your function returns: one new tensor with x's shape.", _rope_shape),
    Property("position 0 leaves a vector unchanged",
             "What are cos and sin of the angle at position 0?", _rope_zero),
    Property("keeps the length of every vector (it is a rotation)",
             "Does each new pair mix the two elements of its pair with the cos and sin of one angle, "
             "and nothing else?", _rope_length),
    Property("matches the rotation of LLaMA / SmolLM2 (theta 10000)",
             "Check on a small case, one at a time: which elements form a pair, the angle of pair i at "
             "position p, and the signs of the rotation.", _rope_matches(10000.0), central=True),
    Property("uses the theta it is given (SmolLM2 uses 100000)",
             "Where does theta enter your frequencies?", _rope_matches(100000.0)),
    Property("each row of a batch rotates by its own positions",
             "positions is (B, T) and x is (B, H, T, D): does each row's angle come from its own row of "
             "positions, lined up with x's head axis?", _rope_rows),
    Property("q . k depends only on the distance between their positions",
             "This follows from a correct rotation: check the angle of each pair.", _rope_relative),
))


# --- causal_attention and its known bugs --------------------------------------------------------------

def _attention_bug(q, k, v, positions, scale=0.5, softmax_dim=-1, mask="positions", heads="interleave",
                   fill=float("-inf")):
    """Attention with one of the usual slips (the defaults: no slip)."""
    groups = q.shape[1] // k.shape[1]
    if heads == "interleave":
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    else:
        k, v = k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1)
    T, S = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** scale  # (B, H, T, S)
    keys = torch.arange(S)
    if mask == "tril":
        visible = torch.tril(torch.ones(T, S, dtype=torch.bool))[None, None]
    elif mask == "strict":
        visible = keys[None, None, None, :] < positions[:, None, :, None]
    elif mask == "row0":
        visible = keys[None, None, None, :] <= positions[:1, None, :, None]
    else:
        visible = keys[None, None, None, :] <= positions[:, None, :, None]
    scores = scores.masked_fill(~visible, fill)
    return torch.softmax(scores, dim=softmax_dim) @ v


def _case(b, h, h_kv, t, s, d, seed):
    return randn(b, h, t, d, seed=seed), randn(b, h_kv, s, d, seed=seed + 1), randn(b, h_kv, s, d, seed=seed + 2)


def _attention_probes():
    return [(*_case(2, 4, 2, 2, 6, 8, seed=310), torch.tensor([[3, 4], [4, 5]])),
            (*_case(1, 2, 1, 5, 5, 8, seed=320), torch.arange(5)[None])]


def _attention(**slip):
    return lambda q, k, v, p: _attention_bug(q, k, v, p, **slip)


TRIL = ("A mask from T alone (tril(ones(T, S)), or is_causal=True) lines query t up with key t. The keys "
        "are indexed by position and the queries sit at positions: build the mask from the positions, so "
        "that a decode step's one query at position p sees keys 0..p.")
ATTENTION_BUGS = Catalogue("causal_attention", _attention_reference, (
    Bug("attention.no_scale", "attention without the 1 / sqrt(D) scale",
        "The scores q . k are scaled by 1 / sqrt(D) before the softmax, D the head width.", _attention(scale=0.0)),
    Bug("attention.scale_d", "a scale of 1 / D", "The scale is 1 / sqrt(D): the scores' spread grows like "
        "sqrt(D).", _attention(scale=1.0)),
    Bug("attention.softmax_dim", "a softmax over the queries", "Each query's weights over the keys sum to 1: "
        "which dimension of the scores (B, H, T, S) holds the keys?", _attention(softmax_dim=-2)),
    Bug("attention.tril", "a mask built from T alone", TRIL, _attention(mask="tril")),
    Bug("attention.strict", "a mask that hides a query's own key", "A query sees its own position too: key "
        "j is visible from position p when j is at most p.", _attention(mask="strict")),
    Bug("attention.row0", "one mask for every row, from row 0", "Each row has its own positions: build "
        "the mask for every row.", _attention(mask="row0")),
    Bug("attention.zero_fill", "hidden scores set to 0", "A score of 0 still gets weight after the "
        "softmax: a hidden key's score must be minus infinity.", _attention(fill=0.0)),
    Bug("attention.repeat", "the KV heads repeated as a whole stack", "Query heads 0..G-1 share kv head 0, "
        "heads G..2G-1 kv head 1: each kv head is repeated G times in a row, not the stack G times.",
        _attention(heads="repeat")),
    Bug("attention.tril_no_scale", "a mask built from T alone and no 1 / sqrt(D) scale",
        TRIL + " And the scores are scaled by 1 / sqrt(D).", _attention(mask="tril", scale=0.0)),
), _attention_probes)


def _attend(fns, q, k, v, positions):
    originals = [t.clone() for t in (q, k, v, positions)]
    out = call(fns["causal_attention"], q, k, v, positions)
    out = expect_tensor("causal_attention", out, tuple(q.shape))
    if any(not torch.equal(a, b) for a, b in zip(originals, (q, k, v, positions))):
        raise LearnerError("causal_attention changed one of its inputs in place (q, k, v or positions); "
                           "compute new tensors instead")
    return out


def _attention_compare(fns, case, what):
    q, k, v, positions = case
    assert_close(_attend(fns, q, k, v, positions), _attention_reference(q, k, v, positions), what, dims=BHTD,
                 explain=lambda: ATTENTION_BUGS.hint(fns, q, k, v, positions))


GQA_SHAPE_HINT = ("q has H heads but k and v have H_kv: which kv head does each query head read, and does your "
                  "code give it that one before q @ k^T?")


def _att_shape(fns):
    q, k, v = _case(1, 4, 2, 5, 5, 8, seed=10)
    try:
        _attend(fns, q, k, v, torch.arange(5)[None])
    except LearnerError as exc:
        if isinstance(exc.__cause__, RuntimeError) and "size of tensor" in str(exc):
            raise Mismatch(str(exc), GQA_SHAPE_HINT) from exc
        raise


def _att_single(fns):
    q, k, v = _case(1, 1, 1, 1, 1, 4, seed=20)
    _attention_compare(fns, (q, k, v, torch.tensor([[0]])), "the output of one query over one key")


def _att_last_query(fns):
    q, k, v = _case(1, 2, 2, 1, 6, 16, seed=30)
    _attention_compare(fns, (q, k, v, torch.tensor([[5]])), "the output of a query that sees all 6 keys")


def _att_causal(fns):
    q, k, v = _case(1, 2, 2, 5, 5, 8, seed=40)
    positions = torch.arange(5)[None]
    before = _attend(fns, q, k, v, positions)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 4], v2[:, :, 4] = 10.0, -10.0
    after = _attend(fns, q, k2, v2, positions)
    changed = (after[:, :, :4] - before[:, :, :4]).abs().amax(dim=(0, 1, 3))  # (4,)
    if bool((changed > 1e-5).any()):
        first = int((changed > 1e-5).nonzero()[0])
        raise Mismatch(f"changing the key and value at position 4 changed the output of the query at "
                       f"position {first} (expected no change before position 4)",
                       **ATTENTION_BUGS.hint(fns, q, k, v, positions))


def _att_prefill(fns):
    q, k, v = _case(2, 2, 2, 6, 6, 8, seed=50)
    _attention_compare(fns, (q, k, v, torch.arange(6).expand(2, 6)), "a 6-token prefill")


def _att_grouped(fns):
    q, k, v = _case(1, 6, 2, 4, 4, 8, seed=60)
    _attention_compare(fns, (q, k, v, torch.arange(4)[None]), "6 query heads over 2 kv heads")


def _att_decode_rows(fns):
    q, k, v = _case(2, 4, 2, 1, 6, 8, seed=70)
    _attention_compare(fns, (q, k, v, torch.tensor([[2], [5]])),
                       "a decode step with row 0 at position 2 and row 1 at position 5 (6 keys)")


def _att_chunk(fns):
    q, k, v = _case(1, 2, 1, 3, 6, 8, seed=80)
    _attention_compare(fns, (q, k, v, torch.tensor([[3, 4, 5]])), "queries at positions 3, 4, 5 over keys 0..5")


MASK_HINT = ("Which keys may a query at position p see? Print your mask for one row at positions 3, 4, 5 "
             "over 6 keys, and for two rows at positions 2 and 5.")
ATTENTION = Task("causal_attention", "2.1", ("causal_attention",), (
    Property("returns (B, H, T, D), a tensor shaped like q",
             "The output has one vector per query head and query position.", _att_shape),
    Property("one query and one key: the output is that key's value",
             "What is the softmax over a single key?", _att_single),
    Property("a query that sees every key gets softmax(q . k / sqrt(D)) v",
             "Check the scale of the scores and the dimension the softmax runs over.", _att_last_query),
    Property("a query never sees a key after its own position (causal mask)",
             "Print your mask for a 5-token prefill: which keys can the query at position 0 see, and what "
             "score do the hidden ones get before the softmax?", _att_causal),
    Property("a 6-token prefill of two sequences matches",
             "Check the scale, the softmax dimension and the mask one at a time on a small case.",
             _att_prefill, central=True),
    Property("grouped heads: query head h reads kv head h // (H // H_kv)",
             "Print which kv head each query head reads in your code for H = 6, H_kv = 2.", _att_grouped),
    Property("a decode step: rows at different positions in one batch", MASK_HINT, _att_decode_rows,
             central=True),
    Property("a chunk that continues a sequence: queries at positions 3..5 over keys 0..5", MASK_HINT, _att_chunk),
))


# --- both, inside a real model ----------------------------------------------------------------------

@contextmanager
def learner_attention(model, apply_rope, causal_attention):
    """Within the block, every attention layer of ``model`` runs the learner's two functions.

    The model's own code runs; two pieces of each ``Attention`` are swapped: its ``kernel`` becomes
    ``causal_attention`` (which builds its own mask from the positions), and ``apply_rope`` rotates the
    unrotated q and k that ``Attention.qkv`` gives with cos = 1, sin = 0. The positions of each call are
    the ones the model hands its rotary embedding.
    """
    theta, call_positions = model.config.rope_theta, []

    def keep_positions(module, args):  # rotary_emb(positions, dtype), once per forward pass
        call_positions[:] = [args[0]]

    def learner_qkv(attn):
        def qkv(x, cos, sin):
            q, k, v = Attention.qkv(attn, x, torch.ones_like(cos), torch.zeros_like(sin))  # not rotated
            positions = call_positions[0]
            q = expect_tensor("apply_rope", call(apply_rope, q, positions, theta), tuple(q.shape))
            k = expect_tensor("apply_rope", call(apply_rope, k, positions, theta), tuple(k.shape))
            return q, k, v
        return qkv

    def kernel(q, k, v, mask):  # k, v: (B, Hkv, S, D), index = position; the learner masks by position
        out = call(causal_attention, q, k, v, call_positions[0])
        return expect_tensor("causal_attention", out, tuple(q.shape))

    layers = [layer.self_attn for layer in model.model.layers]
    hook = model.model.rotary_emb.register_forward_pre_hook(keep_positions)
    for attn in layers:
        attn.qkv, attn.kernel = learner_qkv(attn), kernel
    try:
        yield model
    finally:
        hook.remove()
        for attn in layers:
            del attn.qkv, attn.kernel  # back to the class's own methods


@torch.inference_mode()
def _same_logits(fns, run, what, dims=("row", "step", "token")):
    """``run()``, the tiny model's logits, with the learner's attention equals it with minillm's."""
    expected = run()
    with learner_attention(tiny_model(), fns["apply_rope"], fns["causal_attention"]):
        got = run()
    assert_close(got, expected, what, atol=1e-3, dims=dims)


def _model_no_cache(fns):
    model, ids = tiny_model(), randint(256, (2, 10), seed=90)
    _same_logits(fns, lambda: model(ids), "the tiny model's logits", dims=("row", "position", "token"))


def _model_cached(fns):
    model = tiny_model()
    ids = randint(256, (1, 12), seed=91)

    def run():
        cache = KVCache(model.config, 1, 16)
        logits = [model(ids[:, :9], cache=cache)[:, -1]]
        for t in range(9, 12):  # three decode steps, one token each
            logits.append(model(ids[:, t:t + 1], cache=cache)[:, -1])
        return torch.stack(logits, 1)  # (1, 4, vocab)

    _same_logits(fns, run, "the logits of a prefill and three cached decode steps")


def _model_ragged(fns):
    model = tiny_model()
    ids = randint(256, (2, 8), seed=92)
    lengths = torch.tensor([5, 8])

    def run():
        cache = KVCache(model.config, 2, 12)
        model(ids, cache=cache)  # row 0's positions 5..7 hold padding, overwritten before they are read
        positions = lengths[:, None].clone()  # (2, 1): each row at its own position
        steps = []
        for step in range(3):
            token = randint(256, (2, 1), seed=93 + step)
            steps.append(model(token, positions, cache)[:, -1])
            positions += 1
        return torch.stack(steps, 1)  # (2, 3, vocab)

    _same_logits(fns, run, "the logits of rows decoding at positions 5 and 8")


MODEL = Task("attention inside the tiny model", "2.1", ("apply_rope", "causal_attention"), (
    Property("the tiny model with your attention gives minillm's logits (no cache)",
             "Pass the checks of apply_rope and causal_attention first; the model calls them with "
             "q: (B, 8, T, 32) and k, v: (B, 2, S, 32).", _model_no_cache, central=True),
    Property("... and with the KV cache: a prefill, then three decode steps",
             "With a cache, k and v hold S keys indexed by position while q holds only the T new "
             "queries: what does your mask give a query at position 10 over 11 keys?", _model_cached,
             central=True),
    Property("... and two rows decoding together at different positions",
             MASK_HINT, _model_ragged, central=True),
))


# --- next_token_probs and its known bugs ---------------------------------------------------------------

def _sampling_bug(logits, temperature, top_k, top_p, overflow=False, keep_crossing=True, renormalize=True,
                  temperature_on="logits"):
    """The filter with one of the usual slips (the defaults: no slip)."""
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits.float() / (temperature if temperature_on == "logits" else 1.0)
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if overflow:  # exp of the raw logits
        e = logits.exp()
        probs = e / e.sum(-1, keepdim=True)
    else:
        probs = torch.softmax(logits, dim=-1)
    if temperature_on == "probs":
        probs = probs / temperature
    if top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        mass = ordered.cumsum(-1) - (ordered if keep_crossing else 0)  # the mass before each token
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, mass >= top_p)
        probs = probs.masked_fill(drop, 0.0)
        if renormalize:
            probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _expected(logits, temperature, top_k, top_p):
    return filtered_probs(logits, SamplingParams(temperature, top_k, top_p))


NUCLEUS = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()  # top-p 0.75 keeps the first two


def _sampling_probes():
    return [(randn(2, 40, seed=330) * 3 + 500, 1.0, 0, 1.0), (randn(2, 40, seed=331) * 3, 0.7, 8, 0.6),
            (NUCLEUS, 1.0, 0, 0.75), (randn(2, 40, seed=332) * 3, 2.0, 0, 1.0)]


def _sampling(**slip):
    return lambda logits, t, k, p: _sampling_bug(logits, t, k, p, **slip)


SAMPLING_BUGS = Catalogue("next_token_probs", _expected, (
    Bug("sampling.overflow", "a softmax of the raw logits (no shift)",
        "exp() of a logit in the hundreds overflows to infinity; shifting every logit of a row by the same "
        "amount (its largest) leaves the softmax unchanged and keeps exp() finite.", _sampling(overflow=True)),
    Bug("sampling.crossing", "a top-p cut that drops the token crossing p",
        "Keep a token while the mass before it is below p: the token that crosses p stays.",
        _sampling(keep_crossing=False)),
    Bug("sampling.no_renormalize", "a top-p cut without renormalizing",
        "After the cut, the kept probabilities no longer sum to 1: divide them by their sum.",
        _sampling(renormalize=False)),
    Bug("sampling.temperature_on_probs", "a temperature that divides the probabilities",
        "The temperature divides the logits, before the softmax.", _sampling(temperature_on="probs")),
), _sampling_probes)


def _probs(fns, logits, temperature, top_k, top_p):
    original = logits.clone()
    out = call(fns["next_token_probs"], logits, temperature, top_k, top_p)
    out = expect_tensor("next_token_probs", out, tuple(logits.shape))
    if not torch.equal(logits, original):
        raise LearnerError("next_token_probs changed the logits passed in; work on a copy")
    return out


def _probs_compare(fns, logits, temperature, top_k, top_p, what):
    assert_close(_probs(fns, logits, temperature, top_k, top_p), _expected(logits, temperature, top_k, top_p),
                 what, atol=1e-5, dims=("row", "token"),
                 explain=lambda: SAMPLING_BUGS.hint(fns, logits, temperature, top_k, top_p))


def _sampling_case(temperature, top_k, top_p, what, seed, rows=2, vocab=50):
    def run(fns):
        _probs_compare(fns, randn(rows, vocab, seed=seed) * 3, temperature, top_k, top_p, what)
    return run


def _large_logits(fns):
    logits = randn(2, 50, seed=108) * 3 + 500  # a model's logits can sit far from 0
    _probs_compare(fns, logits, 1.0, 0, 1.0, "the softmax of logits near 500")


def _temperatures(fns):
    for temperature in (0.5, 2.0):
        _sampling_case(temperature, 0, 1.0, f"the distribution at temperature {temperature}", 105)(fns)


def _probs_valid(fns):
    probs = _probs(fns, randn(3, 20, seed=100) * 3, 1.0, 0, 1.0)
    if bool((probs < 0).any()):
        raise Mismatch(f"a probability is negative ({float(probs.min()):.3g}); expected none")
    sums = probs.sum(-1)
    if bool(((sums - 1).abs() > 1e-4).any()):
        raise Mismatch(f"the rows sum to {[round(float(s), 4) for s in sums]}; expected 1 each")


def _greedy(fns):
    logits = randn(2, 30, seed=101)
    probs = _probs(fns, logits, 0.0, 0, 1.0)
    expected = F.one_hot(logits.argmax(-1), 30).float()
    assert_close(probs, expected, "the distribution at temperature 0", atol=1e-6, dims=("row", "token"))


def _top_p_boundary(fns):
    probs = _probs(fns, NUCLEUS, 1.0, 0, 0.75)
    kept = int((probs > 0).sum())
    if kept != 2:
        raise Mismatch(f"with probabilities 0.5, 0.3, 0.15, 0.05 and top_p=0.75, {kept} token(s) keep some "
                       "probability; expected 2", **SAMPLING_BUGS.hint(fns, NUCLEUS, 1.0, 0, 0.75))
    _probs_compare(fns, NUCLEUS, 1.0, 0, 0.75, "the nucleus of 0.5, 0.3, 0.15, 0.05 at top_p=0.75")


def _rows_apart(fns):
    logits = torch.cat([randn(1, 40, seed=102) * 0.5, randn(1, 40, seed=103) * 8])  # flat and peaked rows
    _probs_compare(fns, logits, 0.9, 10, 0.8, "a batch of one flat and one peaked row")


TOP_P_HINT = ("Sort the probabilities from the most likely and add them up: which tokens are kept, and "
              "is the token that crosses p among them? Do the kept ones sum to 1?")
SAMPLING = Task("next_token_probs", "2.1", ("next_token_probs",), (
    Property("returns probabilities: shape (B, V), none negative, each row summing to 1",
             "How do logits become probabilities, and over which dimension?", _probs_valid),
    Property("temperature 1 with no cuts is the softmax of the logits",
             "With top_k 0 and top_p 1.0 nothing is cut: what is left?",
             _sampling_case(1.0, 0, 1.0, "the softmax", 104)),
    Property("logits in the hundreds give the same softmax (no overflow)",
             "What does exp() give for a logit of 500, and does your softmax change if every logit of a "
             "row moves by the same amount?", _large_logits),
    Property("temperature divides the logits: 0.5 sharpens, 2.0 flattens",
             "Where in your code does the temperature act: on the logits or on the probabilities?",
             _temperatures),
    Property("temperature 0 is greedy: all the mass on the largest logit",
             "Dividing by 0 is not defined: how does your code treat temperature 0?", _greedy),
    Property("top-k keeps the k most likely tokens, renormalized",
             "Which logits does your top-k cut, and what does top_k 0 do?",
             _sampling_case(1.0, 5, 1.0, "the top-5 distribution", 106)),
    Property("top-p keeps the smallest set of most likely tokens whose mass reaches p", TOP_P_HINT,
             _top_p_boundary),
    Property("temperature, then top-k, then top-p, together",
             "Check the order: temperature on the logits, top-k on the logits, softmax, top-p on the "
             "probabilities.", _sampling_case(0.7, 8, 0.6, "the filtered distribution", 107), central=True),
    Property("each row of a batch is filtered on its own",
             "Do your sort, sum and cut run along the last dimension only?", _rows_apart),
))

register(ROPE, ATTENTION, MODEL, SAMPLING)


# --- the payoff ------------------------------------------------------------------------------------------

@torch.inference_mode()
def _generate(model, ids: list[int], max_new_tokens: int, pick, eos_token_id) -> list[int]:
    """Cached generation, the next token chosen by ``pick(logits (1, V)) -> int``."""
    cache = KVCache(model.config, 1, len(ids) + max_new_tokens, model.device, model.dtype)
    logits = model(torch.tensor([ids], device=model.device), cache=cache)[:, -1]  # (1, V)
    out = []
    for _ in range(max_new_tokens):
        token = pick(logits)
        out.append(token)
        if token == eos_token_id or len(out) == max_new_tokens:
            break
        logits = model(torch.tensor([[token]], device=model.device), cache=cache)[:, -1]
    return out


def write_text(model, tokenizer, apply_rope, causal_attention, next_token_probs, prompt: str,
               max_new_tokens: int = 24, temperature: float = 0.8, top_k: int = 50, top_p: float = 0.9,
               seed: int = 0) -> None:
    """The model answers ``prompt`` with the learner's attention (greedy, then sampled with the learner's
    ``next_token_probs``), next to its greedy answer with minillm's attention. Call it once ``ready``
    passes for the three functions."""
    ids, eos = encode_prompt(tokenizer, prompt), tokenizer.eos_token_id
    reference = generate(model, ids, max_new_tokens, eos_token_id=eos)
    generator = torch.Generator(device=model.device).manual_seed(seed)

    def sampled(logits):
        probs = call(next_token_probs, logits.float(), temperature, top_k, top_p)  # (1, V)
        return int(torch.multinomial(probs, 1, generator=generator))

    with learner_attention(model, apply_rope, causal_attention):
        greedy = _generate(model, ids, max_new_tokens, lambda logits: int(logits.argmax(-1)), eos)
        drawn = _generate(model, ids, max_new_tokens, sampled, eos)
    agree = sum(a == b for a, b in zip(greedy, reference))
    show_text("prompt: ", prompt)
    show_text("greedy, minillm's attention: ", tokenizer.decode(reference))
    show_text("greedy, your attention:      ", tokenizer.decode(greedy))
    print(f"    the two agree on {agree} of {len(reference)} tokens")
    print(f"sampled with your attention and next_token_probs (temperature {temperature}, top-k {top_k},\n"
          f"    top-p {top_p}, seed {seed}):")
    show_text("    ", tokenizer.decode(drawn))
