"""Request timelines: the marks equal minillm.analysis.metrics, and the figure draws them where they belong."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pytest

from minillm.analysis.metrics import RequestTiming
from minillm.book.viz.timeline import draw_request, draw_requests, timeline_marks

# Arrives at 0.1 s, waits until 0.3 s, first token at 0.5 s, then gaps of 50, 150 and 100 ms.
REQUEST = RequestTiming(arrival_time=0.1, token_times=[0.5, 0.55, 0.7, 0.8], prompt_len=12)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_marks_are_the_metrics_of_the_request():
    m = timeline_marks(REQUEST, admitted=0.3)
    assert m.arrival == 0.1 and m.admitted == 0.3
    assert m.token_times[0] == 0.5 and m.finish == 0.8
    assert m.ttft == pytest.approx(0.4)
    assert m.e2e == pytest.approx(0.7)
    assert m.itls == pytest.approx((0.05, 0.15, 0.1))
    assert m.tpot == pytest.approx(0.1)  # (0.8 - 0.5) / 3 gaps


def test_one_token_request_has_no_tpot():
    m = timeline_marks(RequestTiming(0.0, [0.2]))
    assert m.tpot is None and m.itls == () and m.ttft == m.e2e == pytest.approx(0.2)


@pytest.mark.parametrize("admitted", [0.05, 0.6])
def test_admission_outside_arrival_and_first_token_is_rejected(admitted):
    with pytest.raises(ValueError, match=f"admitted={admitted} s must lie between"):
        timeline_marks(REQUEST, admitted=admitted)


def test_request_without_tokens_is_rejected():
    with pytest.raises(ValueError, match="at least 1 output token"):
        timeline_marks(RequestTiming(0.0, []))
    with pytest.raises(ValueError, match="at least one request"):
        draw_requests([])


def test_draw_request_places_every_token_and_labels_the_latencies():
    ax = draw_request(REQUEST, admitted=0.3, token_labels=["The", " sky", " is", " blue"])
    ticks = next(c for c in ax.collections if c.get_gid() == "tokens")
    xs = [segment[0][0] for segment in ticks.get_segments()]
    assert xs == pytest.approx([500, 550, 700, 800])  # ms
    texts = _texts(ax)
    assert "TTFT 400 ms" in texts and "E2E 700 ms" in texts
    assert "ITL 150 ms" in texts  # the longest gap is the one marked
    assert "TPOT = mean of the 3 gaps = 100.0 ms" in texts
    assert [" sky", " blue"] == [t for t in texts if t in (" sky", " blue")]
    bars = {p.get_label(): p for p in ax.containers}
    assert bars["waiting in the queue"][0].get_x() == pytest.approx(100)
    assert bars["waiting in the queue"][0].get_width() == pytest.approx(200)
    assert bars["prefill"][0].get_x() == pytest.approx(300)
    assert bars["prefill"][0].get_width() == pytest.approx(200)
    assert ax.get_xlim()[0] < 100  # the arrival marker is not cut by the axis


def test_draw_request_without_admission_draws_ttft_as_one_bar():
    ax = draw_request(REQUEST)
    labels = [c.get_label() for c in ax.containers]
    assert "waiting in the queue" not in labels
    prefill = next(c for c in ax.containers if c.get_label() == "prefill")[0]
    assert (prefill.get_x(), prefill.get_width()) == pytest.approx((100, 400))


def test_draw_request_rejects_a_label_count_that_does_not_match():
    with pytest.raises(ValueError, match="3 token labels for 4 tokens"):
        draw_request(REQUEST, token_labels=["a", "b", "c"])


def test_draw_requests_draws_one_row_per_request():
    other = RequestTiming(arrival_time=0.0, token_times=[0.2, 0.25], prompt_len=3)
    ax = draw_requests([REQUEST, other])
    for i, r in enumerate((REQUEST, other)):
        ticks = next(c for c in ax.collections if c.get_gid() == f"tokens-{i}")
        segments = ticks.get_segments()
        assert [s[0][0] for s in segments] == pytest.approx(np.array(r.token_times) * 1e3)
        assert all(s[0][1] < i < s[1][1] for s in segments)  # drawn on row i
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1"]
