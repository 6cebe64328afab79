"""Lab 2.2: a KV cache written by position and read for rows of different lengths, and its bytes.

The learner writes ``write_kv``, ``read_kv`` and ``kv_cache_bytes``. ``LearnerCache``, a ``KVCache``
that writes and reads through the first two, runs the learner's cache inside any ``CausalLM``;
``compare_generation`` is the lab's payoff.
"""
from __future__ import annotations

import torch

from ...analysis.arithmetic import kv_cache_bytes as reference_kv_bytes
from ...cache import KVCache
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

BHLD = ("row", "kv head", "position", "element")


# --- write_kv ----------------------------------------------------------------------------------------

INPLACE_HINT = ("Assign into the cache tensor you are given (cache[...] = ...): the model keeps that tensor, "
                "so a new one that you return is never read.")
ORDER_HINT = "Positions say where each entry goes; the t-th new entry is not at index t."
ROW0_WRITE_HINT = "positions is (B, T) and differs per row: one index per row, not positions[0] for all."
SHIFT_HINT = "Positions count from 0: the entry at position p goes to index p of the cache, not p + 1."


def _write(fns, cache, new, positions):
    """Run the learner's write_kv on a copy of ``cache``; the copy after the call."""
    target, before = cache.clone(), cache.clone()
    returned = call(fns["write_kv"], target, new.clone(), positions.clone())
    if torch.equal(target, before):
        extra = " (it returned a new tensor instead)" if isinstance(returned, torch.Tensor) else ""
        raise Mismatch("write_kv left the cache passed in unchanged" + extra + "; the model keeps "
                       "using that same tensor, so write into it", INPLACE_HINT)
    return target


def _write_bugs(cache, new, positions):
    B, T = positions.shape
    return ((ORDER_HINT, lambda: _expected_write(cache, new, torch.arange(T).expand(B, T))),
            (ROW0_WRITE_HINT, lambda: _expected_write(cache, new, positions[:1].expand(B, T))),
            (SHIFT_HINT, lambda: _expected_write(cache, new, positions + 1)))


def _expected_write(cache, new, positions):
    out = cache.clone()
    for b in range(new.shape[0]):
        for t in range(new.shape[2]):
            out[b, :, int(positions[b, t])] = new[b, :, t]
    return out


def _write_case(b, t, positions, what, seed):
    def run(fns):
        cache, new = randn(b, 2, 10, 4, seed=seed), randn(b, 2, t, 4, seed=seed + 1)
        positions_t = torch.tensor(positions)
        assert_close(_write(fns, cache, new, positions_t), _expected_write(cache, new, positions_t), what,
                     atol=0, dims=BHLD, bugs=_write_bugs(cache, new, positions_t))
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
                       f"position {position} ({len(changed)} position(s) in all)")


WRITE_HINT = "Index the position axis (dim 2) with positions row by row: new[b, :, t] goes to " \
             "cache[b, :, positions[b, t]]."
WRITE = Task("write_kv", "2.2", ("write_kv",), (
    Property("a prefill writes T entries at positions 0..T-1", WRITE_HINT,
             _write_case(1, 3, [[0, 1, 2]], "the cache after a 3-token prefill", 110)),
    Property("a decode step: each row writes one entry at its own position", ROW0_WRITE_HINT,
             _write_case(3, 1, [[5], [0], [2]], "the cache after rows write at positions 5, 0, 2", 112)),
    Property("a chunk that continues a row writes at positions 4, 5, 6", ORDER_HINT,
             _write_case(1, 3, [[4, 5, 6]], "the cache after a chunk at positions 4..6", 114)),
    Property("rows at different positions in one multi-token write", WRITE_HINT,
             _write_case(2, 3, [[0, 1, 2], [5, 6, 7]], "the cache after rows write 0..2 and 5..7", 116)),
    Property("leaves every other entry of the cache unchanged",
             "Write only the positions given: no slicing from 0, no zeroing of the rest.", _write_untouched),
))


# --- read_kv -------------------------------------------------------------------------------------------

