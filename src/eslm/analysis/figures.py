"""Matplotlib figures for ``eslm report`` (PNG files, Agg backend; matplotlib imported only here, lazily).

A "series" is a dict ``{"label", "x", "mean", "lo", "hi", "n"}``: a mean curve and its band (drawn when n > 1),
optionally ``ls`` (line style) and ``color`` (the group whose colour it takes, else its label's).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

DPI = 110


def available() -> bool:
    """Whether matplotlib can be imported (the ``plot`` extra)."""
    return importlib.util.find_spec("matplotlib") is not None


def pyplot():
    """matplotlib.pyplot on the Agg backend, with mathtext off (labels and tokens from the runs: "$x$" is text)."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt

    return plt


def save(plt, fig, path: Path, rect: tuple | None = None) -> None:
    """Lay the figure out, write the PNG and close it."""
    fig.tight_layout(**({"rect": rect} if rect else {}))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _finish(plt, fig, axes, used: int, title: str, path: Path, rect: tuple | None = None) -> None:
    """Blank the axes past the first ``used``, title the figure and ``save`` it."""
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    fig.suptitle(title)
    save(plt, fig, path, rect)


def color_map(labels: list[str]) -> dict[str, str]:
    """One colour per label, never reused: tab10 up to ten labels, tab20 up to twenty, beyond that hues spaced
    by the golden angle at three lightness levels (distinct hex colours up to 988 labels)."""
    import colorsys

    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    n = len(labels)
    if n <= 20:
        cmap = colormaps["tab10" if n <= 10 else "tab20"]
        palette = [to_hex(cmap(i)) for i in range(n)]
    else:
        palette = [to_hex(colorsys.hls_to_rgb(i * 0.618033988749895 % 1.0, (0.35, 0.5, 0.65)[i % 3], 0.75))
                   for i in range(n)]
    return dict(zip(labels, palette))


def _draw_series(ax, series: list[dict], colors: dict, logx: bool, logy: bool) -> None:
    for s in series:  # the points drawable on the axes (log axes need positive values)
        idx = [i for i in range(len(s["x"])) if (not logx or s["x"][i] > 0) and (not logy or s["lo"][i] > 0)]
        if not idx:
            continue
        x = [s["x"][i] for i in idx]
        c = colors.get(s.get("color", s["label"]))  # "color": the group a series of another label belongs to
        marker = "o" if len(x) <= 60 else None  # dots on eval points; plain lines for dense train logs
        ax.plot(x, [s["mean"][i] for i in idx], color=c, ls=s.get("ls", "-"), marker=marker, ms=3, lw=1.6,
                label=s["label"])
        if s["n"] > 1:
            ax.fill_between(x, [s["lo"][i] for i in idx], [s["hi"][i] for i in idx], color=c, alpha=0.2, lw=0)
    if logx:
        ax.set_xscale("log")
        _plain_log_x(ax.xaxis)
    if logy:
        ax.set_yscale("log")
    _finish_log_y(ax, logy)  # again by the caller once it has drawn everything else (a target line, limits)
    ax.grid(True, which="both", alpha=0.3)


_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def tick_text(v: float) -> str:
    """A tick value as plain text, 10¹³ or 2×10¹³ for large and small values (matplotlib's own log labels are
    mathtext, which the figures do not parse: ``pyplot``)."""
    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    e = math.floor(math.log10(abs(v)) + 1e-9)
    if -3 <= e < 4:
        return f"{v:g}"
    m = round(v / 10 ** e, 6)
    power = "10" + str(e).translate(_SUPERSCRIPT)
    return power if m == 1 else f"{m:g}×{power}"


def _plain_log_x(axis) -> None:
    """A log x axis labelled in plain text (``tick_text``): the decades, and 2 and 5 times them when the axis
    spans at most two decades (read when the ticks are drawn)."""
    from matplotlib.ticker import FuncFormatter

    def minor(v, _):
        lo, hi = sorted(axis.get_view_interval())
        if not lo > 0 or math.log10(hi / lo) > 2:
            return ""
        mantissa = round(v / 10 ** math.floor(math.log10(v) + 1e-9))
        return tick_text(v) if mantissa in (2, 5) else ""

    axis.set_major_formatter(FuncFormatter(lambda v, _: tick_text(v)))
    axis.set_minor_formatter(FuncFormatter(minor))


