"""Data the chapters quote: an A100's datasheet figures, a benchmark run, the passage the precision chapter scores,
the prompts of the speculative-decoding chapter."""

A100_PEAK_FLOPS = 312e12  # FLOP/s: dense float16/bfloat16 on the tensor cores
A100_BANDWIDTH = 2.039e12  # bytes/s: HBM2e
A100_MEMORY = 80 * 2**30  # bytes: sold as "80GB", it holds 80 GiB (nvidia-smi: 81,920 MiB)

# The one-thread rows of the benchmarks/bench_peers.py run that README.md prints in full: chapter 2.5 quotes them
# where llama-cpp-python is not installed (tests/test_book.py holds them equal to the README's rows).
BENCH_PEERS_RUN = {
    "machine": "a 2-core AMD EPYC VM",
    "llama.cpp": {"tokens/s": 67.1, "MB/token": 98.3},
    "int4 compiled": {"tokens/s": 83.2, "ms/token": 12.02, "vs llama.cpp": 1.24},
}


EVAL_TEXT = (
    "The old lighthouse stood at the end of a narrow spit of rock, and for most of the "
    "year nobody visited it except the keeper and the gulls. Every evening, just "
    "before sunset, the keeper climbed the one hundred and twelve steps to the lamp "
    "room, cleaned the great glass lens with a soft cloth, and trimmed the wick. The "
    "light itself was small, no bigger than a candle flame, but the lens gathered it "
    "into a beam that ships could see twenty miles out at sea. In winter the storms "
    "came in from the west, and the waves broke so high against the tower that salt "
    "crusted the windows of the upper rooms. On those nights the keeper did not sleep. "
    "He sat by the stove with a pot of tea, listening to the wind, and every hour he "
    "climbed the stairs again to make sure the lamp was still burning. When the "
    "weather cleared, he walked along the shore to collect whatever the sea had left "
    "behind: pieces of rope, a broken oar, once a wooden crate full of oranges that "
    "had drifted for days. He kept a logbook in which he wrote down the weather, the "
    "ships that passed, and the small repairs he made to the building. Years later, "
    "when the lighthouse was automated and the keeper moved to a house in the village, "
    "people asked him whether he missed the solitude. He said that he had never felt "
    "alone out there, because every light he saw on the horizon was someone who knew "
    "exactly where he was."
)

# Chapter 2.6 and benchmarks/bench_speculative.py: a chat prompt whose reply copies the prompt (prompt lookup finds
# it) and one whose reply copies nothing.
SPECULATIVE_PROMPTS = {
    "edit": "Rename the variable x to total and n to count in this Python function, and show the whole "
            "function:\n\ndef average_price(prices):\n    x = 0\n    n = 0\n    for price in prices:\n"
            "        if price > 0:\n            x = x + price\n            n = n + 1\n    if n == 0:\n"
            "        return 0\n    return x / n",
    "explain": "Explain how a rainbow forms.",
}