def _read(fns, cache, lengths):
    out = call(fns["read_kv"], cache.clone(), lengths.clone())
    if not (isinstance(out, tuple) and len(out) == 2):
        raise wrong_value("read_kv", out, "a pair (kv, valid)")
    B, H, _, D = cache.shape
    S = int(lengths.max())
    kv = expect_tensor("read_kv", out[0], (B, H, S, D), what="returned as kv")
    valid = expect_tensor("read_kv", out[1], (B, S), floating=False, what="returned as valid")
    if valid.dtype != torch.bool:
        raise LearnerError(f"read_kv returned valid as a {str(valid.dtype).removeprefix('torch.')} tensor; "
                           "expected booleans (torch.bool)")
    return kv, valid


def _read_shapes(fns):
    _read(fns, randn(3, 2, 12, 4, seed=130), torch.tensor([4, 9, 6]))


def _read_values(fns):
    cache, lengths = randn(3, 2, 12, 4, seed=131), torch.tensor([4, 9, 6])
    kv, _ = _read(fns, cache, lengths)
    assert_close(kv, cache[:, :, :9], "kv", atol=0, dims=BHLD)


def _expected_valid(lengths, S):
    return torch.arange(S)[None, :] < lengths[:, None]


def _read_valid(fns):
    lengths = torch.tensor([4, 9, 6])
    _, valid = _read(fns, randn(3, 2, 12, 4, seed=132), lengths)
    wrong = (valid != _expected_valid(lengths, 9)).nonzero()
    if len(wrong):
        row, position = (int(i) for i in wrong[0])
        hint = VALID_LE_HINT if torch.equal(valid, torch.arange(9)[None, :] <= lengths[:, None]) else None
        raise Mismatch(f"for rows of lengths 4, 9, 6, valid[{row}, {position}] is {bool(valid[row, position])}"
                       f" ({len(wrong)} wrong entries)", hint)


VALID_LE_HINT = "A row of length n holds positions 0..n-1: position j is valid when j < n, not j <= n."


def _read_edges(fns):
    for lengths in (torch.tensor([5, 5]), torch.tensor([0, 3])):
        cache = randn(2, 1, 8, 4, seed=133)
        kv, valid = _read(fns, cache, lengths)
        S = int(lengths.max())
        assert_close(kv, cache[:, :, :S], f"kv for lengths {lengths.tolist()}", atol=0, dims=BHLD)
        if not torch.equal(valid, _expected_valid(lengths, S)):
            raise Mismatch(f"for lengths {lengths.tolist()}, valid is {valid.int().tolist()}")


READ = Task("read_kv", "2.2", ("read_kv",), (
    Property("returns (kv, valid): kv (B, H_kv, S, D) with S the longest row, valid (B, S) booleans",
             "S = the largest length (a Python int); keep every row's first S positions.", _read_shapes),
    Property("kv holds each row's first S positions",
             "Slice the position axis (dim 2) from 0 to S for every row.", _read_values),
    Property("valid[b, j] is True exactly when j < lengths[b]",
             "Compare the positions 0..S-1 with each row's length: broadcast a (1, S) row of positions "
             "against a (B, 1) column of lengths.", _read_valid),
    Property("rows of equal length, and a row of length 0",
             "Equal rows: everything valid. An empty row: nothing valid.", _read_edges),
))


# --- both, inside a real model -------------------------------------------------------------------------

class LearnerCache(KVCache):
    """minillm's ``KVCache`` whose ``update`` writes and reads through the learner's ``write_kv`` and
    ``read_kv``."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, write_kv, read_kv,
                 device="cpu", dtype=torch.float32):
        super().__init__(config, batch_size, max_len, device, dtype)
        self.write_kv, self.read_kv = write_kv, read_kv

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Write k, v (B, Hkv, T, D) at positions (B, T); read every row up to its new length."""
        call(self.write_kv, self.k[layer], k, positions)
        call(self.write_kv, self.v[layer], v, positions)
        lengths = positions[:, -1] + 1  # (B,): the length of each row once this call's tokens are in
        B, H, _, D = k.shape
        S = int(lengths.max())
        keys, _ = call(self.read_kv, self.k[layer], lengths)
        values, _ = call(self.read_kv, self.v[layer], lengths)
        expect_tensor("read_kv", keys, (B, H, S, D), what="returned as kv")
        expect_tensor("read_kv", values, (B, H, S, D), what="returned as kv")
        return keys, values


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


def _model_one(fns):
    model, prompt = tiny_model(), randint(256, (10,), seed=140).tolist()
    got, _ = batched_generate(model, [prompt], 8, fns["write_kv"], fns["read_kv"])
    expected = generate(model, prompt, 8, use_cache=False)
    if got[0] != expected:
        first = next(i for i, (a, b) in enumerate(zip(got[0], expected)) if a != b)
        raise Mismatch(f"cached and naive generation agree on the first {first} of 8 tokens only")


