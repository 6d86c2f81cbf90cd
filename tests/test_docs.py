"""The docs state the present: no diary words ("this stop", "the previous stop's", "this session") in README.md
or docs/, docs/benchmarks.md stays a page of current tables (at most 400 lines; history lives in git), and
every results file it names is in docs/results/."""
from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIARY = re.compile(r"\b(?:this|previous|last|earlier|next|that) (?:stop|session)\b|\bstop before's\b|\bstop \d+\b",
                   re.IGNORECASE)
MAX_BENCHMARK_LINES = 400


def diary_words(text: str) -> list[str]:
    """`line: words` for each diary phrase in `text`."""
    return [f"{i}: {m.group(0)}" for i, line in enumerate(text.splitlines(), 1) for m in DIARY.finditer(line)]


def _docs() -> list[str]:
    return [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def test_docs_speak_in_the_present():
    assert len(_docs()) > 3
    found = {os.path.relpath(p, ROOT): hits for p in _docs() if (hits := diary_words(open(p).read()))}
    assert not found, found


def test_the_diary_check_can_fail():
    text = "One run, this stop.\nThe previous stop's figure; an earlier session.\nA stop string ends it.\nStop 12."
    assert diary_words(text) == ["1: this stop", "2: previous stop", "2: earlier session", "4: Stop 12"]


def test_benchmarks_page_is_short_and_its_files_exist():
    text = open(os.path.join(ROOT, "docs", "benchmarks.md")).read()
    assert len(text.splitlines()) <= MAX_BENCHMARK_LINES, "docs/benchmarks.md: one current table per topic"
    named = set(re.findall(r"\b([\w.]+\.json)\b", text))
    assert len(named) > 20
    missing = sorted(n for n in named if not os.path.exists(os.path.join(ROOT, "docs", "results", n)))
    assert not missing, missing
