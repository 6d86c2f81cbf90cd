"""pytest JUnit XML reports -> passed / failed / skipped per test file, as a Markdown table, then each
failure's first line and each skip's reason (scripts/vllm_server_tests/run.sh)."""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict


def summarize(paths: list[str]) -> str:
    counts: dict[str, Counter] = defaultdict(Counter)
    notes = []
    cases = [case for path in paths for case in ET.parse(path).getroot().iter("testcase")]
    for case in cases:
        parts = (case.get("classname") or "?").split(".")
        group = next((p for p in parts if p.startswith("test_")), parts[-1])  # the test file's name
        kind = "passed"
        for tag, name in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            el = case.find(tag)
            if el is not None:
                kind = name
                first = ((el.get("message") or el.text or "").strip().splitlines() or [""])[0][:200]
                notes.append(f"- {name}: {group}::{case.get('name')}: {first}")
                break
        counts[group][kind] += 1
    rows = ["| file | passed | failed | skipped |", "| --- | --- | --- | --- |"]
    total = Counter()
    for group in sorted(counts):
        c = counts[group]
        total.update(c)
        rows.append(f"| {group} | {c['passed']} | {c['failed']} | {c['skipped']} |")
    rows.append(f"| **all** | **{total['passed']}** | **{total['failed']}** | **{total['skipped']}** |")
    return "\n".join(rows + [""] + notes)


if __name__ == "__main__":
    print(summarize(sys.argv[1:]))
