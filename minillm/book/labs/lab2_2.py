"""Lab 2.2: a KV cache written by position and read for rows of different lengths, its bytes, and the same
cache in pages: a write and a read through block tables, and the blocks handed out, with eviction, as
rows grow.

The learner writes ``write_kv``, ``read_kv``, ``kv_cache_bytes``, ``write_paged``, ``read_paged`` and
``make_room``. ``LearnerCache`` runs the first two inside any ``CausalLM`` (behind the model's cache
contract); ``paged_generate`` runs the last three as a small paged engine that evicts rows when its pool
runs out and recomputes them later. ``compare_generation`` and ``pool_map`` are the lab's payoff. Each
function's catalogue (:mod:`.diagnosis`) holds the bugs learners write, as code.
"""
from __future__ import annotations

import math

import torch

from ...analysis.arithmetic import kv_cache_bytes as reference_kv_bytes
from ...cache import KVCache, attention_mask
from ...config import ModelConfig, get_config
from ...generate import generate
from .cases import assert_close, encode_prompt, randint, randn, show_text, tiny_model
from .checker import (
    LearnerError,
    Mismatch,
    Property,
    Task,
    call,
    expect_number,
    expect_tensor,
    ready,
    register,
    wrong_value,
)
from .diagnosis import Bug, Catalogue

BHLD = ("row", "kv head", "position", "element")


# --- write_kv ----------------------------------------------------------------------------------------

def _write_reference(cache, new, positions, shift=0, row0=False, order=False, copy=False):
    """Where each entry goes, one by one; the flags are the usual slips (a copy: the cache unchanged)."""
    out = cache.clone()
    B, _, T, _ = new.shape
    for b in range(B):
        for t in range(T):
            p = t if order else int(positions[0 if row0 else b, t])
            out[b, :, p + shift] = new[b, :, t]
    return cache.clone() if copy else out


def _observe_write(function, cache, new, positions):
    """The cache after ``function`` wrote into a copy of it."""
    target = cache.clone()
    function(target, new.clone(), positions.clone())
    return target


def _written(slip):
    def write(cache, new, positions):
        cache.copy_(_write_reference(cache, new, positions, **slip))
    return write


def _write_probes():
    return [(randn(2, 2, 10, 3, seed=400), randn(2, 2, 3, 3, seed=401), torch.tensor([[4, 5, 6], [0, 1, 2]])),
            (randn(3, 1, 10, 2, seed=402), randn(3, 1, 1, 2, seed=403), torch.tensor([[5], [0], [8]]))]


WRITE_BUGS = Catalogue("write_kv", _written({}), (
    Bug("write_kv.order", "writing the t-th new entry at index t", "Positions say where each entry goes.",
        _written({"order": True})),
    Bug("write_kv.row0", "every row written at row 0's positions", "Each row writes at its own positions.",
        _written({"row0": True})),
    Bug("write_kv.shift", "writing at position + 1", "Positions count from 0: position p is index p.",
        _written({"shift": 1})),
    Bug("write_kv.copy", "a write into a new tensor", "The model keeps the tensor it passes you: write into "
        "it in place; a tensor you return is never read.", _written({"copy": True})),
), _write_probes, observe=_observe_write)


def _write(fns, cache, new, positions):
    """Run the learner's write_kv on a copy of ``cache``; the copy after the call."""
    target = cache.clone()
    returned = call(fns["write_kv"], target, new.clone(), positions.clone())
    if torch.equal(target, cache):
        extra = " (it returned a new tensor instead)" if isinstance(returned, torch.Tensor) else ""
        raise Mismatch("write_kv left the cache passed in unchanged" + extra + "; expected the new entries in "
                       "it", **WRITE_BUGS.hint(fns, cache, new, positions))
    return target


def _write_case(b, t, positions, what, seed):
    def run(fns):
        cache, new = randn(b, 2, 10, 4, seed=seed), randn(b, 2, t, 4, seed=seed + 1)
        positions_t = torch.tensor(positions)
        assert_close(_write(fns, cache, new, positions_t), _write_reference(cache, new, positions_t), what,
                     atol=0, dims=BHLD, explain=lambda: WRITE_BUGS.hint(fns, cache, new, positions_t))
    return run


def _write_untouched(fns):
    cache, new = randn(2, 2, 10, 4, seed=120), randn(2, 2, 2, 4, seed=121)
    positions = torch.tensor([[3, 4], [7, 8]])
    got = _write(fns, cache, new, positions)
    keep = torch.ones(2, 10, dtype=torch.bool)
    keep[0, 3:5], keep[1, 7:9] = False, False
    changed = ((got != cache).any(dim=(1, 3)) & keep).nonzero()
    if len(changed):
        row, position = (int(i) for i in changed[0])
        raise Mismatch(f"writing row 0 at positions 3, 4 and row 1 at 7, 8 also changed row {row} at "
                       f"position {position} ({len(changed)} position(s) in all); expected only those four")


WRITE_HINT = "Which index of the cache does new[b, :, t] go to? Check it for two rows at different positions."
WRITE = Task("write_kv", "2.2", ("write_kv",), (
    Property("a prefill writes T entries at positions 0..T-1", WRITE_HINT,
             _write_case(1, 3, [[0, 1, 2]], "the cache after a 3-token prefill", 110)),
    Property("a decode step: each row writes one entry at its own position",
             "positions is (B, T): which row of it does row b use?",
             _write_case(3, 1, [[5], [0], [2]], "the cache after rows write at positions 5, 0, 2", 112)),
    Property("a chunk that continues a row writes at positions 4, 5, 6",
             "Where does the t-th new entry go when the positions do not start at 0?",
             _write_case(1, 3, [[4, 5, 6]], "the cache after a chunk at positions 4..6", 114)),
    Property("rows at different positions in one multi-token write", WRITE_HINT,
             _write_case(2, 3, [[0, 1, 2], [5, 6, 7]], "the cache after rows write 0..2 and 5..7", 116),
             central=True),
    Property("leaves every other entry of the cache unchanged",
             "Does your write touch only the positions given?", _write_untouched),
))


# --- read_kv -------------------------------------------------------------------------------------------

def _read_reference(cache, lengths, valid_le=False):
    S = int(lengths.max())
    positions = torch.arange(S)
    valid = positions[None, :] <= lengths[:, None] if valid_le else positions[None, :] < lengths[:, None]
    return cache[:, :, :S], valid


