"""No function in harness/ or kernels/ is longer than 80 lines, counted from its `def` line to its last line
(decorators left out, nested functions counted inside their parent and on their own): a longer one is split
into helpers with one job each. Parsed from the source, as tests/test_import_graph.py does."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("harness", "kernels")
MAX_LINES = 80


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """(name, line of its `def`, lines) of every function or method in `source` longer than `limit` lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append((node.name, node.lineno, lines))
    return found


def test_long_functions_counts_from_the_def_line_to_the_last():
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    assert long_functions(f"@decorator\ndef f():\n{body}") == [("f", 2, 81)]  # 81 lines: def and 80
    assert long_functions(f"def f():\n{body[: body.rindex('    x79')]}") == []  # 80 lines: allowed
    method = "".join("    " + line + "\n" for line in f"async def m(self):\n{body}".splitlines())
    assert long_functions(f"class C:\n{method}") == [("m", 2, 81)]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_is_longer_than_80_lines(package):
    found = [
        f"{path.relative_to(ROOT)}:{line} {name} ({lines} lines)"
        for path in sorted((ROOT / package).rglob("*.py"))
        for name, line, lines in long_functions(path.read_text())
    ]
    assert not found, f"over {MAX_LINES} lines (split into helpers with one job each): " + "; ".join(found)
