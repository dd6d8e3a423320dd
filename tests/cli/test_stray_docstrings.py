"""No stray docstrings in the CLI's and the simulator's modules: a bare string statement right
after another one documents nothing (an attribute's docstring is the string right after its
assignment). vertumnus/live/stack.py ``LiveStack.__init__`` had one: ``_killed``'s docstring
was left behind the lines added after ``_killed``, last after ``phase``'s own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODULES = sorted(p for d in ("vertumnus", "sim") for p in (REPO / d).rglob("*.py"))


def _is_string(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str))


def stray_strings(source: str) -> list[int]:
    """Line numbers of the bare string statements that directly follow another one."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if isinstance(body, list):
                lines += [b.lineno for a, b in zip(body, body[1:], strict=False)
                          if isinstance(a, ast.stmt) and _is_string(a) and _is_string(b)]
    return sorted(lines)


def test_the_check_finds_a_second_string() -> None:
    src = 'class A:\n    def f(self):\n        self.x = 1\n        """x."""\n        """y."""\n'
    assert stray_strings(src) == [5]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_stray_docstring(path: Path) -> None:
    assert stray_strings(path.read_text(encoding="utf-8")) == []
