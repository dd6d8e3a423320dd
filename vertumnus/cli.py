"""The ``vertumnus`` command line: one console script, one subcommand per job.

Command groups live in their own modules (``vertumnus.cmd_*``), each exposing
``register(app)``; heavy imports happen inside the commands so ``vertumnus --help`` is fast and
the control-plane commands never import torch.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="vertumnus",
    help="Adaptive context-parallel prefill pool: simulate, profile, run the live stack.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Each module registers its commands on ``app``. Order = order in --help.
_COMMAND_MODULES = ("vertumnus.cmd_core", "vertumnus.cmd_sim", "vertumnus.cmd_live")

for _name in _COMMAND_MODULES:
    try:
        _mod = importlib.import_module(_name)
    except ModuleNotFoundError as exc:  # a group not built yet must not break the others
        if exc.name != _name:
            raise
        continue
    _mod.register(app)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
