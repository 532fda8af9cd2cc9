"""tests/conftest.py's order of the test files: LONGEST_FIRST names test files, and the session runs them first."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _longest_first(config) -> tuple[str, ...]:
    (conftest,) = [p for p in config.pluginmanager.get_plugins() if hasattr(p, "LONGEST_FIRST")]
    return conftest.LONGEST_FIRST


def test_longest_first_names_test_files(request):
    names = _longest_first(request.config)
    assert len(set(names)) == len(names)
    assert all((ROOT / name).is_file() and Path(name).name.startswith("test_") for name in names)


def test_the_session_runs_them_first_in_their_order(request):
    rank = {name: i for i, name in enumerate(_longest_first(request.config))}
    files = [item.nodeid.split("::")[0] for item in request.session.items]
    ranks = [rank.get(f, len(rank)) for f in files]
    assert ranks == sorted(ranks) and ranks[-1] == len(rank)  # this file is not among them: it comes after
