"""The model/cache contract (minillm.cache.CacheView): one path through the model for every cache, a model
blind to the engine, and views that give the naive path's logits."""
import ast
import inspect

import pytest
import torch
from conftest import CAUSAL, SMALL, random_ids, sdpa_spy

import minillm.engine.paged_cache as paged_cache
import minillm.model as model_module
from minillm import KVCache
from minillm.cache import CacheView, NoCache
from minillm.engine import MixedStepView, PagedCacheView, PagedKVPool
from minillm.fast.compiled import StaticCacheView, compile_step, decode_step

ATOL = {"rtol": 0, "atol": 1e-5}
# Compiling imports parts of torch that still use torch.jit.script_method (torch's warning, not ours).
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")


def imported_modules(module) -> set[str]:
    """Every module ``module`` imports (relative imports as written, e.g. "..cache")."""
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


CONTRACT = {"default_positions", "begin", "attend", "end"}


class Watched:
    """A view that hands the model the four ``CacheView`` methods of ``inner`` and nothing else, noting every
    attribute the model asks it for (``hasattr`` included)."""

    def __init__(self, inner):
        self.inner, self.asked = inner, set()

    def __getattr__(self, name):  # reached for every name the instance itself does not hold
        self.asked.add(name)
        if name not in CONTRACT:
            raise AttributeError(name)
        return getattr(self.inner, name)


def test_the_model_asks_no_cache_what_kind_it_is(small_model):
    """Through a view that is no known class and answers only the contract, every kind of cache gives the same
    logits as itself: the model neither asks for more nor branches on the class."""
    ids = random_ids(SMALL.vocab_size, (1, 5), seed=8)
    for make in (lambda: KVCache(SMALL, 1, 8), lambda: PagedCacheView(PagedKVPool(SMALL, 4, 4), [[2, 0]], [0])):
        plain, inner = make(), make()
        watched = Watched(inner)
        expected = [small_model(ids[:, :3], cache=plain), small_model(ids[:, 3:], cache=plain)]
        got = [small_model(ids[:, :3], cache=watched), small_model(ids[:, 3:], cache=watched)]
        for g, e in zip(got, expected):
            assert torch.equal(g, e)
        assert watched.asked == CONTRACT  # positions by default: default_positions was asked too
    banned = ("engine", "serving", "book", "labs")
    assert not [m for m in imported_modules(model_module) if any(b in m.split(".") for b in banned)]


def test_the_engine_builds_its_masks_from_the_cache_module_not_the_model():
    imports = imported_modules(paged_cache)
    assert "..cache" in imports and not [m for m in imports if m.endswith("model")]


def test_every_view_implements_the_protocol():
    pool = PagedKVPool(SMALL, 4, 4)
    view = PagedCacheView(pool, [[0, 1]], [0])
    cache = KVCache(SMALL, 1, 8)
    for obj in (cache, NoCache(), view, MixedStepView([(1, 1, view)]), StaticCacheView(cache.k, cache.v)):
        assert isinstance(obj, CacheView), type(obj).__name__