def _observe_read(function, cache, lengths):
    kv, valid = function(cache.clone(), lengths.clone())
    return kv, valid


READ_BUGS = Catalogue("read_kv", _read_reference, (
    Bug("read_kv.valid_le", "valid with j <= length", "A row of length n holds positions 0..n-1.",
        lambda c, n: _read_reference(c, n, valid_le=True)),
), lambda: [(randn(3, 2, 12, 4, seed=410), torch.tensor([4, 9, 6]))], observe=_observe_read)


def _read(fns, cache, lengths):
    out = call(fns["read_kv"], cache.clone(), lengths.clone())
    if not (isinstance(out, tuple) and len(out) == 2):
        raise wrong_value("read_kv", out, "a pair (kv, valid)")
    B, H, _, D = cache.shape
    S = int(lengths.max())
    kv = expect_tensor("read_kv", out[0], (B, H, S, D), what="returned as kv")
    valid = _expect_valid("read_kv", out[1], (B, S))
    return kv, valid


def _expect_valid(name, valid, shape):
    valid = expect_tensor(name, valid, shape, floating=False, what="returned as valid")
    if valid.dtype != torch.bool:
        raise LearnerError(f"{name} returned valid as a {str(valid.dtype).removeprefix('torch.')} tensor; "
                           "expected booleans (torch.bool)")
    return valid


def _read_shapes(fns):
    _read(fns, randn(3, 2, 12, 4, seed=130), torch.tensor([4, 9, 6]))


def _read_values(fns):
    cache, lengths = randn(3, 2, 12, 4, seed=131), torch.tensor([4, 9, 6])
    kv, _ = _read(fns, cache, lengths)
    assert_close(kv, cache[:, :, :9], "kv", atol=0, dims=BHLD)


def _read_valid(fns):
    cache, lengths = randn(3, 2, 12, 4, seed=132), torch.tensor([4, 9, 6])
    _, valid = _read(fns, cache, lengths)
    wrong = (valid != _read_reference(cache, lengths)[1]).nonzero()
    if len(wrong):
        row, position = (int(i) for i in wrong[0])
        raise Mismatch(f"for rows of lengths 4, 9, 6, valid[{row}, {position}] is {bool(valid[row, position])}; "
                       f"expected {not bool(valid[row, position])} ({len(wrong)} wrong entries)",
                       **READ_BUGS.hint(fns, cache, lengths))


def _read_edges(fns):
    for lengths in (torch.tensor([5, 5]), torch.tensor([0, 3])):
        cache = randn(2, 1, 8, 4, seed=133)
        kv, valid = _read(fns, cache, lengths)
        S = int(lengths.max())
        assert_close(kv, cache[:, :, :S], f"kv for lengths {lengths.tolist()}", atol=0, dims=BHLD)
        expected = _read_reference(cache, lengths)[1]
        if not torch.equal(valid, expected):
            raise Mismatch(f"for lengths {lengths.tolist()}, valid is {valid.int().tolist()}; expected "
                           f"{expected.int().tolist()}")


READ = Task("read_kv", "2.2", ("read_kv",), (
    Property("returns (kv, valid): kv (B, H_kv, S, D) with S the longest row, valid (B, S) booleans",
             "What is S for lengths 4, 9, 6, and is it a Python int?", _read_shapes),
    Property("kv holds each row's first S positions",
             "Which part of the position axis (dim 2) does every row need?", _read_values),
    Property("valid[b, j] is True exactly when j < lengths[b]",
             "Which positions does a row of length n hold? Compare a (1, S) row of positions with a (B, 1) "
             "column of lengths.", _read_valid, central=True),
    Property("rows of equal length, and a row of length 0",
             "What should valid say for two full rows, and for an empty one?", _read_edges),
))


# --- both, inside a real model -------------------------------------------------------------------------

class LearnerCache(KVCache):
    """minillm's ``KVCache`` whose writes and reads are the learner's ``write_kv`` and ``read_kv``: each
    layer's ``attend`` writes this call's keys and values, reads every row up to its new length, and
    hands them to the model's attention with the call's causal mask."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, write_kv, read_kv,
                 device="cpu", dtype=torch.float32):
        super().__init__(config, batch_size, max_len, device, dtype)
        self.write_kv, self.read_kv = write_kv, read_kv
        self._positions = self._keys_mask = None

    def begin(self, positions: torch.Tensor) -> None:
        n_keys = self.check_room(positions) + 1  # S: the longest row once this call's tokens are in
        self._positions = positions
        self._keys_mask = attention_mask(positions, n_keys, cached=True)

    def attend(self, layer, q, k, v, kernel):
        """Write k, v (B, Hkv, T, D) at this call's positions (B, T); read every row up to its length."""
        positions = self._positions
        call(self.write_kv, self.k[layer], k, positions)
        call(self.write_kv, self.v[layer], v, positions)
        lengths = positions[:, -1] + 1  # (B,): each row's length once this call's tokens are in
        B, H, _, D = k.shape
        S = int(lengths.max())
        keys, _ = call(self.read_kv, self.k[layer], lengths)
        values, _ = call(self.read_kv, self.v[layer], lengths)
        expect_tensor("read_kv", keys, (B, H, S, D), what="returned as kv")
        expect_tensor("read_kv", values, (B, H, S, D), what="returned as kv")
        return kernel(q, keys, values, self._keys_mask)


@torch.inference_mode()
def batched_generate(model, prompts: list[list[int]], max_new_tokens: int, write_kv, read_kv,
                     eos_token_id: int | None = None) -> tuple[list[list[int]], LearnerCache]:
    """Greedy generation of every prompt at once through a LearnerCache; each row's tokens end at its EOS.

    The prompts are padded to the longest in one prefill call; a short row's padding lands at positions
    that its own decode steps overwrite before reading them. Then each decode step feeds every row at its
    own position, so the rows read caches of different lengths.
    """
    device, lengths = model.device, [len(p) for p in prompts]
    width = max(lengths)
    cache = LearnerCache(model.config, len(prompts), width + max_new_tokens, write_kv, read_kv, device,
                         model.dtype)
    ids = torch.tensor([p + [p[-1]] * (width - len(p)) for p in prompts], device=device)  # (B, width)
    logits = model(ids, cache=cache)  # (B, width, V)
    rows = torch.arange(len(prompts), device=device)
    position = torch.tensor(lengths, device=device)  # (B,): where each row's next token goes
    token = logits[rows, position - 1].argmax(-1)  # (B,)
    out = [[] for _ in prompts]
    for step in range(max_new_tokens):
        for b in range(len(prompts)):
            out[b].append(int(token[b]))
        if step == max_new_tokens - 1:
            break
        token = model(token[:, None], position[:, None], cache)[:, -1].argmax(-1)
        position = position + 1
    if eos_token_id is not None:
        out = [row[:row.index(eos_token_id) + 1] if eos_token_id in row else row for row in out]
    return out, cache


