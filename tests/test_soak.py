"""The soak run, short: mixed load on a tiny-model server with a small KV pool (streaming and not, chat and
completions, disconnects, abandoned requests, bad and degenerate requests), then its checks: one outcome
per request, the server's books agree, tokens equal generate() alone, every KV block free, RSS bounded; then
victims beside hostile clients: no victim loses a token, memory stays within the limits (the speed targets
are the full run's: benchmarks/soak.py prints them)."""
import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a soak run against a server

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


def load_soak():
    if "soak_script" not in sys.modules:
        spec = importlib.util.spec_from_file_location("soak_script", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["soak_script"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["soak_script"]


def test_a_short_soak_run_passes_every_check(capsys):
    soak = load_soak()
    status = soak.main(["--seconds", "20", "--requests", "60", "--concurrency", "8", "--seed", "1",
                        "--hostile-seconds", "6", "--rounds", "1"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "soak: all checks passed" in printed and "FAIL" not in printed
    assert "0 of 24 blocks used at the end" in printed
    # beside hostile clients: no victim lost a token, memory within the limits, the server still serving
    assert "hostile: all checks passed" in printed and "PASS  no victim lost or repeated a token" in printed
    assert "victims kept" in printed and "  round 1 " in printed  # the window's figures, alone and beside
    ms_per_step = [float(x) for x in printed.split("\n  round 1 ")[1].split()[6:8]]  # the engine's, alone and beside
    assert "engine ms/step" in printed and all(0.1 < ms < 100 for ms in ms_per_step), ms_per_step


def test_hostile_kinds_are_named_from_the_known_ones(capsys):
    soak = load_soak()
    assert soak.parse_args(["--kinds", "deep JSON,record poller"]).kinds == ("deep JSON", "record poller")
    with pytest.raises(SystemExit):
        soak.parse_args(["--kinds", "deep JSON,flood"])
    assert "--kinds: unknown ['flood']" in capsys.readouterr().err


def test_a_failed_check_is_a_nonzero_exit(capsys):
    """The report itself: a request without an outcome, or blocks still held, fail the run."""
    soak = load_soak()
    books = soak.Books()
    books.sent = {0, 1}
    books.record(soak.Outcome(0, "bad", "rejected", reached_engine=False))
    books.record(soak.Outcome(0, "bad", "rejected", reached_engine=False))  # twice
    idle = {"finished": 0, "aborted": 0, "failed": 0, "steps": 0, "running": 0, "waiting": 0,
            "kv_blocks_used": 0, "kv_blocks_total": 24}
    args = soak.parse_args(["--seconds", "1"])
    assert soak.report(args, books, idle, {**idle, "kv_blocks_used": 3}, 1000, 1000, 1.0, [0.01], True) == 1
    printed = capsys.readouterr().out
    assert "FAIL  every request has exactly one outcome (none lost, none twice): lost 1, recorded twice 1" in printed
    assert "FAIL  all KV blocks free" in printed and "FAIL  greedy" in printed  # nothing completed to check
