"""Byte-level tokenizer: lossless round trips, special ids, bad ids."""
import pytest

TEXTS = ["请介绍一下Transformer", "Hello, world! KV cache & TTFT.", "混合 mixed 文本 ✓ 🚀 tabs\tand\nnewlines", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_lossless(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode(tokenizer.encode(text, bos=False, eos=True)) == text


def test_the_documents_example_prompt(tokenizer):
    ids = tokenizer.encode("请介绍一下Transformer")
    # BOS + 5 Chinese characters x 3 UTF-8 bytes + 11 ASCII bytes = 27 tokens
    assert len(ids) == 1 + 5 * 3 + 11 == 27
    assert ids[0] == tokenizer.bos_token_id == 256
    assert ids[1:4] == list("请".encode()) == [0xE8, 0xAF, 0xB7]
    assert ids[-11:] == [ord(c) for c in "Transformer"]


def test_special_ids(tokenizer):
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (256, 257, 258)
    assert tokenizer.encode("a") == [256, 97]
    assert tokenizer.encode("a", bos=False) == [97]
    assert tokenizer.encode("a", eos=True) == [256, 97, 257]
    assert tokenizer.decode([256, 104, 105, 257]) == "hi"  # special tokens are dropped
    assert tokenizer.token_strings([256, 104, 0xE8, 257]) == ["<BOS>", "h", "0xE8", "<EOS>"]


def test_a_cut_character_decodes_to_the_replacement_mark_or_raises(tokenizer):
    ids = tokenizer.encode("请", bos=False)  # 3 bytes
    assert tokenizer.decode(ids[:2]) == "\ufffd"
    with pytest.raises(UnicodeDecodeError):
        tokenizer.decode(ids[:2], errors="strict")


@pytest.mark.parametrize("bad", [258, -1, 1000])
def test_decode_of_ids_outside_the_vocabulary_raises(tokenizer, bad):
    with pytest.raises(ValueError, match=rf"token id {bad} is outside the vocabulary \[0, 258\)"):
        tokenizer.decode([104, bad])


def test_encode_wants_text(tokenizer):
    with pytest.raises(TypeError, match="text must be str, got bytes"):
        tokenizer.encode(b"hi")