def _first_difference(got: list[int], expected: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))


def _model_one(fns):
    model, prompt = tiny_model(), randint(256, (10,), seed=140).tolist()
    got, _ = batched_generate(model, [prompt], 8, fns["write_kv"], fns["read_kv"])
    expected = generate(model, prompt, 8, use_cache=False)
    if got[0] != expected:
        raise Mismatch(f"cached and naive generation agree on the first {_first_difference(got[0], expected)} "
                       "of 8 tokens only; expected all 8")


def _model_rows(fns):
    model = tiny_model()
    prompts = [randint(256, (n,), seed=141 + n).tolist() for n in (3, 11, 7)]
    got, _ = batched_generate(model, prompts, 6, fns["write_kv"], fns["read_kv"])
    for b, prompt in enumerate(prompts):
        expected = generate(model, prompt, 6, use_cache=False)
        if got[b] != expected:
            raise Mismatch(f"row {b} (a {len(prompt)}-token prompt): cached and naive generation agree on the "
                           f"first {_first_difference(got[b], expected)} of 6 tokens only; expected all 6")


MODEL = Task("your cache inside the tiny model", "2.2", ("write_kv", "read_kv"), (
    Property("cached generation of one sequence equals naive generation",
             "Pass the checks of write_kv and read_kv first.", _model_one, central=True),
    Property("three prompts of 3, 11 and 7 tokens, cached in one batch, equal naive generation row by row",
             "In a decode step every row writes at its own position and reads up to its own length: does "
             "yours?", _model_rows, central=True),
))


# --- kv_cache_bytes ---------------------------------------------------------------------------------------

DTYPES = {1: "int8", 2: "float16", 4: "float32"}


def _bytes(fns, layers, kv_heads, head_dim, seq_len, batch, elem):
    return expect_number("kv_cache_bytes", call(fns["kv_cache_bytes"], layers, kv_heads, head_dim, seq_len,
                                                batch, elem), integer=True)


def _expected_bytes(layers, kv_heads, head_dim, seq_len, batch, elem):
    config = ModelConfig(vocab_size=8, d_model=kv_heads * head_dim, n_layers=layers, n_heads=kv_heads,
                         n_kv_heads=kv_heads, head_dim=head_dim, d_ff=8, max_seq_len=seq_len)
    return reference_kv_bytes(config, seq_len, batch, DTYPES[elem])


BYTES_BUGS = Catalogue("kv_cache_bytes", _expected_bytes, (
    Bug("kv_cache_bytes.no_two", "a count without the factor 2", "The cache holds K and V: two tensors "
        "per layer.", lambda layers, h, d, s, b, e: layers * h * d * s * b * e),
    Bug("kv_cache_bytes.elements", "a count of elements", "The formula counts bytes: each element takes "
        "bytes_per_element.", lambda layers, h, d, s, b, e: 2 * layers * h * d * s * b),
), lambda: [(3, 2, 8, 10, 2, 2), (2, 4, 16, 5, 3, 4)])


def _bytes_case(args, what):
    def run(fns):
        got, expected = _bytes(fns, *args), _expected_bytes(*args)
        if got != expected:
            raise Mismatch(f"{what}: got {got:,} bytes, expected {expected:,}", **BYTES_BUGS.hint(fns, *args))
    return run


def _bytes_type(fns):
    value = call(fns["kv_cache_bytes"], 2, 2, 8, 16, 1, 2)
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_value("kv_cache_bytes", value, "an int (a number of bytes)")


def _bytes_linear(fns):
    one = _bytes(fns, 24, 4, 64, 1000, 1, 2)
    for batch, seq in ((3, 1000), (1, 3000), (4, 500)):
        got = _bytes(fns, 24, 4, 64, seq, batch, 2)
        if got != one * batch * seq // 1000:
            raise Mismatch(f"1 sequence of 1000 tokens takes {one:,} bytes, but {batch} of {seq} take {got:,}; "
                           f"expected {one * batch * seq // 1000:,}")


def _bytes_allocated(fns):
    layers, batch, kv_heads, max_len, head_dim = 3, 2, 2, 24, 16
    for dtype in (torch.float32, torch.float16):
        tensors = [torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype) for _ in range(2 * layers)]
        held = sum(t.numel() * t.element_size() for t in tensors)
        args = (layers, kv_heads, head_dim, max_len, batch, dtype.itemsize)
        got = _bytes(fns, *args)
        if got != held:
            raise Mismatch(f"a {str(dtype).removeprefix('torch.')} cache of {layers} layers holds {held:,} bytes "
                           f"in its K and V tensors; kv_cache_bytes says {got:,}, expected {held:,}",
                           **BYTES_BUGS.hint(fns, *args))


FORMULA_HINT = "Which factors does your product have? Compare it, factor by factor, with the formula above the task."
FORMULA = Task("kv_cache_bytes", "2.2", ("kv_cache_bytes",), (
    Property("returns an int (a number of bytes)",
             "Does any division or float creep into your product?", _bytes_type),
    Property("LLaMA-7B (32 layers, 32 KV heads, head_dim 128), float16, 2048 tokens",
             FORMULA_HINT, _bytes_case((32, 32, 128, 2048, 1, 2), "LLaMA-7B, one 2048-token sequence")),
    Property("grouped KV heads: Llama-2-70B keeps 8 KV heads for its 64 query heads",
             "Which heads are stored in the cache?",
             _bytes_case((80, 8, 128, 4096, 1, 2), "Llama-2-70B, one 4096-token sequence")),
    Property("grows in proportion to the batch and to the sequence length",
             "Does each sequence keep its own K and V for every one of its tokens in your count?", _bytes_linear),
    Property("counts the bytes per element (float32 4, float16 2, int8 1)", FORMULA_HINT,
             _bytes_case((30, 3, 64, 512, 4, 4), "SmolLM2 in float32, 4 sequences of 512 tokens")),
    Property("equals the bytes of an allocated cache (K and V tensors of every layer)", FORMULA_HINT,
             _bytes_allocated, central=True),
))