def _plain_log_ticks(axis) -> None:
    """Label a log axis with plain numbers (3.5, 4) instead of 3.5x10^0, every label distinct.

    Losses usually span less than a decade, where the log locator finds only the 2..9 x 10^k minor ticks:
    between 4.05 and 5.6 that is just "4" and "5". Below a decade the ticks are therefore placed at round
    linear steps (4.2, 4.4, ...: the axis stays logarithmic, only the tick positions change), with as many
    decimals as it takes to tell neighbours apart (10.52, 10.53; never 10.5, 10.5). Over more than a decade,
    the decades are labelled, and 2 and 5 times them when the axis spans at most two decades."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter, NullLocator

    lo, hi = axis.get_view_interval()
    if not lo > 0:
        return
    if hi / lo < 10:
        locator = MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10], min_n_ticks=3)
        ticks = [t for t in locator.tick_values(lo, hi) if lo <= t <= hi]
        decimals = next(d for d in range(12) if len({f"{t:.{d}f}" for t in ticks}) == len(ticks))
        axis.set_major_locator(locator)
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.{decimals}f}"))
        axis.set_minor_locator(NullLocator())
        axis.set_minor_formatter(NullFormatter())
        return
    axis.set_major_locator(LogLocator(base=10))
    axis.set_minor_locator(LogLocator(base=10, subs=tuple(range(2, 10))))
    _plain_log_x(axis)


def _finish_log_y(ax, logy: bool, fit: bool = True) -> None:
    """After everything is drawn (a target line included): a log y axis's ticks and, with ``fit``, its limits
    from the data drawn with a 5% margin; a single value (one evaluation, a flat curve) gets +-1% around it
    instead of matplotlib's decade on each side (an axis of 9 to 110)."""
    if not logy:
        return
    lo, hi = ax.dataLim.intervaly
    if fit and 0 < lo <= hi < math.inf:
        if hi / lo < 1.001:
            lo, hi = lo / 1.01, hi * 1.01
        pad = (hi / lo) ** 0.05
        ax.set_ylim(lo / pad, hi * pad)
    _plain_log_ticks(ax.yaxis)


