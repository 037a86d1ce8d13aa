"""Report figures: the log loss axis is fitted to the data and its tick labels are distinct and readable."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from eslm.analysis import figures  # noqa: E402


def _series(ys, label="a", x0=1e9):
    xs = [x0 * 2 ** i for i in range(len(ys))]
    return {"label": label, "x": xs, "mean": list(ys), "lo": [y - 0.002 for y in ys], "hi": [y + 0.002 for y in ys],
            "n": 2}


def _y_labels(fig) -> tuple[tuple[float, float], list[str]]:
    """(y limits, the visible y tick labels) of the figure's first axes, as drawn."""
    ax = fig.axes[0]
    fig.canvas.draw()
    lo, hi = ax.get_ylim()
    ticks = list(ax.yaxis.get_major_ticks()) + list(ax.yaxis.get_minor_ticks())
    labels = [t.label1.get_text() for t in ticks if t.label1.get_visible() and t.label1.get_text()
              and lo <= t.get_loc() <= hi]
    return (lo, hi), labels


@pytest.fixture
def kept_figures(monkeypatch):
    """The figures the functions under test close, kept open for inspection."""
    plt = figures.pyplot()
    close, kept = plt.close, []
    monkeypatch.setattr(plt, "close", kept.append)
    yield kept
    for fig in kept:
        close(fig)


@pytest.mark.parametrize("ys", [(10.78, 10.7, 10.6, 10.52),  # an untrained GPT-2-vocabulary run: 10.5..10.8
                                (4.004, 4.003, 4.002, 4.001),  # a hair's width
                                (11.5, 10.4, 9.2),  # across a power of ten
                                (5.6, 4.5, 4.05)])
def test_narrow_loss_ranges_get_distinct_labels(ys, kept_figures, tmp_path):
    figures.curves(tmp_path / "c.png", [_series(ys), _series([y + 0.01 for y in ys], "b")], {}, xlabel="FLOPs",
                   ylabel="loss", title="t", logx=True, logy=True, hline=ys[-2])
    (lo, hi), labels = _y_labels(kept_figures[0])
    assert len(labels) >= 3 and len(set(labels)) == len(labels), labels
    assert lo > min(ys) * 0.98 and hi < max(ys) * 1.02 + 0.01  # fitted to the data, not widened to decades
    assert all("times" not in lab and "^" not in lab for lab in labels)  # plain numbers


def test_a_single_evaluation_is_not_drawn_on_a_decades_wide_axis(kept_figures, tmp_path):
    one = {"label": "a", "x": [1e9], "mean": [10.5], "lo": [10.5], "hi": [10.5], "n": 1}
    figures.curves(tmp_path / "c.png", [one], {}, xlabel="FLOPs", ylabel="loss", title="t", logx=True, logy=True,
                   hline=10.5)
    (lo, hi), labels = _y_labels(kept_figures[0])
    assert 10.3 < lo < 10.5 < hi < 10.7, (lo, hi)  # matplotlib alone: 8.9 to 112
    assert len(labels) >= 3 and len(set(labels)) == len(labels)


def test_wide_ranges_label_decades_without_crowding(kept_figures, tmp_path):
    figures.curves(tmp_path / "c.png", [_series([40.0, 20.0, 9.0, 3.0])], {}, xlabel="FLOPs", ylabel="loss",
                   title="t", logx=True, logy=True)
    _, labels = _y_labels(kept_figures[0])
    assert "10" in labels and len(set(labels)) == len(labels) and len(labels) <= 5, labels


def test_panels_fit_each_log_axis(kept_figures, tmp_path):
    figures.panels(tmp_path / "p.png", {"web": [_series((10.78, 10.6, 10.52))], "code": [_series((3.3, 3.2, 3.1))]},
                   {}, xlabel="FLOPs", ylabel="loss", title="t", logx=True, logy=True)
    fig = kept_figures[0]
    fig.canvas.draw()
    for ax, (a, b) in zip(fig.axes, [(10.5, 10.8), (3.09, 3.31)]):
        lo, hi = ax.get_ylim()
        labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text() and lo <= t.get_position()[1] <= hi]
        assert lo > a * 0.98 and hi < b * 1.02 and len(labels) >= 3 and len(set(labels)) == len(labels), labels


@pytest.mark.parametrize("n_lines", [2, 14])
def test_panels_legend_never_covers_an_axis_label(kept_figures, tmp_path, n_lines):
    """Many lines (Ada's alpha of every seed) make a legend of several rows: it sits below every panel's x-axis
    label and tick labels, never on them."""
    series = [_series((0.1, 0.12, 0.14), label=f"seed {i}") for i in range(n_lines)]
    figures.panels(tmp_path / "p.png", {"ada": series}, {}, xlabel="optimizer step", ylabel="alpha",
                   title="t", logx=False, logy=False)
    fig = kept_figures[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    ax = fig.axes[0]
    texts = [ax.xaxis.label] + [t for t in ax.get_xticklabels() if t.get_text()]
    for t in texts:
        box = t.get_window_extent(renderer)
        assert legend.y1 <= box.y0, (t.get_text(), legend, box)
    assert legend.y0 >= 0, legend  # and the legend is inside the figure


def test_log_x_ticks_are_plain_text_not_unparsed_mathtext():
    # the figures do not parse mathtext (labels come from configs), so matplotlib's own log labels
    # ("$\mathdefault{10^{13}}$") showed raw on a FLOPs axis: the log x axis is labelled in plain text
    pytest.importorskip("matplotlib")
    assert [figures.tick_text(v) for v in (1e13, 2e13, 5e-5, 0.5, 3.0, 1e4, 2000.0)] == \
        ["10¹³", "2×10¹³", "5×10⁻⁵", "0.5", "3", "10⁴", "2000"]
    plt = figures.pyplot()
    fig, ax = plt.subplots()
    s = {"label": "g", "n": 2, "x": [1e13, 4e13, 1.6e14], "mean": [5.0, 4.0, 3.5], "lo": [4.9, 3.9, 3.4],
         "hi": [5.1, 4.1, 3.6]}
    figures._draw_series(ax, [s], {}, logx=True, logy=False)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels() + ax.get_xticklabels(minor=True) if t.get_text()]
    plt.close(fig)
    assert labels and not any("$" in x for x in labels) and "10¹³" in labels and "10¹⁴" in labels, labels