# --- write_paged -----------------------------------------------------------------------------------------

POOL = ("block", "kv head", "slot", "element")


def _paged_reference(pool, block_table, new, positions, table=True, own_row=True, per_position=True,
                     swapped=False, copy=False):
    """Where each entry goes, one by one; the flags switch off a part of the rule (the usual slips)."""
    out, block_size = pool.clone(), pool.shape[2]
    for b in range(new.shape[0]):
        for t in range(new.shape[2]):
            p = int(positions[b, t])
            logical = (int(positions[b, 0]) if not per_position else p) // block_size
            at = p % block_size
            if swapped:
                logical, at = p % block_size, p // block_size
            physical = int(block_table[b if own_row else 0, logical]) if table else logical
            out[physical, :, at] = new[b, :, t]
    return pool.clone() if copy else out


def _paged_written(**slip):
    def write(pool, block_table, new, positions):
        pool.copy_(_paged_reference(pool, block_table, new, positions, **slip))
    return write


def _observe_paged(function, pool, block_table, new, positions):
    target = pool.clone()
    function(target, block_table.clone(), new.clone(), positions.clone())
    return target


def _paged_probes():
    return [(randn(12, 1, 4, 2, seed=420), torch.tensor([[6, 3, 0], [1, 8, 11]]), randn(2, 1, 3, 2, seed=421),
             torch.tensor([[2, 3, 4], [5, 6, 7]])),
            (randn(12, 1, 4, 2, seed=422), torch.tensor([[9, 2, 5], [4, 10, 7], [3, 1, 0]]),
             randn(3, 1, 1, 2, seed=423), torch.tensor([[9], [2], [5]]))]


PAGED_BUGS = Catalogue("write_paged", _paged_written(), (
    Bug("write_paged.table", "writing to logical block p // block_size itself",
        "A row's logical block i lives in the physical block its block table names.", _paged_written(table=False)),
    Bug("write_paged.row0", "every row written through row 0's block table",
        "Each row has its own block table.", _paged_written(own_row=False)),
    Bug("write_paged.first_block", "every entry written to the block of the first position",
        "A write of several tokens can cross into the row's next block: each position has its own block.",
        _paged_written(per_position=False)),
    Bug("write_paged.swapped", "block and slot swapped",
        "Block p // block_size, slot p % block_size: which is which in your code?", _paged_written(swapped=True)),
    Bug("write_paged.copy", "a write into a new tensor",
        "The engine keeps the pool it passes you: write into it in place.", _paged_written(copy=True)),
), _paged_probes, observe=_observe_paged)


def _write_paged(fns, pool, block_table, new, positions):
    target = pool.clone()
    returned = call(fns["write_paged"], target, block_table.clone(), new.clone(), positions.clone())
    if torch.equal(target, pool):
        extra = " (it returned a new tensor instead)" if isinstance(returned, torch.Tensor) else ""
        raise Mismatch("write_paged left the pool passed in unchanged" + extra + "; expected the new entries "
                       "in it", **PAGED_BUGS.hint(fns, pool, block_table, new, positions))
    return target


def _paged_case(tables, positions, what, seed):
    """Blocks of 4 slots in a pool of 12; ``tables``: each row's physical blocks, in logical order."""
    def run(fns):
        block_table, positions_t = torch.tensor(tables), torch.tensor(positions)
        B, T = positions_t.shape
        pool, new = randn(12, 2, 4, 3, seed=seed), randn(B, 2, T, 3, seed=seed + 1)
        try:
            got = _write_paged(fns, pool, block_table, new, positions_t)
        except LearnerError as error:  # a position used as a slot runs past the block
            if isinstance(error.__cause__, IndexError):
                raise Mismatch(str(error), **PAGED_BUGS.hint(fns, pool, block_table, new, positions_t)) from error
            raise
        assert_close(got, _paged_reference(pool, block_table, new, positions_t), what, atol=0, dims=POOL,
                     explain=lambda: PAGED_BUGS.hint(fns, pool, block_table, new, positions_t))
    return run


def _paged_untouched(fns):
    block_table, positions = torch.tensor([[7, 2], [5, 9]]), torch.tensor([[3, 4], [0, 1]])
    pool, new = randn(12, 2, 4, 3, seed=160), randn(2, 2, 2, 3, seed=161)
    got = _write_paged(fns, pool, block_table, new, positions)
    written = {(7, 3), (2, 0), (5, 0), (5, 1)}  # (block, slot)
    changed = {(int(b), int(s)) for b, s in ((got != pool).any(dim=(1, 3))).nonzero()}
    if changed - written:
        block, slot = sorted(changed - written)[0]
        raise Mismatch(f"writing 4 entries also changed block {block}, slot {slot} "
                       f"({len(changed - written)} slot(s) in all); expected only those 4 slots")


PAGED_HINT = ("Work out by hand where position 5 of a row with block table [6, 3, 0] goes (blocks of 4), "
              "then print where your code puts it.")
PAGED = Task("write_paged", "2.2", ("write_paged",), (
    Property("a prefill into one row's first block", PAGED_HINT,
             _paged_case([[6, 3, 0]], [[0, 1, 2]], "the pool after a 3-token prefill into block 6", 150)),
    Property("the row's block table decides the physical block",
             "Which physical block holds a row's logical block 1?",
             _paged_case([[6, 3, 0]], [[4, 5]], "the pool after writing positions 4, 5 (logical block 1)", 152)),
    Property("a write that crosses into the row's next block",
             "Does every position of a write get its own block, or only the first?",
             _paged_case([[6, 3, 0]], [[2, 3, 4, 5]], "the pool after writing positions 2..5", 154)),
    Property("rows with their own block tables, at their own positions",
             "Which row of block_table does row b read?",
             _paged_case([[6, 3, 0], [1, 8, 11], [10, 4, 2]], [[9], [2], [5]],
                         "the pool after rows write at positions 9, 2, 5", 156), central=True),
    Property("the slot inside a block is position % block_size", PAGED_HINT,
             _paged_case([[6, 3, 0], [1, 8, 11]], [[1, 2], [6, 7]], "the pool after rows write 1..2 and 6..7",
                         158)),
    Property("writes in place and leaves every other slot of the pool unchanged",
             "Does your write touch only the slots the positions name, in the pool you were given?",
             _paged_untouched),
))


