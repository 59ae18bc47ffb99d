"""The argument parser every fitserve command uses: no abbreviations, and an unknown flag names
the nearest known one.

``allow_abbrev=False``: argparse would otherwise take any unambiguous prefix of a flag, so a
llama.cpp habit like ``-t 2`` (threads) silently became ``-tp 2`` (tensor parallelism). An
unknown flag exits 2 with ``did you mean --x?`` (``difflib.get_close_matches`` over the
command's own flags). Subcommands made with ``add_subparsers`` inherit the class.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any


class FitserveArgumentParser(argparse.ArgumentParser):
    """ArgumentParser with abbreviations off and unknown flags answered with the nearest name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, extras = super().parse_known_args(args, namespace)
        flags = [a.split("=", 1)[0] for a in extras if a.startswith("-") and a != "-"]
        if flags:  # NOTE: here, where this (sub)command's own flags are known, not at the top
            self.error(unknown_flag_message(flags, self.known_flags()))
        return ns, extras

    def known_flags(self) -> list[str]:
        """Every option string this parser takes."""
        return [s for a in self._actions for s in a.option_strings]


def unknown_flag_message(flags: Sequence[str], known: Sequence[str]) -> str:
    """``unrecognized argument: --x (did you mean --y?)`` for each unknown flag."""
    parts = []
    for flag in flags:
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        parts.append(f"{flag} (did you mean {close[0]}?)" if close else flag)
    noun = "argument" if len(parts) == 1 else "arguments"
    return f"unrecognized {noun}: {', '.join(parts)}"
