"""``vertumnus demo``: the three policy cores at work on a small built-in example.

It shows, with no server and no trace: the scheduler's placement of a few requests on a mixed
CP2/CP4 pool with every term of J for every candidate (§5.3); the prefix trie's Algorithm 1
statistics and one Algorithm 2 scan with the actions it selects (§7); and the controller's
decision on a few windows of demand, with the split / merge plan it would carry out (§6).
"""

from __future__ import annotations

from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(
        beta: Annotated[float, typer.Option(help="β of J")] = 1.5,
        lam: Annotated[float, typer.Option(help="λ of J")] = 0.5,
    ) -> None:
        """Show placements (every J term), a cache scan's actions and a controller plan."""
        from vertumnus.cliargs import j_weight
        from vertumnus.demo import run_demo

        # Checked before the first line is printed: a weight J refuses would otherwise stop
        # the demo half-way, at its first placement.
        run_demo(beta=j_weight(beta, "beta"), lam=j_weight(lam, "lam"), echo=typer.echo)
