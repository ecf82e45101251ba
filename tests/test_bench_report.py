"""The README's performance summary and docs/performance.md's tables are the rendering of ``bench/results.json``.

Nobody edits them by hand: ``python -m bench.report --write`` (run by ``make bench``) writes both.
"""

from __future__ import annotations

import json

import pytest

from bench.__main__ import DEFAULT_OUTPUT, tally
from bench.report import BEGIN, BLOCKS, END, render, replace_block

RESULTS = json.loads(DEFAULT_OUTPUT.read_text())


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
