"""The plots of ``bench/results.json`` that docs/performance.md shows, drawn by ``python -m bench.report --write``.

- ``docs/img/bench-ratios.svg``: every judged comparison's time ratio devshim / peer with its 95% interval,
  against its own target, one panel per benchmark group. The verdict is given by marker, colour and text;
  informational rows are not drawn (they are not targets).
- ``docs/img/bench-attention.svg``: attention time per call, forward+backward and forward alone, and the bytes
  autograd holds for the backward, and the peak memory of one forward+backward (both what
  :mod:`bench.attention` measures), against sequence length.

matplotlib is imported only to draw (:func:`write`): ``python -m bench`` and the Markdown tables do not need it.
The SVGs are deterministic (fixed hash salt, no date, text kept as text with matplotlib's bundled font metrics),
so the same results file and matplotlib version always give the same bytes, and a stale plot shows in a diff.
"""

from __future__ import annotations

import io
import itertools
import math
import pathlib
import re
import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# the one named in requirements-dev.txt: another version draws (slightly) different bytes
MATPLOTLIB_PIN = "matplotlib==3.11.2"
IMG = pathlib.Path(__file__).resolve().parent.parent / "docs" / "img"
RATIOS, ATTENTION = "bench-ratios.svg", "bench-attention.svg"

# every rcParam that reaches the file is pinned here, on top of matplotlib's defaults (a user's matplotlibrc is
# ignored); svg.fonttype "none" keeps text as <text>, searchable and small
_RC: dict[str, Any] = {"svg.hashsalt": "devshim-bench", "svg.fonttype": "none", "font.family": "DejaVu Sans",
                       "font.size": 8, "axes.titlesize": 9, "axes.titleweight": "bold"}
_SVG_METADATA = {"Date": None}  # no timestamp: rerunning on the same results gives the same bytes

# Okabe-Ito colours (told apart with colour vision deficiencies), and each verdict has its own marker and word
_VERDICT_STYLE: dict[str, dict[str, Any]] = {
    "met": {"marker": "o", "color": "#009E73", "markerfacecolor": "#009E73"},
    "missed": {"marker": "X", "color": "#D55E00", "markerfacecolor": "#D55E00"},
    "inconclusive": {"marker": "D", "color": "#0072B2", "markerfacecolor": "white"},
}
_WIDTH = 8.5  # inches: shown at about its size on a docs page, where 7 pt text stays legible
_ROW_INCHES = 0.165  # one label line
_LABEL_WIDTH = 60  # characters per label line
_TITLE_WIDTH = 120
_LEFT, _RIGHT = 3.2, 2.0  # inches for the labels at the left and the figures at the right

# bench/attention.py's names for its contenders and cases (not imported: it needs torch)
_SDPA, _MEGATRON = "raw SDPA (BNSD)", "Megatron DotProductAttention"
# the fp32 multi-head cases only: bf16 and GQA cases (" 2kv") would overwrite their panels' points
_CASE = re.compile(r"^causal fp32 s=(?P<seq>\d+) d=(?P<head_dim>\d+) (?P<batch>\d+)x(?P<heads>\d+)h "
                   r"(?P<mode>fwd\+bwd|fwd)$")
_DEVSHIM_LAYOUT = re.compile(r"^devshim attention \((?P<layout>\w+)\)$")
_CONTENDER_STYLE: dict[str, dict[str, Any]] = {  # colour, marker and line style: three cues, not one
    "devshim": {"color": "#0072B2", "marker": "o", "linestyle": "-"},
    _SDPA: {"color": "#E69F00", "marker": "s", "linestyle": "--"},
    _MEGATRON: {"color": "#CC79A7", "marker": "^", "linestyle": ":"},
}
_MODES = {"fwd+bwd": "forward+backward", "fwd": "forward only (no_grad)"}
_MEMORIES = {"saved": "bytes held for backward", "peak": "peak, forward+backward"}


def judged_by_group(document: dict) -> dict[str, list[dict]]:
    """The judged comparisons, per group in the order the groups ran: what the ratio plot draws."""
    judged = [r for r in document["comparisons"] if r["judged"]]
    return {g: [r for r in judged if r["group"] == g] for g in dict.fromkeys(r["group"] for r in judged)}


