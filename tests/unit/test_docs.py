"""The repository's Markdown: a README a newcomer reads, table cells that stay short, links that
lead somewhere."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_LIMIT = 10_000
CELL_LIMIT = 400


def markdown_files() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    files = [ROOT / f for f in tracked] if tracked else sorted(ROOT.glob("**/*.md"))
    return [f for f in files if f.exists() and ".venv" not in f.parts]


def table_cells(text: str):
    """(line number, cell) for every cell of every Markdown table row outside code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced and line.lstrip().startswith("|"):
            for cell in re.split(r"(?<!\\)\|", line.strip().strip("|")):
                yield n, cell.strip()


def test_the_readme_is_short():
    size = len((ROOT / "README.md").read_text())
    assert size <= README_LIMIT, f"README.md is {size} characters; keep it to {README_LIMIT} (the rest goes in docs/)"


def test_the_readme_shows_both_set_up_commands_on_its_first_screen():
    first_screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:40])
    assert "make run" in first_screen and "make test" in first_screen


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_table_cell_is_long(path):
    long = [(n, len(cell)) for n, cell in table_cells(path.read_text()) if len(cell) > CELL_LIMIT]
    assert long == [], f"{path.name}: cells over {CELL_LIMIT} characters (line, length): {long}"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_repository_paths_exist(path):
    """Every relative link resolves, and every `bench/...`, `docs/...`, `scripts/...`, `examples/...`
    or `tests/...` path a document names in backquotes is a file or directory of the tree."""
    text = path.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+://", target) and not (path.parent / target).exists():
            missing.append(target)
    for named in re.findall(r"`((?:bench|docs|scripts|examples|tests|deploy)/[\w./-]+)", text):
        if "*" not in named and not (ROOT / named.rstrip(".")).exists():
            missing.append(named)
    assert missing == [], f"{path.relative_to(ROOT)} names what is not there: {missing}"