def paged_prefill(model, ids, chunks, block_size=4):
    """ids (1, T) prefilled chunk by chunk through PagedCacheViews -> the logits (1, T, V) and the pool."""
    T = ids.shape[1]
    pool = PagedKVPool(SMALL, num_blocks=8, block_size=block_size)
    table = [5, 2, 7, 0, 3, 6][: -(-T // block_size)]  # scattered blocks
    logits, start = [], 0
    for n in chunks:
        view = PagedCacheView(pool, [table], [start])
        logits.append(model(ids[:, start:start + n], cache=view))  # default positions: the view's lengths
        start += n
    return torch.cat(logits, 1), pool, table


def test_every_kind_of_view_gives_the_naive_logits(small_model):
    ids = random_ids(SMALL.vocab_size, (1, 11), seed=3)
    naive = small_model(ids)  # (1, 11, V), no cache
    # contiguous cache: a prefill of 6, then 5 decode steps
    cache = KVCache(SMALL, 1, 16)
    cached = [small_model(ids[:, :6], cache=cache)] + [small_model(ids[:, t:t + 1], cache=cache)
                                                       for t in range(6, 11)]
    torch.testing.assert_close(torch.cat(cached, 1), naive, **ATOL)
    # paged: chunks of 4, 4, 3 through scattered blocks
    paged, pool, table = paged_prefill(small_model, ids, [4, 4, 3])
    torch.testing.assert_close(paged, naive, **ATOL)
    # mixed: a decode row of another sequence and this sequence's last 3 tokens, in one row of tokens
    other = random_ids(SMALL.vocab_size, (1, 5), seed=4)
    other_pool = PagedKVPool(SMALL, num_blocks=4, block_size=4)
    small_model(other[:, :4], cache=PagedCacheView(other_pool, [[1, 3]], [0]))
    pool_b = PagedKVPool(SMALL, num_blocks=8, block_size=4)
    small_model(ids[:, :8], cache=PagedCacheView(pool_b, [table], [0]))
    parts = [(1, 1, PagedCacheView(other_pool, [[1, 3]], [4])), (1, 3, PagedCacheView(pool_b, [table], [8]))]
    row = torch.cat([other[:, 4:], ids[:, 8:]], 1)  # (1, 4)
    positions = torch.tensor([[4, 8, 9, 10]])
    mixed = small_model(row, positions, MixedStepView(parts))  # (1, 4, V)
    torch.testing.assert_close(mixed[:, 1:], naive[:, 8:], **ATOL)
    torch.testing.assert_close(mixed[:, :1], small_model(other)[:, 4:], **ATOL)
    assert [view.lengths.tolist() for _, _, view in parts] == [[5], [11]]  # end ran for every part
    # static: every call attends all 16 positions, through model.forward with explicit positions
    static = KVCache(SMALL, 1, 16)
    view = StaticCacheView(static.k, static.v)
    got = [small_model(ids[:, :6], torch.arange(6)[None], view)]
    got += [small_model(ids[:, t:t + 1], torch.tensor([[t]]), view) for t in range(6, 11)]
    torch.testing.assert_close(torch.cat(got, 1), naive, **ATOL)


def test_a_paged_prompt_from_position_0_skips_the_masked_half(small_model, monkeypatch):
    """The engine's first chunk of a prompt runs the causal kernel; later chunks keep their mask."""
    calls = sdpa_spy(monkeypatch)
    ids = random_ids(SMALL.vocab_size, (1, 11), seed=3)
    paged, _, _ = paged_prefill(small_model, ids, [4, 4, 3])
    n = SMALL.n_layers
    assert calls == CAUSAL * n + [(False, "tensor")] * 2 * n
    try:
        eager = small_model.set_attention_impl("eager")(ids)  # explicit scores, mask and softmax
    finally:
        small_model.set_attention_impl("sdpa")
    torch.testing.assert_close(paged, eager, **ATOL)


@pytest.mark.slow  # torch.compile
def test_the_compiled_step_gives_the_models_logits(small_model):
    """decode_step, eager and compiled, runs the model's own layers: the logits of model(...) with a KVCache."""
    ids = random_ids(SMALL.vocab_size, (2, 10), seed=5)
    reference, static = KVCache(SMALL, 2, 12), KVCache(SMALL, 2, 12)
    small_model(ids[:, :6], cache=reference)
    small_model(ids[:, :6], cache=static)
    compiled = compile_step(torch.device("cpu"), "compile")
    position = torch.tensor([6, 6])
    with torch.inference_mode():
        for t in range(6, 10):
            token = ids[:, t:t + 1]
            expected = small_model(token, cache=reference)[:, 0]  # (2, V)
            torch.testing.assert_close(decode_step(small_model, static.k, static.v, token, position), expected,
                                       **ATOL)
            position = position + 1
        clone = KVCache(SMALL, 2, 12)
        small_model(ids[:, :9], cache=clone)
        logits = compiled(small_model, clone.k, clone.v, ids[:, 9:10], torch.tensor([9, 9]))
    torch.testing.assert_close(logits, expected, **ATOL)