def _model_rows(fns):
    model = tiny_model()
    prompts = [randint(256, (n,), seed=141 + n).tolist() for n in (3, 11, 7)]
    got, _ = batched_generate(model, prompts, 6, fns["write_kv"], fns["read_kv"])
    for b, prompt in enumerate(prompts):
        expected = generate(model, prompt, 6, use_cache=False)
        if got[b] != expected:
            first = next(i for i, (x, y) in enumerate(zip(got[b], expected)) if x != y)
            raise Mismatch(f"row {b} (a {len(prompt)}-token prompt): cached and naive generation agree on "
                           f"the first {first} of 6 tokens only")


MODEL = Task("your cache inside the tiny model", "2.2", ("write_kv", "read_kv"), (
    Property("cached generation of one sequence equals naive generation",
             "Pass the checks of write_kv and read_kv first.", _model_one),
    Property("three prompts of 3, 11 and 7 tokens, cached in one batch, equal naive generation row by row",
             "Each decode step writes every row at its own position and reads each row up to its own "
             "length.", _model_rows),
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


KV_TWO_HINT = "The cache holds K and V: two tensors per layer, so the factor 2."
PER_ELEMENT_HINT = "Multiply by bytes_per_element: the formula counts bytes, not elements."


def _bytes_case(args, what):
    def run(fns):
        got, expected = _bytes(fns, *args), _expected_bytes(*args)
        if got != expected:
            other = 4 if args[-1] != 4 else 2  # the same cache at another element size
            ignores_size = _bytes(fns, *args[:-1], other) == got
            hint = PER_ELEMENT_HINT if ignores_size else KV_TWO_HINT if 2 * got == expected else None
            raise Mismatch(f"{what}: got {got:,} bytes, expected {expected:,}", hint)
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
            raise Mismatch(f"1 sequence of 1000 tokens takes {one:,} bytes, but {batch} of {seq} take "
                           f"{got:,}")


def _bytes_allocated(fns):
    layers, batch, kv_heads, max_len, head_dim = 3, 2, 2, 24, 16
    for dtype in (torch.float32, torch.float16):
        tensors = [torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype) for _ in range(2 * layers)]
        held = sum(t.numel() * t.element_size() for t in tensors)
        got = _bytes(fns, layers, kv_heads, head_dim, max_len, batch, dtype.itemsize)
        if got != held:
            raise Mismatch(f"a {str(dtype).removeprefix('torch.')} cache of {layers} layers holds "
                           f"{held:,} bytes in its K and V tensors; kv_cache_bytes says {got:,}")


FORMULA_HINT = "K and V (2) x layers x KV heads x head_dim x tokens x sequences x bytes per element."
FORMULA = Task("kv_cache_bytes", "2.2", ("kv_cache_bytes",), (
    Property("returns an int (a number of bytes)",
             "Multiply integers only; no division, no rounding.", _bytes_type),
    Property("LLaMA-7B (32 layers, 32 KV heads, head_dim 128), float16, 2048 tokens",
             FORMULA_HINT, _bytes_case((32, 32, 128, 2048, 1, 2), "LLaMA-7B, one 2048-token sequence")),
    Property("grouped KV heads: Llama-2-70B keeps 8 KV heads for its 64 query heads",
             "Only the KV heads are stored: the query heads do not enter.",
             _bytes_case((80, 8, 128, 4096, 1, 2), "Llama-2-70B, one 4096-token sequence")),
    Property("grows in proportion to the batch and to the sequence length",
             "Each sequence keeps its own K and V for every one of its tokens.", _bytes_linear),
    Property("counts the bytes per element (float32 4, float16 2, int8 1)", FORMULA_HINT,
             _bytes_case((30, 3, 64, 512, 4, 4), "SmolLM2 in float32, 4 sequences of 512 tokens")),
    Property("equals the bytes of an allocated cache (K and V tensors of every layer)", FORMULA_HINT,
             _bytes_allocated),
))


# --- write_paged -----------------------------------------------------------------------------------------

POOL = ("block", "kv head", "slot", "element")
PAGED_TABLE_HINT = ("A row's logical block i lives in physical block block_table[b, i]: look the block up in "
                    "the table instead of using i itself.")
PAGED_ROW_HINT = "Each row has its own block table: index block_table with the row (block_table[b, ...])."
PAGED_CROSS_HINT = ("Compute the block of every position (positions // block_size), not of the first one: a "
                    "write of several tokens can cross into the row's next block.")
PAGED_SLOT_HINT = "Inside its block a position sits at slot position % block_size."
PAGED_INPLACE_HINT = ("Assign into the pool you are given (pool[...] = ...): the engine keeps that tensor, so a "
                      "new one that you return is never read.")


def _paged_reference(pool, block_table, new, positions, table=True, own_row=True, per_position=True,
                     swapped=False):
    """Where each entry goes, one by one; the flags switch off a part of the rule (the bugs' outputs)."""
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
    return out


def _paged_bugs(pool, block_table, new, positions):
    return ((PAGED_TABLE_HINT, lambda: _paged_reference(pool, block_table, new, positions, table=False)),
            (PAGED_ROW_HINT, lambda: _paged_reference(pool, block_table, new, positions, own_row=False)),
            (PAGED_CROSS_HINT, lambda: _paged_reference(pool, block_table, new, positions, per_position=False)),
            (PAGED_SLOT_HINT, lambda: _paged_reference(pool, block_table, new, positions, swapped=True)))


def _write_paged(fns, pool, block_table, new, positions):
    target, before = pool.clone(), pool.clone()
    try:
        returned = call(fns["write_paged"], target, block_table.clone(), new.clone(), positions.clone())
    except LearnerError as error:  # a position used as a slot runs past the block
        if isinstance(error.__cause__, IndexError) and int(positions.max()) >= pool.shape[2]:
            raise Mismatch(str(error), PAGED_SLOT_HINT) from error
        raise
    if torch.equal(target, before):
        extra = " (it returned a new tensor instead)" if isinstance(returned, torch.Tensor) else ""
        raise Mismatch("write_paged left the pool passed in unchanged" + extra, PAGED_INPLACE_HINT)
    return target


def _paged_case(tables, positions, what, seed):
    """Blocks of 4 slots in a pool of 12; ``tables``: each row's physical blocks, in logical order."""
    def run(fns):
        block_table, positions_t = torch.tensor(tables), torch.tensor(positions)
        B, T = positions_t.shape
        pool, new = randn(12, 2, 4, 3, seed=seed), randn(B, 2, T, 3, seed=seed + 1)
        got = _write_paged(fns, pool, block_table, new, positions_t)
        assert_close(got, _paged_reference(pool, block_table, new, positions_t), what, atol=0, dims=POOL,
                     bugs=_paged_bugs(pool, block_table, new, positions_t))
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
                       f"({len(changed - written)} slot(s) in all)")


