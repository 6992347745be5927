"""The repository stands alone: no tracked file cites a document outside it (a design file, the planning notes, a
folder beside the checkout), and every citation of the project's own docs/ names a file and a section that exist."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What a citation of an outside document looks like (built from parts so that this file does not match itself).
OUTSIDE = re.compile("|".join([
    r"\bDESIGN" + r"\.md\b",
    r"\.\./" + r"shared\b",
    r"(?<![\w.])shared/(?:evidence|bench|device|seeds)\b",
    r"\bthe seed(?:'s|s')",
    r"\bthe seeds?\s+\(",
    r"\bseeds?/\d{3}",
]), re.IGNORECASE)
DOC_CITATION = re.compile(r'docs/([a-z_]+\.md)(?:, "([^"]+)")?')


def outside_citations(text: str) -> list[str]:
    return [m.group(0) for m in OUTSIDE.finditer(text)]


def tracked_text_files() -> dict[str, str]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    out = {}
    for name in names.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file():
            continue
        try:
            out[name] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary: gzip, TensorBoard event files
    return out


def sections(markdown: str) -> list[str]:
    """A doc's headings and its bold run-in titles of paragraphs and list items ("**Stages.**")."""
    heads = re.findall(r"^#+\s+(.+)$", markdown, re.MULTILINE)
    return heads + re.findall(r"^(?:- )?\*\*([^*]+?)\.?\*\*", markdown, re.MULTILINE)


def test_the_patterns_catch_outside_citations_and_spare_random_seeds():
    assert outside_citations("see DESIGN" ".md and ../" "shared/evidence/2gpu")
    assert outside_citations("as the seed's scripts run it") == ["the seed's"]
    assert outside_citations("the seeds' layout")
    assert outside_citations("The seed (000, chapters 1 and 4)")
    assert not outside_citations("torch.manual_seed(0); --seed 1234; the seeded master weight; whatever the seed")


def test_no_tracked_file_cites_a_document_outside_the_repository():
    me = Path(__file__).relative_to(ROOT).as_posix()
    found = {name: outside_citations(text) for name, text in tracked_text_files().items() if name != me}
    assert {name: hits for name, hits in found.items() if hits} == {}


def test_every_docs_citation_names_a_file_and_section_that_exist():
    docs = {p.name: sections(p.read_text(encoding="utf-8")) for p in (ROOT / "docs").glob("*.md")}
    missing = set()
    for name, text in tracked_text_files().items():
        for doc, section in DOC_CITATION.findall(text):
            section = re.sub(r"\s*\n\s*(?:#\s*)?", " ", section)  # a name wrapped across comment lines
            if doc not in docs:
                missing.add(f"{name}: docs/{doc}")
            elif section and not any(head.startswith(section) for head in docs[doc]):
                missing.add(f'{name}: docs/{doc}, "{section}"')
    assert sorted(missing) == []


@pytest.mark.parametrize("doc", ["architecture.md", "run_directory.md", "engine.md", "formulas.md",
                                 "buffer_layout.md", "ledger_rows.md"])
def test_the_project_docs_exist(doc):
    assert (ROOT / "docs" / doc).is_file()