def curves(path: Path, series: list[dict], colors: dict, *, xlabel: str, ylabel: str, title: str,
           logx: bool, logy: bool, hline: float | None = None) -> None:
    """Mean curves with min-max bands; optional dashed horizontal line (the target loss)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _draw_series(ax, series, colors, logx, logy)
    if hline is not None:
        ax.axhline(hline, color="k", ls="--", lw=1, label=f"target {hline:.4g}")
    _finish_log_y(ax, logy)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    save(plt, fig, path)


def panels(path: Path, panel_series: dict[str, list[dict]], colors: dict, *, xlabel: str, ylabel: str,
           title: str, logx: bool, logy: bool, ylim: tuple | None = None, hline: float | None = None) -> None:
    """Small multiples: one axis per key of ``panel_series`` (e.g. one per domain), shared legend; ``hline``: a
    solid horizontal line on every axis (the zero of paired differences)."""
    plt = pyplot()
    n = len(panel_series)
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    n_legend = len({s["label"] for s in next(iter(panel_series.values()))})  # the legend is the first panel's
    ncol = min(4, max(1, n_legend))
    legend_in = 0.15 + 0.2 * -(-n_legend // ncol)  # inches below the panels: one line per legend row
    height = 3.2 * rows + legend_in
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, height), squeeze=False, sharex=True)
    for ax, (name, series) in zip(axes.flat, panel_series.items()):
        if hline is not None:
            ax.axhline(hline, color="k", lw=1)
        _draw_series(ax, series, colors, logx, logy)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.xaxis.set_tick_params(labelbottom=True)  # shared x, but every panel keeps its labels
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(which="both", labelsize=7)  # minor labels too (log axes label minor ticks)
        if ylim is not None:
            ax.set_ylim(*ylim)
        _finish_log_y(ax, logy, fit=ylim is None)
    handles, labels = list(axes.flat)[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
    # the legend's rows get their own strip under the panels, so many labels never cover an x-axis label
    _finish(plt, fig, axes, n, title, path, rect=(0, legend_in / height, 1, 1))


def target_bars(path: Path, bars: list[dict], colors: dict, *, ylabel: str, title: str) -> None:
    """One bar per group: ``{"label", "mean", "lo", "hi", "reached", "n"}``; the whisker is min..max, and a
    target not (or partly) reached is drawn as docs/report.md says (never a zero bar)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(bars) + 2), 4.5))
    top = max([b["hi"] for b in bars if b["reached"]] or [1.0])
    for i, b in enumerate(bars):
        if not b["reached"]:
            ax.text(i, top * 0.03, "not\nreached", ha="center", va="bottom", fontsize=9, color="0.3",
                    bbox={"boxstyle": "round", "fc": "white", "ec": "0.6", "ls": "--"})
            continue
        partial = b["reached"] < b["n"]
        ax.bar(i, b["mean"], color=colors.get(b["label"]), hatch="//" if partial else None,
               edgecolor="k" if partial else None)
        if b["reached"] > 1:
            ax.errorbar(i, b["mean"], yerr=[[b["mean"] - b["lo"]], [b["hi"] - b["mean"]]], color="k", capsize=4)
        note = f"{b['mean']:.3g}" + (f"\n{b['reached']}/{b['n']} reached" if partial else
                                      f"\nmean of {b['n']}" if b["n"] > 1 else "")
        ax.text(i, b["hi"], note, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([b["label"] for b in bars], rotation=20, ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(bars) - 0.4)
    ax.set_ylim(0, top * 1.18)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    save(plt, fig, path)


def category_points(path: Path, categories: list[str], values: dict[str, list], colors: dict, *,
                    ylabel: str, title: str, spread: dict[str, list] | None = None) -> dict[str, tuple]:
    """One panel per category (e.g. domain) with one point per group, each panel on its own y range.

    Domains can differ by several nats while methods differ by hundredths within a domain: a shared axis (or
    bars, which need a zero baseline) hides exactly the differences the chart is for. Points carry their
    value; ``spread[label][i] = (lo, hi)`` draws a min..max whisker (several seeds). ``values[label][i]``
    may be None (no point). Returns {category: (ymin, ymax)} of the panels drawn.
    """
    plt = pyplot()
    labels = list(values)
    n = len(categories)
    cols = min(4, max(1, n))
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(max(3.2, 0.55 * len(labels) + 1.6) * cols, 3.3 * rows),
                             squeeze=False)
    limits = {}
    for i, (ax, cat) in enumerate(zip(axes.flat, categories)):
        vs = []  # every value and whisker end drawn: the panel's y range
        for j, lab in enumerate(labels):
            if (v := values[lab][i]) is None:
                continue
            sp = (spread or {}).get(lab)
            sp = sp[i] if sp else None
            if sp is not None:
                ax.errorbar(j, v, yerr=[[v - sp[0]], [sp[1] - v]], color=colors.get(lab), capsize=3, lw=1)
            ax.plot(j, v, "o", ms=7, color=colors.get(lab), label=lab)
            ax.annotate(f"{v:.3f}", (j, v), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7)
            vs += [v, *(sp or ())]
        if vs:
            lo, hi = min(vs), max(vs)
            pad = 0.25 * (hi - lo) if hi > lo else 0.05 * abs(hi) + 0.01
            ax.set_ylim(lo - pad, hi + 1.6 * pad)
            limits[cat] = ax.get_ylim()
        ax.set_title(cat, fontsize=10)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=7)
        ax.set_xlim(-0.6, len(labels) - 0.4)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(True, axis="y", alpha=0.3)
        if i % cols == 0:
            ax.set_ylabel(ylabel, fontsize=8)
    _finish(plt, fig, axes, n, title, path)
    return limits