def attention_series(document: dict) -> dict[tuple[int, int], dict[str, Any]]:
    """Per (head dim, heads) of the attention group: ``time[mode][contender][seq]`` in seconds (each
    contender's geometric mean over the rounds), ``saved[contender][seq]`` in bytes held for backward and
    ``peak[contender][seq]`` in bytes at the peak of one forward+backward.

    Only what the rows record; a contender or length missing from the results is missing here too.
    """
    series: dict[tuple[int, int], dict[str, Any]] = {}
    for row in document["comparisons"]:
        case = _CASE.search(row["case"]) if row["group"] == "attention" else None
        if case is None:
            continue
        panel = series.setdefault((int(case["head_dim"]), int(case["heads"])), {"time": {}, "saved": {}, "peak": {}})
        seq, times = int(case["seq"]), panel["time"].setdefault(case["mode"], {})
        for who, seconds, side in ((row["subject"], row["subject_seconds"], "subject"),
                                   (row["peer"], row["peer_seconds"], "peer")):
            times.setdefault(who, {})[seq] = seconds
            for memory in ("saved", "peak"):
                if f"{side}_{memory}_bytes" in row["details"]:
                    panel[memory].setdefault(who, {})[seq] = row["details"][f"{side}_{memory}_bytes"]
    return dict(sorted(series.items()))


def plots(document: dict) -> dict[str, str]:
    """File name -> alt text of the plots this results file has data for (no matplotlib needed)."""
    found = {}
    groups = judged_by_group(document)
    if groups:
        found[RATIOS] = (f"Time ratio devshim / peer, log scale, with its 95% interval, for each of the "
                         f"{sum(map(len, groups.values()))} judged comparisons, grouped by benchmark: a bar marks "
                         f"each comparison's target (largest acceptable ratio), and marker, colour and the "
                         f"text at the right give the verdict (met, missed, inconclusive)")
    if attention_series(document):
        found[ATTENTION] = ("Causal attention against sequence length, per head dimension: time per call for "
                            "forward+backward and for the forward alone, bytes held for the backward and the peak "
                            "memory of one forward+backward, for devshim's kernel (each layout), raw SDPA and "
                            "Megatron's unfused DotProductAttention")
    return found


def image(name: str, alt: str) -> str:
    """The Markdown image of plot ``name``, relative to docs/performance.md."""
    return f"![{alt}](img/{name})"


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit(f"python -m bench.report --write draws the plots in docs/img with matplotlib, which is "
                         f"not installed: pip install {MATPLOTLIB_PIN} (pinned in requirements-dev.txt)") from error
    import matplotlib.style

    matplotlib.use("Agg")  # headless, whatever the environment asks for
    return matplotlib


def _text(s: str) -> str:
    return s.replace("$", r"\$")  # a lone $ pair would otherwise be read as mathtext


@dataclass(frozen=True)
class _Line:
    """One line of a ratio panel: a case's heading, or a comparison (``row``) with its label and the heading
    it stands under, if any."""

    text: str
    row: dict | None = None
    heading: str = ""


def _panel_lines(group: str, rows: list[dict]) -> tuple[str, list[_Line]]:
    """A group's panel title, naming what all its rows share, and its lines: a case compared with several
    peers or in several layouts is a heading over one line per comparison, a case with one comparison a line."""
    subjects, peers = {r["subject"] for r in rows}, {r["peer"] for r in rows}
    all_kernel = all(r["kernel_only"] for r in rows)
    title = group + (" (kernel only)" if all_kernel else "")
    if len(subjects) == len(peers) == 1:
        title += f": {rows[0]['subject']} vs {rows[0]['peer']}"
    elif len(subjects) == 1:
        title += f": {rows[0]['subject']} vs each peer named"
    elif len(peers) == 1:
        title += f": each vs {rows[0]['peer']}"

    def own(r: dict) -> str:  # what tells this row from the others of its case
        return (r["peer"] if len(subjects) == 1 else r["subject"] if len(peers) == 1 else
                f"{r['subject']} vs {r['peer']}")

    def wrap(text: str) -> list[str]:
        return textwrap.wrap(text, _LABEL_WIDTH, break_on_hyphens=False)

    lines: list[_Line] = []
    for case, run in itertools.groupby(rows, key=lambda r: r["case"]):
        run = list(run)
        case += " (kernel only)" if run[0]["kernel_only"] and not all_kernel else ""
        if len(run) == 1:
            text = case if len(subjects) == len(peers) == 1 else f"{case} · {own(run[0])}"
            lines.append(_Line("\n".join(wrap(text)), run[0]))
        else:
            heading = "\n".join(wrap(case))
            lines.append(_Line(heading))
            lines += [_Line("\n".join(wrap(own(r))), r, heading) for r in run]
    return title, lines


