"""The repository describes the software as it is: no words of how it was made in any tracked text file, each
topic document about 250 lines, the README a five-minute read, the configuration reference generated from the
code, and every relative link resolving."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEXT = (".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".json", ".yml", ".yaml", "")
# development-process words: numbered stops of the work, step numbers in result names, issue numbers
HISTORY = re.compile(r"\bstops? \d|\bstop-\d|-s\d{2}-|\bissue #?\d|#\d{2,} ?\b(?:item|asks)|\bearlier we\b|"
                     r"\bwe tried\b|\b(?:before|since|until) 20\d\d-\d\d-\d\d", re.IGNORECASE)


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / p for p in out if Path(p).suffix in TEXT and (ROOT / p).is_file()]


def test_no_tracked_text_speaks_of_how_it_was_made():
    this = Path(__file__).resolve()
    hits = []
    for path in tracked():
        if path.resolve() == this:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if path.parent.name == "results":  # a run's data (prompts, answers): its own words only
            data = json.loads(text)
            text = "\n".join(str(data.get(k, "")) for k in ("benchmark", "description", "command", "verdict"))
        for n, line in enumerate(text.splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits[:40]) + (f"\n... {len(hits)} in all" if len(hits) > 40 else "")


def test_the_scan_finds_what_it_looks_for():
    step, stops = "st" + "op", "st" + "ops"  # (assembled here, so this file holds no such phrase itself)
    examples = (f"({step} 1)", f"{stops} 1-2's code", "name-" + "s00-x", "iss" + "ue #0, item 1", f"S{step[1:]} 0 took",
                "results recorded bef" + "ore 2000-01-01")
    for line in examples:
        assert HISTORY.search(line), line
    for line in ("the loader stops at its next page", "non-stop", "multi-turn chat", "scope='session'"):
        assert not HISTORY.search(line), line


def test_topic_documents_stay_short():
    long = {p.name: n for p in (ROOT / "docs").glob("*.md") if (n := len(p.read_text().splitlines())) > 300}
    assert not long, long


def test_the_readme_is_a_five_minute_read():
    text = (ROOT / "README.md").read_text()
    words = len(re.findall(r"\S+", text))
    assert words <= 1700, words
    cells = [c.strip() for line in text.splitlines() if line.startswith("|") for c in line.strip("|").split("|")]
    assert max(len(c) for c in cells) <= 240, max(cells, key=len)


def test_benchmarks_md_is_rendered_from_the_results():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check"], cwd=ROOT)
    assert r.returncode == 0, "BENCHMARKS.md is stale: run python benchmarks/report.py"


def test_the_configuration_reference_is_generated_from_the_code():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "configuration_doc.py"), "--check"], cwd=ROOT)
    assert r.returncode == 0, "docs/configuration.md is stale: run python scripts/configuration_doc.py"


@pytest.mark.parametrize("doc", ["README.md", "BENCHMARKS.md", *(f"docs/{p.name}" for p in
                                                                  sorted((ROOT / "docs").glob("*.md")))])
def test_relative_links_resolve(doc):
    path = ROOT / doc
    broken = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (path.parent / target).exists():
            broken.append(target)
    assert not broken, broken
