"""The documentation: mkdocs.yml and docs/ build with --strict, a link to a repository file that does not exist fails
that build (docs/hooks/repo_links.py), and docs/python.md shows README's Python block as it is run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "docs" / "hooks" / "repo_links.py"


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_docs_build_strictly(tmp_path):
    result = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr[-3000:]
    # README's picture, linked from the home page, is copied beside the pages
    assert (tmp_path / "site/repo/results/frontier/2026-11-24_frontier/pareto-smollm2-135m-all.png").is_file()


def small_site(tmp_path: Path, page: str) -> Path:
    """A repository of one docs page, one file beside docs/ and the project's link hook."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text(page)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "README.md").write_text("# a result\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"site_name: t\nhooks:\n  - {HOOK}\nvalidation:\n  links:\n    not_found: warn\n")
    return config


def test_a_link_outside_docs_resolves_to_a_copy_of_the_file(tmp_path):
    config = small_site(tmp_path, "# t\n\n[r](../results/README.md#a-result), `[not a link](../nope.md)`\n")
    result = mkdocs_build(config, tmp_path / "site")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "site/repo/results/README.md").read_text() == "# a result\n"
    assert 'href="repo/results/README.md#a-result"' in (tmp_path / "site/index.html").read_text()


def test_a_link_to_a_missing_file_fails_the_build(tmp_path):
    config = small_site(tmp_path, "# t\n\n[r](../results/README.md) and [gone](../results/gone.md)\n")
    result = mkdocs_build(config, tmp_path / "site")
    assert result.returncode != 0
    assert "link '../results/gone.md', but the target is not found" in result.stderr


def python_block(path: Path) -> str:
    return re.search(r"```python\n(.*?)```", path.read_text(), re.S).group(1)


def test_the_python_page_shows_readmes_block():
    assert python_block(ROOT / "docs" / "python.md") == python_block(ROOT / "README.md")