PAGED_HINT = ("new[b, :, t] goes to pool[block_table[b, p // block_size], :, p % block_size], "
              "p = positions[b, t], block_size = pool.shape[2].")
PAGED = Task("write_paged", "2.2", ("write_paged",), (
    Property("a prefill into one row's first block", PAGED_HINT,
             _paged_case([[6, 3, 0]], [[0, 1, 2]], "the pool after a 3-token prefill into block 6", 150)),
    Property("the row's block table decides the physical block", PAGED_TABLE_HINT,
             _paged_case([[6, 3, 0]], [[4, 5]], "the pool after writing positions 4, 5 (logical block 1)",
                         152)),
    Property("a write that crosses into the row's next block", PAGED_CROSS_HINT,
             _paged_case([[6, 3, 0]], [[2, 3, 4, 5]], "the pool after writing positions 2..5", 154)),
    Property("rows with their own block tables, at their own positions", PAGED_ROW_HINT,
             _paged_case([[6, 3, 0], [1, 8, 11], [10, 4, 2]], [[9], [2], [5]],
                         "the pool after rows write at positions 9, 2, 5", 156)),
    Property("the slot inside a block is position % block_size", PAGED_SLOT_HINT,
             _paged_case([[6, 3, 0], [1, 8, 11]], [[1, 2], [6, 7]], "the pool after rows write 1..2 and 6..7",
                         158)),
    Property("writes in place and leaves every other slot of the pool unchanged",
             "Write only the slots the positions name; no slicing from 0, no zeroing of the rest.",
             _paged_untouched),
))

register(WRITE, READ, MODEL, FORMULA, PAGED)


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
