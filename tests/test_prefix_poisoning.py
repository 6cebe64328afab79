"""Prefix-cache poisoning: a block is shared only after an equal prefix, even when a
client crafts tokens whose Python ``hash()`` collides with another user's.

The old keys were ``(hash(parent_key), tuple(tokens))``. CPython's tuple hash depends only on the
hashes of its items, and two different ints can hash alike (``hash(-1) == hash(-2)``, and
``hash(0) == hash(2**61 - 1)``), so two different first blocks gave the same parent hash: a block after
the attacker's first block was found under the victim's key, and the victim's reply came from the
attacker's KV. The keys are now SHA-256 digests of the parent's digest and the block's tokens."""
import hashlib

import pytest

from minillm.engine import BlockManager, Request, block_key
from minillm.engine.request import Sequence

TAIL = [7, 8, 9]
COLLISIONS = [(-1, -2), (0, 2**61 - 1)]  # pairs of different ints with one built-in hash


def _cached(blocks: BlockManager, request_id, prompt: list[int]) -> Sequence:
    """Admit ``prompt``, mark it computed, register its full blocks, let it go; the sequence."""
    seq = Sequence(Request(request_id, prompt, 1), device="cpu")
    assert blocks.admit(seq) is not None
    seq.num_computed = len(prompt)
    blocks.cache_full_blocks(seq)
    table = list(seq.block_table)
    blocks.free(seq)
    seq.block_table = table  # kept for the test to look at
    return seq


@pytest.mark.parametrize("victim_id, attacker_id", COLLISIONS)
def test_the_collision_exists_for_the_builtin_hash(victim_id, attacker_id):
    """The premise: these first blocks differ, yet Python's hash() of their old keys is equal."""
    victim, attacker = (None, (victim_id, *TAIL)), (None, (attacker_id, *TAIL))
    assert victim != attacker and hash(victim) == hash(attacker)


@pytest.mark.parametrize("victim_id, attacker_id", COLLISIONS)
def test_a_crafted_block_with_a_colliding_builtin_hash_shares_no_block(victim_id, attacker_id):
    victim_first, attacker_first = [victim_id, *TAIL], [attacker_id, *TAIL]
    second = [1, 2, 3, 4]
    assert block_key(block_key(None, victim_first), second) != block_key(block_key(None, attacker_first), second)

    blocks = BlockManager(8, 4, enable_prefix_caching=True)
    _cached(blocks, "victim-earlier", victim_first + [50])  # the victim's first block is cached
    attacker = _cached(blocks, "attacker", attacker_first + second + [60])  # the crafted block, then the bait
    victim = Sequence(Request("victim", victim_first + second + [70], 1), device="cpu")
    found = blocks.admit(victim)
    assert found == 4, "only the victim's own first block may come from the cache"
    assert victim.block_table[1] != attacker.block_table[1]  # the attacker's KV for `second` is not reused


def test_keys_are_sha256_digests_of_the_parent_and_the_tokens():
    root = block_key(None, [1, 2])
    assert isinstance(root, bytes) and len(root) == 32
    assert block_key(root, [3, 4]) == hashlib.sha256(root + b"".join(t.to_bytes(8, "little") for t in (3, 4))).digest()
    # no two encodings alike: a block is never confused with a shorter or longer one, or with a first block
    assert block_key(None, [1, 2]) != block_key(None, [1, 2, 0]) != block_key(None, [258])
    assert block_key(root, [1, 2]) != block_key(None, [1, 2])
