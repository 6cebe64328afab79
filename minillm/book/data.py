"""Data the chapters quote: an A100's datasheet figures, a benchmark run, the passage the precision chapter scores,
the prompts of the speculative-decoding chapter."""

A100_PEAK_FLOPS = 312e12  # FLOP/s: dense float16/bfloat16 on the tensor cores
A100_BANDWIDTH = 2.039e12  # bytes/s: HBM2e
A100_MEMORY = 80 * 2**30  # bytes: sold as "80GB", it holds 80 GiB (nvidia-smi: 81,920 MiB)

# The benchmarks/bench_peers.py run that README.md prints in full, against llama.cpp built for the CPU: chapter 2.5
# quotes it where llama-cpp-python is not installed. Each row is (contender) -> its columns at 1 thread, and at 2
# threads under "2 threads" (tests/test_bench_peers.py holds every row equal to the README's).
BENCH_PEERS_RUN = {
    "machine": "a 2-core AMD EPYC VM (AVX-512 VNNI)",
    "int4 compiled": {"tokens/s": 184.6, "ms/token": 5.42, "vs llama.cpp": 1.22, "MB/token": 100.0},
    "int4 eager": {"tokens/s": 128.9, "ms/token": 7.76, "vs llama.cpp": 0.85, "MB/token": 100.0},
    "llama.cpp": {"tokens/s": 151.1, "ms/token": 6.62, "vs llama.cpp": 1.00, "MB/token": 98.3},
    "2 threads": {
        "int4 compiled": {"tokens/s": 216.1, "ms/token": 4.63, "vs llama.cpp": 1.24, "MB/token": 100.0},
        "int4 eager": {"tokens/s": 144.1, "ms/token": 6.94, "vs llama.cpp": 0.83, "MB/token": 100.0},
        "llama.cpp": {"tokens/s": 174.5, "ms/token": 5.73, "vs llama.cpp": 1.00, "MB/token": 98.3},
    },
}

# The benchmarks/profile_step.py run at one thread that README.md prints in full (tests/test_bench_peers.py holds
# these equal to its rows): ms a decode step, each step as it runs and its parts, instrumented.
PROFILE_STEP_RUN = {
    "machine": "the same VM, 1 thread",
    "step ms": {"int4 compiled": 5.212, "llama.cpp": 6.793},
    "parts": {
        "int4 compiled": {"matmuls": 3.264, "attention": 1.068, "fused element-wise": 0.066, "sampling": 0.042,
                          "wrapper (Python)": 1.193, "guards (dynamo)": 0.079, "Python in the loop": 0.012},
        "llama.cpp": {"matmuls": 5.622, "attention": 0.321, "rotary": 0.060, "cache writes, copies": 0.068,
                      "norms": 0.120, "SwiGLU": 0.028, "residual adds": 0.042, "embedding": 0.004,
                      "outside llama_decode": 0.078},
    },
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
