"""The README's performance summary, docs/performance.md's tables and the plots they show are the rendering of
``bench/results.json``.

Nobody edits them by hand: ``python -m bench.report --write`` (run by ``make bench``) writes all of them. The
plots need matplotlib; the tests that draw skip without it, the others do not.
"""

from __future__ import annotations

import copy
import json
import math
import pathlib
import re
import sys
import xml.etree.ElementTree as ET

import pytest

from bench import plots, report
from bench.__main__ import DEFAULT_OUTPUT, tally
from bench.report import BEGIN, BLOCKS, END, render, replace_block

RESULTS = json.loads(DEFAULT_OUTPUT.read_text())
ROOT = pathlib.Path(__file__).resolve().parent.parent
MIB = 1 << 20


def test_the_recorded_results_are_a_full_run_without_failures():
    assert RESULTS["quick"] is False and RESULTS["failures"] == {}
    assert RESULTS["targets"] == tally(RESULTS["comparisons"])


@pytest.mark.parametrize(("path", "kind"), BLOCKS.items(), ids=[p.name for p in BLOCKS])
def test_each_generated_block_is_the_rendering_of_the_recorded_results(path, kind):
    text = path.read_text()
    block = text.split(BEGIN.format(kind=kind), 1)[1].split(END.format(kind=kind), 1)[0]
    assert block == "\n" + render(RESULTS, kind), f"run: python -m bench.report --write ({path.name} is stale)"


def test_a_file_without_the_markers_is_refused_not_appended_to():
    with pytest.raises(ValueError, match="markers"):
        replace_block("# a page\n", "summary", "text\n")


def _svg_texts(data: bytes) -> list[str]:
    """Every text element of an SVG drawn with svg.fonttype "none", as a reader's browser shows it."""
    return ["".join(e.itertext()) for e in ET.fromstring(data).iter() if e.tag.endswith("}text")]


@pytest.fixture(scope="module")
def rendered() -> dict[str, bytes]:
    pytest.importorskip("matplotlib", reason=f"the plots need matplotlib ({plots.MATPLOTLIB_PIN})")
    return plots.render(RESULTS)


def test_the_tables_show_each_plot_next_to_what_it_illustrates():
    tables = render(RESULTS, "tables")
    assert set(plots.plots(RESULTS)) == {plots.RATIOS, plots.ATTENTION}
    images = {name: plots.image(name, alt) for name, alt in plots.plots(RESULTS).items()}
    # the ratio plot, of every group, before the first group; the attention plot inside the attention group
    assert tables.index(images[plots.RATIOS]) < tables.index("#### ")
    attention = tables.split("#### attention\n", 1)[1].split("#### ", 1)[0]
    assert attention.index(images[plots.ATTENTION]) < attention.index("| case |")
    for name, image in images.items():
        assert re.fullmatch(r"!\[[^\]]{40,}\]\(img/" + re.escape(name) + r"\)", image), "a descriptive alt text"
        assert (ROOT / "docs" / "img" / name).is_file(), f"docs/performance.md shows {name}: run --write"


def test_a_run_without_attention_rows_shows_no_attention_plot():
    other = {**RESULTS, "comparisons": [r for r in RESULTS["comparisons"] if r["group"] != "attention"]}
    assert set(plots.plots(other)) == {plots.RATIOS}
    assert "bench-attention" not in render(other, "tables")


def test_the_committed_plots_are_the_rendering_of_the_recorded_results(rendered):
    import matplotlib

    for name, data in rendered.items():
        assert (ROOT / "docs" / "img" / name).read_bytes() == data, (
            f"docs/img/{name} is stale: run python -m bench.report --write (with {plots.MATPLOTLIB_PIN}; "
            f"this is matplotlib {matplotlib.__version__})")


def test_the_plots_are_byte_identical_when_drawn_again(rendered, tmp_path):
    written = plots.write(RESULTS, tmp_path)  # a second drawing: the fixture's was the first
    assert [p.name for p in written] == list(rendered)
    for path in written:
        assert path.read_bytes() == rendered[path.name]
        assert b"<dc:date>" not in path.read_bytes()


