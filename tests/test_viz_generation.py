"""The generation plots: the nucleus they mark is the one the sampler keeps; the decode-share plot draws
the share of positions and the requests where they are."""
import matplotlib
import numpy as np
import pytest
import torch

from minillm import SamplingParams, filtered_probs
from minillm.book.viz.generation import draw_decode_share, draw_nucleus, nucleus_size

matplotlib.use("Agg")


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
def test_nucleus_size_is_what_top_p_sampling_keeps(temperature, top_p):
    logits = torch.randn(1, 5000, generator=torch.Generator().manual_seed(3)) * 3  # (1, V)
    probs = torch.softmax(logits[0] / temperature, dim=-1)  # (V,)
    kept = int((filtered_probs(logits, SamplingParams(temperature=temperature, top_p=top_p)) > 0).sum())
    assert nucleus_size(probs, top_p) == kept


def test_nucleus_size_of_a_known_distribution():
    probs = torch.tensor([0.05, 0.5, 0.3, 0.15])
    assert nucleus_size(probs, 0.5) == 1  # 0.5 alone reaches it
    assert nucleus_size(probs, 0.8) == 2  # 0.5 + 0.3
    assert nucleus_size(probs, 0.81) == 3
    assert nucleus_size(probs, 1.0) == 4
    with pytest.raises(ValueError, match="one distribution"):
        nucleus_size(probs[None], 0.5)
    with pytest.raises(ValueError, match="top_p=1.5"):
        nucleus_size(probs, 1.5)


def test_nucleus_plot_marks_where_top_p_stops_over_every_rank():
    logits = torch.randn(2000, generator=torch.Generator().manual_seed(1)) * 4  # (V,)
    probs = {"τ = 1.0": torch.softmax(logits, -1), "τ = 1.6": torch.softmax(logits / 1.6, -1)}
    ax = draw_nucleus(probs, top_p=0.9, top_k=10, title="Figure 5: test")
    lines = {line.get_gid(): line for line in ax.get_lines()}
    texts = [t.get_text() for t in ax.texts]
    for label, p in probs.items():
        ranks, mass = lines[f"mass-{label}"].get_data()
        assert ranks[0] == 1 and ranks[-1] == 2000  # every rank of the vocabulary
        assert np.all(np.diff(mass) >= 0) and mass[-1] == pytest.approx(1.0)
        kept = nucleus_size(p, 0.9)
        assert lines[f"nucleus-{label}"].get_data()[0][0] == kept
        assert mass[kept - 1] >= 0.9 and (kept == 1 or mass[kept - 2] < 0.9)
        assert f"top-p 0.9 keeps {kept:,}" in texts
    assert nucleus_size(probs["τ = 1.6"], 0.9) > nucleus_size(probs["τ = 1.0"], 0.9)
    assert ax.get_xscale() == "log" and ax.get_xlim() == (1, 2000)
    assert ax.get_title() == "Figure 5: test" and "rank" in ax.get_xlabel()
    matplotlib.pyplot.close("all")


def test_decode_share_plot_draws_the_positions_share_and_the_marks():
    x = np.geomspace(0.01, 10, 20)
    curves = {"model A": (x, 1 / (1 + x) - 0.001), "model B": (x, 1 / (1 + x))}
    ax = draw_decode_share(curves, {"request": (4 / 199, 0.9805)}, threshold=0.98, title="Figure 7: t")
    lines = {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}
    gx, gy = lines["positions"].get_data()
    assert np.allclose(gy, 100 / (1 + gx))
    assert (gx.min(), gx.max()) == pytest.approx((0.01, 10))  # spans the curves and the marks
    assert lines["mark-request"].get_data() == ([4 / 199], [98.05])
    verticals = [line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == ":"
                 and len(set(line.get_xdata())) == 1]
    assert pytest.approx(1 / 49) in verticals  # the share reaches 98% at T / (N - 1) = 1/49
    assert ax.get_title() == "Figure 7: t" and "%" in ax.get_ylabel()
    matplotlib.pyplot.close("all")
