"""``python -m minillm``: the generation demo, or a subcommand.

    python -m minillm [demo options]      generate, stream the text, print TTFT / TPOT (minillm.demo)
    python -m minillm serve [options]     an OpenAI-compatible HTTP server (minillm.serving.cli)
    python -m minillm bench [options]     a load generator for any OpenAI-compatible server (minillm.serving.bench)
"""
from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {"serve": "minillm.serving.cli", "bench": "minillm.serving.bench"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    from .demo import main as demo

    return demo(argv)


if __name__ == "__main__":
    sys.exit(main())