# --- read_paged --------------------------------------------------------------------------------------------

def _read_paged_reference(pool, block_table, lengths, table=True, own_row=True, swapped=False, valid_le=False):
    """Every row's first S positions through its block table, one by one; the flags are the usual slips."""
    block_size, S = pool.shape[2], int(lengths.max())
    B = block_table.shape[0]
    kv = torch.zeros(B, pool.shape[1], S, pool.shape[3], dtype=pool.dtype)  # (B, H_kv, S, D)
    for b in range(B):
        for j in range(S):
            logical, at = (j % block_size, j // block_size) if swapped else (j // block_size, j % block_size)
            if logical >= block_table.shape[1]:
                continue
            kv[b, :, j] = pool[int(block_table[b if own_row else 0, logical]) if table else logical, :, at]
    positions = torch.arange(S)
    valid = positions[None, :] <= lengths[:, None] if valid_le else positions[None, :] < lengths[:, None]
    return kv, valid


def _observe_read_paged(function, pool, block_table, lengths):
    """(kv where valid, zeros elsewhere, valid): what lies past a row's length does not matter."""
    kv, valid = function(pool.clone(), block_table.clone(), lengths.clone())
    truth = torch.arange(kv.shape[2])[None, :] < lengths[:, None]  # (B, S)
    return kv * truth[:, None, :, None], valid


def _read_paged_probes():
    return [(randn(12, 1, 4, 2, seed=430), torch.tensor([[6, 3, 0], [1, 8, 11], [10, 4, 2]]),
             torch.tensor([9, 3, 12])),
            (randn(10, 2, 2, 2, seed=431), torch.tensor([[7, 2, 5], [4, 9, 0]]), torch.tensor([5, 2]))]


READ_PAGED_BUGS = Catalogue("read_paged", _read_paged_reference, (
    Bug("read_paged.table", "reading logical block j // block_size itself",
        "A row's logical block i lives in the physical block its block table names.",
        lambda pool, table, n: _read_paged_reference(pool, table, n, table=False)),
    Bug("read_paged.row0", "every row read through row 0's block table", "Each row has its own block table.",
        lambda pool, table, n: _read_paged_reference(pool, table, n, own_row=False)),
    Bug("read_paged.swapped", "block and slot swapped",
        "Position j sits in logical block j // block_size, at slot j % block_size.",
        lambda pool, table, n: _read_paged_reference(pool, table, n, swapped=True)),
    Bug("read_paged.valid_le", "valid with j <= length", "A row of length n holds positions 0..n-1.",
        lambda pool, table, n: _read_paged_reference(pool, table, n, valid_le=True)),
), _read_paged_probes, observe=_observe_read_paged)


def _read_paged(fns, pool, block_table, lengths):
    out = call(fns["read_paged"], pool.clone(), block_table.clone(), lengths.clone())
    if not (isinstance(out, tuple) and len(out) == 2):
        raise wrong_value("read_paged", out, "a pair (kv, valid)")
    B, S = block_table.shape[0], int(lengths.max())
    kv = expect_tensor("read_paged", out[0], (B, pool.shape[1], S, pool.shape[3]), what="returned as kv")
    return kv, _expect_valid("read_paged", out[1], (B, S))


def _read_paged_case(tables, lengths, what, seed, check_valid=False):
    def run(fns):
        table, lengths_t = torch.tensor(tables), torch.tensor(lengths)
        pool = randn(12, 2, 4, 3, seed=seed)
        kv, valid = _read_paged(fns, pool, table, lengths_t)
        expected_kv, expected_valid = _read_paged_reference(pool, table, lengths_t)
        if check_valid and not torch.equal(valid, expected_valid):
            row, position = (int(i) for i in (valid != expected_valid).nonzero()[0])
            raise Mismatch(f"{what}: valid[{row}, {position}] is {bool(valid[row, position])}; expected "
                           f"{bool(expected_valid[row, position])}",
                           **READ_PAGED_BUGS.hint(fns, pool, table, lengths_t))
        truth = expected_valid[:, None, :, None]  # compare what the rows hold, not what lies past them
        assert_close(kv * truth, expected_kv * truth, what, atol=0, dims=BHLD,
                     explain=lambda: READ_PAGED_BUGS.hint(fns, pool, table, lengths_t))
    return run


READ_PAGED_HINT = ("Where does position j of row b live? Check your answer by hand for a row with block table "
                   "[6, 3, 0] (blocks of 4) at j = 5.")
READ_PAGED = Task("read_paged", "2.2", ("read_paged",), (
    Property("returns (kv, valid): kv (B, H_kv, S, D) with S the longest row, valid (B, S) booleans",
             "What is S, and what shape does a gather of every row's first S positions have?",
             lambda fns: _read_paged(fns, randn(12, 2, 4, 3, seed=170), torch.tensor([[6, 3, 0], [1, 8, 11]]),
                                     torch.tensor([9, 3]))),
    Property("one row read through its block table", READ_PAGED_HINT,
             _read_paged_case([[6, 3, 0]], [11], "one row of 11 positions in blocks 6, 3, 0", 171)),
    Property("rows of different lengths through their own block tables", READ_PAGED_HINT,
             _read_paged_case([[6, 3, 0], [1, 8, 11], [10, 4, 2]], [9, 3, 12],
                              "rows of 9, 3 and 12 positions", 172), central=True),
    Property("valid[b, j] is True exactly when j < lengths[b], an empty row included",
             "Which positions does a row of length n hold, and which does a row of length 0 hold?",
             _read_paged_case([[6, 3, 0], [1, 8, 11]], [7, 0], "rows of 7 and 0 positions", 173,
                              check_valid=True)),
))


# --- make_room: blocks for the next step, with eviction ------------------------------------------------------

def _make_room_reference(block_tables, lengths, new_tokens, free_blocks, block_size, oldest=False,
                         give_back=True, partial=True, pop_end=False, allocate_first=False, everyone=False):
    """The rule, and the usual slips (flags)."""
    def need(b):
        held = len(block_tables[b]) if partial else 0
        total = math.ceil((lengths[b] + new_tokens[b]) / block_size) if partial else \
            math.ceil(new_tokens[b] / block_size)
        return max(0, total - held)

    def take():
        return free_blocks.pop() if pop_end else free_blocks.pop(0)

    running, evicted = [b for b in range(len(block_tables)) if new_tokens[b] > 0], []
    if allocate_first:  # hand out blocks in row order; evict the newest only when the free list is empty
        for b in list(running):
            while need(b) > 0:
                if free_blocks:
                    block_tables[b].append(take())
                    continue
                victim = running.pop()
                if give_back:
                    free_blocks.extend(block_tables[victim])
                block_tables[victim].clear()
                evicted.append(victim)
                if victim == b:
                    break
        return evicted
    while running and sum(need(b) for b in running) > len(free_blocks):
        victims = list(reversed(running)) if everyone else [running[0] if oldest else running[-1]]
        for victim in victims:
            running.remove(victim)
            if give_back:
                free_blocks.extend(block_tables[victim])
            block_tables[victim].clear()
            evicted.append(victim)
    for b in running:
        for _ in range(need(b)):
            block_tables[b].append(take())
    return evicted


def _room(**slip):
    return lambda tables, lengths, new, free, size: _make_room_reference(tables, lengths, new, free, size, **slip)


def _observe_room(function, tables, lengths, new, free, block_size):
    """(the rows evicted, the block tables after, the free list after), on copies."""
    tables, free = [list(t) for t in tables], list(free)
    evicted = function(tables, list(lengths), list(new), free, block_size)
    return evicted, tables, free


ROOMY_CASE = ([[0, 1], [2], [3, 4, 5]], [8, 3, 9], [1, 1, 1], [6, 7, 8, 9], 4)  # row 0 crosses into a block
SHORT_CASE = ([[0, 1], [2, 3], [4, 5]], [8, 8, 8], [1, 1, 1], [6, 7], 4)  # 3 blocks needed, 2 free
SHORT_AND_IDLE = ([[0], [1, 2], [3], [4, 5]], [4, 8, 3, 8], [1, 1, 0, 1], [6], 4)  # row 2 is waiting
PREFILL_CASE = ([[0, 1], [], [2]], [5, 0, 2], [1, 7, 1], [3, 4, 5, 6], 4)  # row 1 prefills 7 tokens


def _room_probes():
    return [ROOMY_CASE, SHORT_CASE, SHORT_AND_IDLE, PREFILL_CASE,
            ([[0, 1], [2, 3, 4], [5]], [8, 12, 4], [1, 1, 1], [6], 4)]


ROOM_BUGS = Catalogue("make_room", _room(), (
    Bug("make_room.oldest", "evicting the oldest row first", "Rows come in order of admission: the newest "
        "is the last running one, and it loses the least work.", _room(oldest=True)),
    Bug("make_room.keeps_blocks", "an eviction that does not give the blocks back",
        "An evicted row's blocks go back to the free list, where the others can take them.",
        _room(give_back=False)),
    Bug("make_room.whole_blocks", "a count that ignores the blocks a row already holds",
        "A row needs blocks only for the positions past its last block: count the blocks that "
        "lengths + new tokens fill, minus those it holds.", _room(partial=False)),
    Bug("make_room.pop_end", "blocks taken from the end of the free list",
        "Take free blocks from the front of the list (the order the engine keeps).", _room(pop_end=True)),
    Bug("make_room.allocate_first", "blocks handed out before anyone is evicted",
        "Decide the evictions first, until the rows that stay fit, then hand out the blocks: a row "
        "evicted later would take blocks it never uses.", _room(allocate_first=True)),
    Bug("make_room.everyone", "evicting every running row when the blocks run short",
        "Evict one row at a time, the newest first, and stop as soon as the others fit.", _room(everyone=True)),
), _room_probes, observe=_observe_room)


def _room_call(fns, case):
    tables, lengths, new, free, block_size = case
    tables, free = [list(t) for t in tables], list(free)
    evicted = call(fns["make_room"], tables, list(lengths), list(new), free, block_size)
    if not isinstance(evicted, (list, tuple)) or not all(isinstance(b, int) and not isinstance(b, bool)
                                                         for b in evicted):
        raise wrong_value("make_room", evicted, "a list of row indices (the rows evicted)")
    return list(evicted), tables, free


def _room_case(case, what):
    def run(fns):
        got = _room_call(fns, case)
        expected = _observe_room(_room(), *case)
        for part, mine, theirs in zip(("the rows evicted", "the block tables after", "the free list after"),
                                      got, expected):
            if mine != theirs:
                raise Mismatch(f"{what}: {part} are {mine}; expected {theirs}", **ROOM_BUGS.hint(fns, *case))
    return run


def _room_conserves(fns):
    tables, lengths, new, free, block_size = ([[0, 1], [2, 3], [4, 5], [6]], [8, 8, 8, 4], [1, 1, 1, 1], [7], 4)
    _, after, free_after = _room_call(fns, (tables, lengths, new, free, block_size))
    held = [b for t in after for b in t] + free_after
    if sorted(held) != list(range(8)):
        lost = sorted(set(range(8)) - set(held))
        twice = sorted({b for b in held if held.count(b) > 1})
        raise Mismatch(f"a pool of blocks 0..7: after make_room, blocks {lost} are nowhere and {twice} are held "
                       "twice; expected each block in exactly one table or in the free list")


ROOM_HINT = ("Count by hand: how many blocks does each running row need for lengths + new tokens, how many "
             "does it hold, and how many are free? Who must go, and in which order?")
ROOM = Task("make_room", "2.2", ("make_room",), (
    Property("hands out a block to each row whose next token starts a new block",
             "Which positions will each row write, and which of them fall past its last block?",
             _room_case(ROOMY_CASE, "rows of 8, 3, 9 positions, each writing one token, 4 blocks free")),
    Property("a row's prefill takes every block its prompt needs",
             "How many blocks do 7 tokens at positions 0..6 fill, in blocks of 4?",
             _room_case(PREFILL_CASE, "a 7-token prefill beside two decoding rows")),
    Property("when blocks run short, evicts the newest running row and gives its blocks back", ROOM_HINT,
             _room_case(SHORT_CASE, "three rows at a block boundary, 2 blocks free"), central=True),
    Property("never evicts a row that does not run this step, and no more rows than needed", ROOM_HINT,
             _room_case(SHORT_AND_IDLE, "rows 0, 1, 3 running, row 2 waiting, 1 block free")),
    Property("every block ends up in exactly one block table or in the free list",
             "Follow each block through your code: where does an evicted row's block go?", _room_conserves),
))


# --- all three inside a model: a small paged engine ---------------------------------------------------------

class _PagedView:
    """The model's cache contract over pools of blocks, for the rows of one call: writes and reads through
    the learner's ``write_paged`` and ``read_paged`` and a padded block table (rows, width)."""

    def __init__(self, pools_k, pools_v, table: torch.Tensor, write_paged, read_paged):
        self.k, self.v, self.table = pools_k, pools_v, table
        self.write_paged, self.read_paged = write_paged, read_paged

    def begin(self, positions: torch.Tensor) -> None:
        self.positions, self.lengths = positions, positions[:, -1] + 1  # (B, T), (B,)
        self.mask = attention_mask(positions, int(self.lengths.max()), cached=True)

    def attend(self, layer, q, k, v, kernel):
        for pool, new in ((self.k[layer], k), (self.v[layer], v)):
            call(self.write_paged, pool, self.table, new, self.positions)
        B, H, _, D = k.shape
        S = int(self.lengths.max())
        keys, _ = call(self.read_paged, self.k[layer], self.table, self.lengths)
        values, _ = call(self.read_paged, self.v[layer], self.table, self.lengths)
        expect_tensor("read_paged", keys, (B, H, S, D), what="returned as kv")
        expect_tensor("read_paged", values, (B, H, S, D), what="returned as kv")
        return kernel(q, keys, values, self.mask)

    def end(self, positions: torch.Tensor) -> None:
        pass


def _check_books(tables: list[list[int]], free: list[int], num_blocks: int, step: int) -> None:
    held = [b for t in tables for b in t] + list(free)
    if sorted(held) != list(range(num_blocks)):
        raise Mismatch(f"step {step}: after make_room the pool's {num_blocks} blocks are not each in exactly one "
                       f"block table or the free list (tables {tables}, free {free})")


@torch.inference_mode()
def paged_generate(model, prompts: list[list[int]], max_new_tokens: int, write_paged, read_paged, make_room,
                   num_blocks: int, block_size: int) -> tuple[list[list[int]], int]:
    """Greedy generation of every prompt through a pool of ``num_blocks`` blocks (the learner's three
    functions), as a paged engine runs it: each step, ``make_room`` gives every running row the blocks its
    tokens need, evicting the newest rows when the pool runs out; an evicted row loses its cache and is
    recomputed (its prompt and its tokens so far prefilled again) once it gets blocks back. A finished row
    returns its blocks. Returns (each row's tokens, how many times a row lost its blocks)."""
    config, B = model.config, len(prompts)
    shape = (num_blocks, config.n_kv_heads, block_size, config.head_dim)
    pools_k = [torch.zeros(shape, dtype=model.dtype) for _ in range(config.n_layers)]
    pools_v = [torch.zeros(shape, dtype=model.dtype) for _ in range(config.n_layers)]
    tokens, out = [list(p) for p in prompts], [[] for _ in prompts]
    lengths, tables, free = [0] * B, [[] for _ in prompts], list(range(num_blocks))
    evictions, step = 0, 0
    while any(len(o) < max_new_tokens for o in out):
        if step > 20 * (max_new_tokens + B):
            raise Mismatch(f"the generation did not end within {step} steps; expected every row to finish (does "
                           "make_room let the oldest waiting row run?)")
        active = [b for b in range(B) if len(out[b]) < max_new_tokens]
        new = [len(tokens[b]) - lengths[b] if b in active else 0 for b in range(B)]
        held = [bool(t) for t in tables]
        evicted = call(make_room, tables, list(lengths), new, free, block_size)
        if not isinstance(evicted, (list, tuple)) or any(b not in active for b in evicted):
            raise Mismatch(f"step {step}: make_room returned {evicted!r}; expected a list of running rows {active}")
        _check_books(tables, free, num_blocks, step)
        for b in evicted:
            evictions += held[b]
            lengths[b] = 0
        running = [b for b in active if b not in evicted]
        for b in running:
            if len(tables[b]) * block_size < len(tokens[b]):
                raise Mismatch(f"step {step}: row {b} writes {len(tokens[b])} positions but holds "
                               f"{len(tables[b])} blocks of {block_size}")
        groups = [[b] for b in running if new[b] > 1] + [[b for b in running if new[b] == 1]]
        for rows in (g for g in groups if g):
            width = max(len(tables[b]) for b in rows)
            table = torch.tensor([tables[b] + [tables[b][-1]] * (width - len(tables[b])) for b in rows])
            T = new[rows[0]]
            ids = torch.tensor([tokens[b][lengths[b]:] for b in rows])  # (rows, T)
            positions = torch.tensor([list(range(lengths[b], lengths[b] + T)) for b in rows])  # (rows, T)
            view = _PagedView(pools_k, pools_v, table, write_paged, read_paged)
            logits = model(ids, positions, view)[:, -1]  # (rows, V)
            for i, b in enumerate(rows):
                lengths[b] += T
                token = int(logits[i].argmax())
                out[b].append(token)
                tokens[b].append(token)
                if len(out[b]) == max_new_tokens:  # finished: its blocks go back to the pool
                    free.extend(tables[b])
                    tables[b].clear()
        step += 1
    return out, evictions


PAGED_PROMPTS = (5, 9, 3)  # prompt lengths; 8 new tokens each in blocks of 4 need 4 + 5 + 3 = 12 blocks


def _paged_run(fns, num_blocks):
    model = tiny_model()
    prompts = [randint(256, (n,), seed=180 + n).tolist() for n in PAGED_PROMPTS]
    got, evictions = paged_generate(model, prompts, 8, fns["write_paged"], fns["read_paged"], fns["make_room"],
                                    num_blocks, 4)
    for b, prompt in enumerate(prompts):
        expected = generate(model, prompt, 8, use_cache=False)
        if got[b] != expected:
            raise Mismatch(f"{num_blocks} blocks: row {b} (a {len(prompt)}-token prompt) agrees with naive "
                           f"generation on the first {_first_difference(got[b], expected)} of 8 tokens only; "
                           "expected all 8")
    return evictions


def _paged_roomy(fns):
    _paged_run(fns, 16)


def _paged_tight(fns):
    if _paged_run(fns, 7) == 0:
        raise Mismatch("7 blocks for rows that need 12: no row was evicted; expected make_room to evict")


PAGED_MODEL = Task("your paged cache inside the tiny model", "2.2", ("write_paged", "read_paged", "make_room"), (
    Property("three prompts in a roomy pool of 16 blocks equal naive generation row by row",
             "Pass the checks of write_paged, read_paged and make_room first.", _paged_roomy, central=True),
    Property("the same in a pool of 7 blocks: rows are evicted, recomputed, and still equal naive generation",
             "After an eviction the row starts again from position 0: does make_room give it blocks for its "
             "whole prompt and its tokens so far?", _paged_tight, central=True),
))

register(WRITE, READ, MODEL, FORMULA, PAGED, READ_PAGED, ROOM, PAGED_MODEL)


def pool_map(write_paged, block_size: int = 4, num_blocks: int = 10) -> None:
    """Three rows of 6, 9 and 3 tokens written through the learner's ``write_paged`` into a shuffled pool, one
    token at a time as decode steps would; prints which row and position each physical block holds. Call it
    once ``ready(write_paged)`` passes."""
    if not ready(write_paged):
        return
    lengths, tables = (6, 9, 3), [[7, 2], [4, 9, 0], [5]]
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [t[-1]] * (width - len(t)) for t in tables])  # (B, width), padded
    pool = torch.full((num_blocks, 1, block_size, 1), -1.0)  # an entry stores row * 100 + position
    for p in range(max(lengths)):
        rows = [b for b, n in enumerate(lengths) if p < n]
        for b in rows:
            entry = torch.full((1, 1, 1, 1), float(b * 100 + p))
            call(write_paged, pool, block_table[b:b + 1], entry, torch.tensor([[p]]))
    print("block tables (logical -> physical): " + "; ".join(f"row {b}: {t}" for b, t in enumerate(tables)))
    for block in range(num_blocks):
        slots = [int(v) for v in pool[block, 0, :, 0].tolist()]
        shown = " ".join("  . " if v < 0 else f"{v // 100}:{v % 100:<2}" for v in slots)
        print(f"    physical block {block}: {shown}")
    print("    (row:position in each of its slots; . is free)")