def interval_text(row: dict) -> str:
    """The right-hand column of a row of the ratio plot: the figures and the verdict, in words."""
    return f"{row['ratio']:.3f}× ({row['ci_low']:.3f}-{row['ci_high']:.3f})  {row['verdict']}"


def _x_limits(groups: dict[str, list[dict]]) -> tuple[float, float]:
    """Every ratio and target on scale, and every interval end within 4x of its ratio; a wilder end (a noisy
    row, or a smoke run's unbounded interval) is cut at the edge and marked so."""
    values = [v for rows in groups.values() for r in rows for v in (r["ratio"], r["max_ratio"], r["ci_low"],
              r["ci_high"]) if 0 < v < math.inf and r["ratio"] / 4 <= v <= r["ratio"] * 4]
    return min(values) / 1.2, max(values) * 1.2


def _ratio_panel(ax: Axes, lines: list[_Line], x_limits: tuple[float, float]) -> None:
    lo, hi = x_limits
    heights = [line.text.count("\n") + 1 for line in lines]
    # each line's centre, top to bottom, a wrapped label taking as many line heights as it has lines
    ys = [sum(heights[:i]) + h / 2 for i, h in enumerate(heights)]
    ax.axvline(1.0, color="#888888", linewidth=0.8, linestyle="--", zorder=1)
    for y, line in zip(ys, lines, strict=True):
        r = line.row
        if r is None:
            continue
        style = _VERDICT_STYLE[r["verdict"]]
        ax.plot([max(r["ci_low"], lo), min(r["ci_high"], hi)], [y, y], color=style["color"], linewidth=1.4,
                solid_capstyle="butt", zorder=2)
        if r["ci_low"] < lo:
            ax.plot([lo], [y], marker="<", color=style["color"], markersize=4, clip_on=False, zorder=3)
        if r["ci_high"] > hi:
            ax.plot([hi], [y], marker=">", color=style["color"], markersize=4, clip_on=False, zorder=3)
        ax.plot([r["max_ratio"]], [y], marker="|", color="black", markersize=9, markeredgewidth=1.5, zorder=3)
        ax.plot([r["ratio"]], [y], linestyle="none", markersize=5, markeredgewidth=1.1, zorder=4, **style)
        # the figures and the verdict in words at the right edge: the verdict never rests on colour alone
        ax.annotate(interval_text(r), (1, y), xycoords=("axes fraction", "data"), xytext=(6, 0),
                    textcoords="offset points", va="center", fontsize=7, color=style["color"],
                    fontweight="bold" if r["verdict"] == "missed" else "normal", annotation_clip=False)
    ax.set_ylim(sum(heights), 0)  # first line at the top
    ax.set_yticks(ys, [_text(line.text) for line in lines], fontsize=7)
    for tick, line in zip(ax.get_yticklabels(), lines, strict=True):
        if line.row is None:  # a heading
            tick.set_fontweight("bold")
    ax.tick_params(axis="y", length=0)
    ax.grid(axis="x", which="both", color="#eeeeee", linewidth=0.6, zorder=0)
    ax.set_axisbelow(True)


