"""Terminal output for `verispec bench`: a rich progress bar while it runs and a rich summary table
(plain text when the output is not a terminal, so logs and pipes stay readable)."""

from __future__ import annotations

import sys
from contextlib import contextmanager


@contextmanager
def progress_bar(enabled: bool = True):
    """Yields a callable (done, total, description) for run_bench, or True/False without a terminal."""
    if not enabled:
        yield False
        return
    if not sys.stderr.isatty():
        yield True
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.description}"),
                  console=Console(file=sys.stderr), transient=True) as bar:
        task = bar.add_task("", total=None)

        def update(done: int, total: int, description: str) -> None:
            bar.update(task, completed=done, total=total, description=description)

        yield update


def print_summary(result: dict) -> None:
    from verispec.bench.run import format_table

    if not sys.stdout.isatty():
        print(format_table(result))
        return
    from rich.console import Console
    from rich.table import Table

    from verispec.bench.run import settings_lines, speedup_range

    c = result["costs"]
    console = Console()
    costs = ", ".join(f"c_p({n}) = {v * 1e3:.0f} ms" for n, v in c["c_p"].items())
    if c["c_q_draft"]:
        costs += f"; draft step c_q = {c['c_q_draft'] * 1e3:.0f} ms ({c['draft_to_target']:.2f} × c_p(1))"
    table = Table(title="verispec bench — speedup vs plain decoding in the same run", caption=costs)
    for name, justify in (("T", "right"), ("bs", "right"), ("category", "left"), ("mode", "left"),
                          ("tok/s", "right"), ("speedup", "right"), ("range", "right"), ("accounted", "right"), ("pred.", "right"), ("acc.", "right"),
                          ("τ", "right"), ("pred. τ", "right"), ("α", "right"), ("same", "center")):
        table.add_column(name, justify=justify, no_wrap=True)

    def f(v, fmt):
        return fmt % v if isinstance(v, (int, float)) else "–"

    previous = None
    for r in result["summary"]:
        key = (r["temperature"], r["batch_size"], r["category"])
        if previous is not None and key != previous:
            table.add_section()
        previous = key
        speed = r.get("speedup")
        colour = "" if speed is None or r["mode"] == "plain" else ("green" if speed >= 1.03 else "red" if speed < 0.97 else "")
        same = r.get("identical_to_plain")
        table.add_row(str(r["temperature"]), str(r["batch_size"]), r["category"], r["mode"],
                      f(r["tokens_per_s"], "%.2f"), f"[{colour}]{f(speed, '%.2fx')}[/]" if colour else f(speed, "%.2fx"),
                      speedup_range(r), f(r.get("accounted_speedup"), "%.2fx"),
                      f(r.get("predicted_speedup"), "%.2fx"), f(r.get("acceptance_rate"), "%.2f"), f(r.get("tau"), "%.2f"),
                      f(r.get("predicted_tau"), "%.2f"), f(r.get("alpha"), "%.2f"),
                      "–" if same is None else ("[green]yes[/]" if same else "[red]NO[/]"))
    console.print(table)
    for line in settings_lines(result):
        console.print(line, markup=False, highlight=False)