# --- the payoff ---------------------------------------------------------------------------------------------

def compare_generation(model, tokenizer, write_kv, read_kv, kv_cache_bytes, prompts: list[str],
                       max_new_tokens: int = 16, chat: bool = False) -> None:
    """Every prompt at once through the learner's cache, against naive generation row by row; then the
    cache's bytes against the learner's formula and minillm's. ``chat``: wrap the prompts in the chat
    template (longer prompts: the naive path recomputes them at every step). Call it once ``ready``
    passes for the three functions."""
    ids = [encode_prompt(tokenizer, p, chat) for p in prompts]
    eos = tokenizer.eos_token_id
    cached, cache = batched_generate(model, ids, max_new_tokens, write_kv, read_kv, eos)
    for b, (prompt, row) in enumerate(zip(ids, cached)):
        naive = generate(model, prompt, max_new_tokens, use_cache=False, eos_token_id=eos)
        same = "equal to" if row == naive else "DIFFERENT from"
        print(f"row {b}: {len(prompt)}-token prompt, {len(row)} new tokens, {same} naive generation")
        show_text("    ", tokenizer.decode(prompt) + " | " + tokenizer.decode(row))
    config, batch = model.config, len(prompts)
    element = model.dtype.itemsize
    formula = call(kv_cache_bytes, config.n_layers, config.n_kv_heads, config.head_dim, cache.max_len, batch,
                   element)
    library = reference_kv_bytes(config, cache.max_len, batch, model.dtype)
    print(f"the cache: {batch} rows x {cache.max_len} positions, {config.n_layers} layers, "
          f"{config.n_kv_heads} KV heads x {config.head_dim}, {element} bytes an element")
    print(f"    allocated: {cache.nbytes:,} B; your formula: {formula:,} B; minillm.analysis.arithmetic: {library:,} B")