def draw_ratios(document: dict) -> tuple[Figure, list[tuple[str, ...]]]:
    """The ratio plot, and for every comparison drawn (one per judged comparison, panels in order) the text
    lines that name it: its case's heading, if it has one, and its own label."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    groups = judged_by_group(document)
    panels = [_panel_lines(g, rows) for g, rows in groups.items()]
    titles = [textwrap.wrap(title, _TITLE_WIDTH, subsequent_indent="    ") for title, _ in panels]
    lines = [sum(line.text.count("\n") + 1 for line in panel) for _, panel in panels]
    # laid out by hand, in inches from the top: constrained layout leaves out the figures at the right of each
    # panel, and a fixed layout keeps every line the same height in every panel
    heading, title_line, gap, ticks, axis_label = 1.05, 0.15, 0.08, 0.3, 0.35
    height = heading + axis_label + sum(len(t) * title_line + gap + n * _ROW_INCHES + ticks
                                        for t, n in zip(titles, lines, strict=True))
    fig = Figure(figsize=(_WIDTH, height))
    left, width = _LEFT / _WIDTH, 1 - (_LEFT + _RIGHT) / _WIDTH
    x_limits = _x_limits(groups)
    drawn: list[tuple[str, ...]] = []
    axes: list[Axes] = []
    top = heading
    for (_, panel), title, n in zip(panels, titles, lines, strict=True):
        top += len(title) * title_line + gap
        # the group's title from the figure's left edge, over the labels too: a long one needs the width
        fig.text(0.1 / _WIDTH, 1 - (top - 0.05) / height, _text("\n".join(title)), va="bottom", fontsize=8,
                 fontweight="bold")
        ax = fig.add_axes((left, 1 - (top + n * _ROW_INCHES) / height, width, n * _ROW_INCHES / height),
                          sharex=axes[0] if axes else None)
        top += n * _ROW_INCHES + ticks
        axes.append(ax)
        _ratio_panel(ax, panel, x_limits)
        ax.tick_params(axis="x", labelbottom=True, labelsize=7, pad=2)  # a tall figure: each panel keeps its scale
        drawn += [tuple(filter(None, f"{line.heading}\n{line.text}".split("\n"))) for line in panel if line.row]
    ax = axes[0]
    ax.set_xscale("log")
    ax.set_xlim(*x_limits)
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    axes[-1].set_xlabel("time ratio devshim / peer: geometric mean of the paired rounds (log scale; below 1×: "
                        "devshim faster)", fontsize=8)
    meanings = ("the whole interval at or below the target", "the whole interval above the target",
                "the interval straddles the target")
    legend = [Line2D([], [], linestyle="none", markersize=6, label=f"{verdict}: {meaning}", **style)
              for (verdict, style), meaning in zip(_VERDICT_STYLE.items(), meanings, strict=True)]
    legend += [Line2D([], [], color="#555555", linewidth=1.4, label="95% interval (studentized bootstrap)"),
               Line2D([], [], color="black", marker="|", linestyle="none", markersize=9, markeredgewidth=1.5,
                      label="target: the largest acceptable ratio"),
               Line2D([], [], color="#888888", linestyle="--", linewidth=0.8, label="1×: as fast as the peer"),
               Line2D([], [], color="#555555", marker=">", linestyle="none", markersize=4,
                      label="interval goes on off scale (its figures are at the right)")]
    fig.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.32 / height), ncols=2,
               frameon=False, fontsize=7.5, handlelength=1.6, columnspacing=2.0, labelspacing=0.4)
    fig.suptitle(_text(f"devshim against its peers: every judged comparison of the run of {document['date']}\n"
                       f"(informational rows, not targets, are not drawn)"), y=1 - 0.05 / height, va="top",
                 fontsize=9)
    return fig, drawn


def _log2_sequence_axis(ax: Axes, lengths: list[int]) -> None:
    from matplotlib.ticker import FixedLocator, NullLocator
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(lengths))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(n) for n in lengths])
    ax.set_xlim(min(lengths) / 1.25, max(lengths) * 1.25)


def _merge_equal(series: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """devshim's layouts that measured the very same figures, drawn as one line naming them all."""
    merged: dict[str, dict[int, float]] = {}
    by_values: dict[tuple, list[str]] = {}
    for who, values in series.items():
        by_values.setdefault(tuple(sorted(values.items())), []).append(who)
    for values, names in by_values.items():
        layouts = [m["layout"] for m in map(_DEVSHIM_LAYOUT.match, names) if m]
        merged[f"devshim ({', '.join(layouts)})" if len(layouts) == len(names) > 1 else names[0]] = dict(values)
    return merged


