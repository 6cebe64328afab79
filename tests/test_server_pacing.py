"""The boundary's pieces without a server: the preparation worker runs the smallest job first and paces the large
ones to a share of the time, admission counts each request once, loopback names are recognised."""
from __future__ import annotations

import asyncio
import time

import pytest

from minillm.serving.limits import Admission, Preparer, is_loopback
from minillm.serving.protocol import ApiError


def test_the_smallest_waiting_job_runs_first():
    async def main():
        preparer, started = Preparer(share=1.0), []

        def job(name: str, seconds: float = 0.0):
            started.append(name)
            time.sleep(seconds)
            return name

        first = asyncio.ensure_future(preparer.run(10, job, "first", 0.2))  # holds the worker meanwhile
        await asyncio.sleep(0.05)
        rest = [preparer.run(size, job, name) for size, name in ((10**6, "big"), (10, "small"), (5000, "medium"))]
        return await asyncio.gather(first, *rest), started

    results, started = asyncio.run(main())
    assert results == ["first", "big", "small", "medium"] and started == ["first", "small", "medium", "big"]


def test_large_jobs_take_at_most_their_share_of_the_time_and_small_ones_never_wait():
    """Jobs of 0.1 s above the ``small`` size, with share 0.2: each waits 4 x 0.1 s after the one before; a
    small job sent meanwhile starts at once."""
    async def main():
        preparer, starts = Preparer(share=0.2, small=1000), {}

        def job(name: str, seconds: float):
            starts[name] = time.perf_counter()
            time.sleep(seconds)

        t0 = time.perf_counter()
        large = [asyncio.ensure_future(preparer.run(5000, job, f"large{i}", 0.1)) for i in range(3)]
        await asyncio.sleep(0.2)  # the first large job is done; the worker rests
        await preparer.run(10, job, "small", 0.0)
        small_done = time.perf_counter()
        await asyncio.gather(*large)
        return t0, starts, small_done

    t0, starts, small_done = asyncio.run(main())
    assert starts["large1"] - starts["large0"] >= 0.45 and starts["large2"] - starts["large1"] >= 0.45
    assert starts["small"] - t0 < 0.35 and small_done < starts["large1"]


def test_a_failing_job_fails_its_own_request_and_the_worker_goes_on():
    async def main():
        preparer = Preparer()

        def bad():
            raise ValueError("no such thing")

        with pytest.raises(ValueError, match="no such thing"):
            await preparer.run(1, bad)
        return await preparer.run(1, lambda: 42)

    assert asyncio.run(main()) == 42


def test_admission_counts_each_request_once_and_refuses_beyond_its_capacity():
    admission = Admission(capacity=2, retry_after=1)
    first, second = admission.admit(), admission.admit()
    with pytest.raises(ApiError) as full:
        admission.admit()
    assert full.value.status == 429 and full.value.headers == {"Retry-After": "1"}
    first.release()
    first.release()  # a second release of the same slot changes nothing
    assert admission.in_flight == 1
    third = admission.admit()
    admission.closing = True
    with pytest.raises(ApiError) as closing:
        admission.admit()
    assert closing.value.status == 503 and "shutting down" in closing.value.message
    second.release()
    third.release()
    assert admission.in_flight == 0


@pytest.mark.parametrize("host, loopback", [("localhost", True), ("LOCALHOST", True), ("127.0.0.1", True),
                                            ("127.1.2.3", True), ("::1", True), ("[::1]", True),
                                            ("0.0.0.0", False), ("evil.example", False), ("10.0.0.1", False),
                                            ("localhost.evil.example", False), ("", False)])
def test_loopback_names(host, loopback):
    assert is_loopback(host) is loopback