def _shape(name: str, preset: str, tokens: int, element: int) -> tuple:
    config = get_config(preset)
    return name, config.n_layers, config.n_kv_heads, config.head_dim, tokens, element


# The documents' two examples (LLaMA-7B at 2048 tokens, LLaMA-13B at 4096) and Llama-2-70B in float16,
# from minillm's shape-only presets; SmolLM2-135M-Instruct (30 layers, 3 KV heads of 64) at its full
# context of 8192, in the float32 this book runs it in.
FORMULA_MODELS = [_shape("LLaMA-7B", "llama-7b", 2048, 2), _shape("LLaMA-13B", "llama-13b", 4096, 2),
                  _shape("Llama-2-70B", "llama2-70b", 4096, 2), ("SmolLM2-135M", 30, 3, 64, 8192, 4)]


def formula_table(kv_cache_bytes) -> None:
    """The learner's formula for one sequence of each model of ``FORMULA_MODELS``, in GB and GiB."""
    if not ready(kv_cache_bytes):
        return
    print(f"{'model':<14}{'tokens':>8}{'bytes/elem':>12}{'bytes':>17}{'GB':>9}{'GiB':>9}")
    for name, layers, kv_heads, head_dim, tokens, element in FORMULA_MODELS:
        n = call(kv_cache_bytes, layers, kv_heads, head_dim, tokens, 1, element)
        print(f"{name:<14}{tokens:>8}{element:>12}{n:>17,}{n / 1e9:>9.3f}{n / 2**30:>9.3f}")