def _contender_lines(ax: Axes, series: dict[str, dict[int, float]], scale: float) -> None:
    devshim = [who for who in series if _DEVSHIM_LAYOUT.match(who) or who.startswith("devshim (")]
    # devshim's layouts: one colour, told apart by their markers; the peers keep their own colour and line
    layout_markers = iter("oDvPh*p8")
    for who in [*devshim, *(w for w in series if w not in devshim)]:
        values = series[who]
        if who in devshim:
            style = {**_CONTENDER_STYLE["devshim"], "marker": next(layout_markers),
                     "linewidth": 1.0 if len(devshim) > 1 else 1.6, "alpha": 0.85}
        else:
            style = {**_CONTENDER_STYLE.get(who, {"color": "#555555", "marker": "v", "linestyle": "-."}),
                     "linewidth": 1.6}
        lengths = sorted(values)
        ax.plot(lengths, [values[n] * scale for n in lengths], label=_text(who), markersize=4.5, **style)


def draw_attention(document: dict) -> Figure:
    """Time and bytes held for backward against sequence length: a column per head dimension."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    panels = attention_series(document)
    modes = [m for m in _MODES if any(m in p["time"] for p in panels.values())]
    memories = [m for m in _MEMORIES if any(p[m] for p in panels.values())]
    rows = len(modes) + len(memories)
    fig = Figure(figsize=(_WIDTH, 2.7 * rows + 1.3), layout="constrained")
    axes = fig.subplots(rows, len(panels), squeeze=False, sharex="col")
    for column, ((head_dim, heads), panel) in enumerate(panels.items()):
        lengths = sorted({n for mode in panel["time"].values() for values in mode.values() for n in values})
        for row, mode in enumerate(modes):
            ax = axes[row, column]
            _contender_lines(ax, panel["time"].get(mode, {}), 1e3)
            ax.set_title(f"head dim {head_dim}, {heads} heads: {_MODES[mode]}", loc="left")
            ax.set_ylabel("time per call (ms)")
        for row, memory in enumerate(memories, start=len(modes)):
            ax = axes[row, column]
            _contender_lines(ax, _merge_equal(panel[memory]), 1 / (1 << 20))
            ax.set_title(f"head dim {head_dim}, {heads} heads: {_MEMORIES[memory]}", loc="left")
            ax.set_ylabel(f"{_MEMORIES[memory]} (MiB)")
            # the memory rows name their own lines: layouts that hold the same bytes share one
            ax.legend(fontsize=7, frameon=False)
        axes[-1, column].set_xlabel("sequence length (tokens, log scale)")
        for ax in axes[:, column]:
            _log2_sequence_axis(ax, lengths)
            ax.tick_params(axis="x", labelbottom=True)
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.grid(which="major", color="#e6e6e6", linewidth=0.6)
    # one legend for the time rows, whose contenders are the same in every panel
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=4, frameon=False, fontsize=7.5)
    # constrained layout stacks the title above the panels but not a footnote under the legend: both lines up here
    fig.suptitle(_text(f"Causal attention, fp32, batch 1, each kernel timed alone (run of {document['date']})\n"
                       f"time: each contender's geometric mean over the rounds; bytes held for backward: the "
                       f"storages autograd saves\nin one forward, without the inputs'; peak: the most the host "
                       f"allocator held above its start during one forward+backward (bench/attention.py)"),
                 fontsize=8.5)
    return fig


def svg(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="svg", metadata=_SVG_METADATA)
    return buffer.getvalue()


def render(document: dict) -> dict[str, bytes]:
    """File name -> SVG bytes of every plot :func:`plots` names."""
    matplotlib = _matplotlib()
    drawers = {RATIOS: lambda d: draw_ratios(d)[0], ATTENTION: draw_attention}
    # the defaults, then our pins: the same bytes whatever matplotlibrc the machine has
    with matplotlib.rc_context(), matplotlib.style.context("default"), matplotlib.rc_context(_RC):
        return {name: svg(drawers[name](document)) for name in plots(document)}


def write(document: dict, directory: pathlib.Path = IMG) -> list[pathlib.Path]:
    """Draw every plot into ``directory``; returns the files written."""
    rendered = render(document)
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in rendered.items():
        (directory / name).write_bytes(data)
    return [directory / name for name in rendered]