def test_the_ratio_plot_draws_each_judged_comparison_once_with_its_figures_and_verdict_in_words(rendered):
    _, drawn = plots.draw_ratios(RESULTS)
    judged = [r for g in plots.judged_by_group(RESULTS).values() for r in g]
    assert len(drawn) == len(judged) == RESULTS["targets"]["judged"]
    texts = _svg_texts(rendered[plots.RATIOS])
    for entry, row in zip(drawn, judged, strict=True):
        assert " ".join(entry).startswith(" ".join(row["case"].split())), (entry, row["case"])
        assert set(entry) <= set(texts), entry
    # one right-hand figure per judged row, which ends in its verdict: informational rows are not drawn
    figures = [t for t in texts if re.match(r"\d+\.\d{3}× \(", t)]
    assert sorted(figures) == sorted(plots.interval_text(r) for r in judged)
    assert {t.rsplit(" ", 1)[1] for t in figures} == {r["verdict"] for r in judged} == {"met", "missed",
                                                                                        "inconclusive"}
    # and not told by colour alone: each verdict has its own marker too
    assert len({style["marker"] for style in plots._VERDICT_STYLE.values()}) == 3


def test_a_smoke_runs_unbounded_intervals_are_drawn_cut_at_the_edge(rendered):
    smoke = copy.deepcopy(RESULTS)
    # one group's judged rows, as a quick run would have them
    group = next(r["group"] for r in smoke["comparisons"] if r["judged"])
    smoke["comparisons"] = [r for r in smoke["comparisons"] if r["group"] == group and r["judged"]]
    for r in smoke["comparisons"]:
        r.update(ci_low=0.0, ci_high=math.inf, verdict="inconclusive")
    texts = _svg_texts(plots.render(smoke)[plots.RATIOS])
    assert sum(t.endswith("(0.000-inf)  inconclusive") for t in texts) == len(smoke["comparisons"])


def test_the_attention_series_are_what_the_rows_and_notes_record():
    series = plots.attention_series(RESULTS)
    assert set(series) == {(64, 8), (128, 4)}
    for (head_dim, _), panel in series.items():
        assert set(panel["time"]) == {"fwd+bwd", "fwd"}
        for memory in ("saved", "peak"):
            for who, held in panel[memory].items():
                # every contender at 512-2048; at 4096 only the layouts bench/attention.py's longest cases time
                assert {512, 1024, 2048} <= set(held) <= {512, 1024, 2048, 4096}, (memory, who)
        # the rounded MiB notes bench/attention.py writes agree with the exact bytes the plot draws
        for note in (n for n in RESULTS["notes"] if n["name"].startswith("s=") and f" d={head_dim}:" in n["name"]):
            seq = int(note["name"].split()[0].removeprefix("s="))
            who = note["name"].rsplit(", ", 1)[1].replace("devshim (", "devshim attention (")
            memory = "peak" if "peak memory" in note["name"] else "saved"
            assert round(panel[memory][who][seq] / MIB, 2) == note["value"], note["name"]
    row = next(r for r in RESULTS["comparisons"] if r["case"] == "causal fp32 s=1024 d=128 1x4h fwd+bwd")
    assert series[(128, 4)]["time"]["fwd+bwd"][row["subject"]][1024] == row["subject_seconds"]
    assert series[(128, 4)]["time"]["fwd+bwd"][row["peer"]][1024] == row["peer_seconds"]


def test_the_attention_plot_calls_its_memory_figure_what_it_is(rendered):
    texts = _svg_texts(rendered[plots.ATTENTION])
    assert "bytes held for backward (MiB)" in texts
    assert {"512", "1024", "2048"} <= set(texts)
    # a peak is only ever the measured peak of a forward+backward, drawn only where the results have one
    has_peaks = any("subject_peak_bytes" in r["details"] for r in RESULTS["comparisons"] if r["group"] == "attention")
    assert ("peak, forward+backward (MiB)" in texts) == has_peaks
    assert all("forward+backward" in t for t in texts if "peak" in t.lower())


def test_write_without_matplotlib_stops_before_any_page_and_names_the_pin(monkeypatch, tmp_path):
    pages = {tmp_path / "README.md": "summary", tmp_path / "performance.md": "tables"}
    for page, kind in pages.items():
        page.write_text(f"{BEGIN.format(kind=kind)}\nold\n{END.format(kind=kind)}\n")
    monkeypatch.setattr(report, "BLOCKS", pages)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit, match=re.escape(f"pip install {plots.MATPLOTLIB_PIN}")):
        report.main([str(DEFAULT_OUTPUT), "--write"])
    assert all("\nold\n" in page.read_text() for page in pages)


def test_the_pin_the_message_names_is_the_one_requirements_dev_txt_installs():
    assert plots.MATPLOTLIB_PIN in (ROOT / "requirements-dev.txt").read_text().split("\n")
