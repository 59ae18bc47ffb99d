"""A toolbox sheet as data (sections of report.Line) and the one runner every tool shares."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType

from fitserve.ledger.errors import PlanError
from fitserve.tools.planner.report import Line, Section
from fitserve.tools.planner.sheet_index import TOOLS


@dataclass(frozen=True)
class Sheet:
    """What a tool prints: a title, warnings, sections of lines (each with its formula and, for
    --explain, the arithmetic with its inputs), and a verdict line (may be empty)."""

    title: str
    sections: tuple[Section, ...]
    warnings: tuple[str, ...] = ()
    verdict: str = ""
    ok: bool = True  # False: the question has no good answer (exit status 1, as plan's no-fit)
    data: dict[str, object] = field(default_factory=dict)  # extra machine-readable results

    def line(self, name: str) -> Line:
        """The line called ``name`` in any section (KeyError if none): handy in tests."""
        for sec in self.sections:
            for ln in sec.lines:
                if ln.name == name:
                    return ln
        raise KeyError(name)


def tool_module(name: str) -> ModuleType:
    return importlib.import_module(f"fitserve.tools.sheets.{TOOLS[name][0]}")


def build_parser(name: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"fitserve plan {name}", description=TOOLS[name][1], allow_abbrev=False)
    tool_module(name).add_arguments(p)
    p.add_argument("--explain", action="store_true", help="show the arithmetic of each line")
    p.add_argument("--json", action="store_true", help="print the sheet as JSON")
    return p


def build_sheet(name: str, argv: Sequence[str]) -> Sheet:
    """Parse ``argv`` for tool ``name`` and build its sheet (PlanError on impossible input)."""
    args = build_parser(name).parse_args(list(argv))
    sheet: Sheet = tool_module(name).build(args)
    return sheet


def render(sheet: Sheet, *, explain: bool) -> None:
    from rich.console import Console

    from fitserve.tools.planner.cli import print_sections

    console = Console()
    console.print(f"[bold]{sheet.title}[/bold]")
    for w in sheet.warnings:
        console.print(f"[bold yellow]{w}[/bold yellow]")
    print_sections(console, sheet.sections, explain=explain)
    if sheet.verdict:
        style = "bold green" if sheet.ok else "bold red"
        console.print(f"[{style}]{sheet.verdict}[/{style}]", highlight=False)


def run_tool(name: str, argv: Sequence[str]) -> int:
    """``fitserve plan NAME ARGS``: 0 on an answer, 1 when the answer is "no" (sheet.ok False),
    2 on input that cannot be planned, with the reason on stderr."""
    parser = build_parser(name)
    args = parser.parse_args(list(argv))
    try:
        sheet: Sheet = tool_module(name).build(args)
    except PlanError as e:
        print(f"fitserve plan {name}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(dataclasses.asdict(sheet), indent=1, default=str))
    else:
        render(sheet, explain=args.explain)
    return 0 if sheet.ok else 1