def compare_paged(model, tokenizer, write_paged, read_paged, make_room, prompts: list[str], num_blocks: int,
                  block_size: int = 4, max_new_tokens: int = 12) -> None:
    """Every prompt through the learner's paged cache in a pool of ``num_blocks`` blocks (``paged_generate``),
    against naive generation row by row; how many times a row lost its blocks. Call it once ``ready``
    passes for the three paged functions."""
    if not ready(write_paged, read_paged, make_room):
        return
    ids = [encode_prompt(tokenizer, p, chat=False) for p in prompts]
    need = sum(math.ceil((len(p) + max_new_tokens) / block_size) for p in ids)
    rows, evictions = paged_generate(model, ids, max_new_tokens, write_paged, read_paged, make_room, num_blocks,
                                     block_size)
    print(f"{len(ids)} rows needing {need} blocks of {block_size} at their longest; a pool of {num_blocks} "
          f"blocks; {evictions} eviction(s)")
    for b, (prompt, row) in enumerate(zip(ids, rows)):
        naive = generate(model, prompt, max_new_tokens, use_cache=False)
        same = "equal to" if row == naive else "DIFFERENT from"
        print(f"row {b}: {len(prompt)}-token prompt, {same} naive generation")
        show_text("    ", tokenizer.decode(prompt) + " | " + tokenizer.decode(row))
