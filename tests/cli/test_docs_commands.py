"""The commands the README and docs/ show still exist: every ``vertumnus SUB --flag`` they
write names a real subcommand and real flags, and every ``bench/NAME.py --flag`` a real script
and flags. The docs are how users reproduce a figure; a renamed flag must fail here, not there.
"""

from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import typer.main

from vertumnus.cli import app

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
_INLINE = re.compile(r"`((?:\.venv/bin/)?(?:python |\.venv/bin/python )?"
                     r"(?:vertumnus|bench/\w+\.py)\b[^`]*)`")


def _code_commands(text: str) -> list[str]:
    """Commands starting with ``vertumnus`` or a bench script in fenced blocks (a trailing
    backslash continues a command; ``#`` starts a comment) and in inline code."""
    out = [m.group(1) for m in _INLINE.finditer(text)]
    fenced, buf = False, ""
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced, buf = not fenced, ""
            continue
        if not fenced:
            continue
        code = re.split(r"\s#", line, maxsplit=1)[0].strip()
        if buf:
            buf += " " + code
        elif re.match(r"(\S*python\s+)?(vertumnus|bench/\w+\.py)\b", code):
            buf = code
        else:
            continue
        if buf.endswith("\\"):
            buf = buf[:-1]
            continue
        out.append(buf)
        buf = ""
    return out


def _flags(tokens: list[str]) -> list[str]:
    """The ``--flag`` tokens (``--a=1`` -> ``--a``; ``--x/--no-x`` -> both)."""
    out: list[str] = []
    for t in tokens:
        if t.startswith("--"):
            out.extend(f.split("=", 1)[0] for f in t.split("/") if f.startswith("--"))
    return out


def _commands() -> list[tuple[str, str]]:
    """(doc, command) for each command with more than its program (a bare `vertumnus` in the
    prose names the tool, not a command), cut where a pipe, ``&&``, ``;`` or a redirection
    hands over to something else."""
    out: list[tuple[str, str]] = []
    for doc in DOCS:
        for c in _code_commands(doc.read_text()):
            c = re.split(r"\s(?:\||&&|;|>)\s", c, maxsplit=1)[0]
            if len(c.split()) > 1:
                out.append((doc.name, c))
    return out


def _placeholder(word: str) -> bool:
    """A word standing for one the reader picks (``SERVICE``, ``NAME``)."""
    return word.isupper()


@cache
def _cli() -> Any:
    """The app's command group (typer's own click: its ``commands`` map names to commands)."""
    group = typer.main.get_command(app)
    assert hasattr(group, "commands")
    return group


@cache
def _bench_help(script: str) -> str:
    res = subprocess.run([sys.executable, str(ROOT / script), "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"{script} --help: {res.stderr[-2000:]}"
    return res.stdout


def test_the_docs_show_commands_to_check() -> None:
    subs = {c.split()[1] for _, c in _commands() if c.split()[0] == "vertumnus"}
    # The extraction finds what the README is known to show (else this test checks nothing).
    assert {"simulate", "report", "profile", "up", "size", "tune", "demo"} <= subs
    assert sum(1 for _, c in _commands() if "bench/" in c.split()[0] or "bench/" in c) >= 10


@pytest.mark.parametrize("doc, command", [(d, c) for d, c in _commands()
                                          if "vertumnus" in c.split()[0]])
def test_every_vertumnus_command_in_the_docs_exists(doc: str, command: str) -> None:
    tokens = command.replace("\n", " ").split()
    sub = tokens[1] if len(tokens) > 1 else ""
    if _placeholder(sub):
        return
    cmds = _cli().commands
    assert sub in cmds, f"{doc}: `{command}`: no subcommand {sub!r}"
    known: set[str] = set()
    for p in cmds[sub].params:
        known.update(p.opts)
        known.update(p.secondary_opts)
    missing = [f for f in _flags(tokens[2:]) if f not in known]
    assert not missing, f"{doc}: `{command}`: {sub} has no {missing}"


@pytest.mark.parametrize("doc, command", [(d, c) for d, c in _commands()
                                          if "vertumnus" not in c.split()[0]])
def test_every_bench_command_in_the_docs_exists(doc: str, command: str) -> None:
    tokens = command.replace("\n", " ").split()
    script = next(t for t in tokens if re.fullmatch(r"bench/\w+\.py", t))
    assert (ROOT / script).is_file(), f"{doc}: `{command}`: no {script}"
    flags = _flags(tokens[tokens.index(script) + 1:])
    if flags:
        text = _bench_help(script)
        # The flag exactly: not a longer one it begins (``--rate`` in ``--rate-scale``).
        missing = [f for f in flags
                   if not re.search(r"(?<![\w-])" + re.escape(f) + r"(?![\w-])", text)]
        assert not missing, f"{doc}: `{command}`: {script} --help shows no {missing}"


def _vtm_string_literals() -> set[str]:
    """Every ``VTM_*`` name that the code under services/, shared/, vertumnus/ and sim/ has as
    a whole string literal (``os.environ.get("VTM_X")``, ``envvar="VTM_X"``, ``X_ENV =
    "VTM_X"``): a name read by name. Docstrings and comments do not count (a docstring is
    never just the name, and comments are not in the syntax tree)."""
    import ast

    out: set[str] = set()
    for d in ("services", "shared", "vertumnus", "sim"):
        for p in (ROOT / d).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text(), filename=str(p))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                        and re.fullmatch(r"VTM_[A-Z0-9_]+", node.value):
                    out.add(node.value)
    return out


def test_every_vtm_variable_the_docs_name_is_read() -> None:
    """A ``VTM_*`` name in the README, docs/ or docker-compose.yml is a settings field of a
    service (pydantic-settings: prefix + field, ``__`` for nesting, as ``env_names`` lists
    them) or a variable the code reads by name (the name as a string literal in the code);
    ``VTM_NATS_*`` stands for a family. The docs also name the NATS KV buckets
    (``$KV.VTM_WORKERS.>``): those are not variables, and are checked against the bucket
    names ``Subjects`` builds."""
    from services.rankd.torch_backend import TorchSettings
    from shared.subjects import Subjects
    from vertumnus.live.rankd_sim import SimRankdSettings
    from vertumnus.live.registry import SERVICES, env_names

    known: set[str] = set()
    for info in SERVICES.values():
        cls = info.settings_class()
        assert cls is not None, info
        known |= env_names(cls)
    known |= env_names(SimRankdSettings) | env_names(TorchSettings)
    read = _vtm_string_literals()
    subjects = Subjects()
    buckets = {getattr(subjects, m)() for m in dir(subjects)
               if m.endswith("_bucket") and callable(getattr(subjects, m))}
    assert "VTM_WORKERS" in buckets  # (else the bucket names are no longer found this way)
    texts = [(p.name, p.read_text()) for p in (*DOCS, ROOT / "docker-compose.yml")]
    found = 0
    for name, text in texts:
        for m in re.finditer(r"VTM_[A-Z0-9_]*[A-Z0-9]((?:_\*)?)", text):
            var = m.group(0).rstrip("*")
            found += 1
            if m.group(1):  # a family: some variable must start with it
                assert any(k.startswith(var) for k in known), f"{name}: {m.group(0)}"
                continue
            if var in buckets and text[max(0, m.start() - 4):m.start()] == "$KV.":
                continue  # a KV bucket named in a subject, not an environment variable
            assert var in known or var in read, \
                f"{name}: {var} is neither a settings field nor read by the code"
    assert found > 50  # the docs do name their variables (else this checks nothing)
