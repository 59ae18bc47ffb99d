"""Several replicas' Prometheus texts as one exposition, each sample labelled ``replica``.

Families stay grouped (HELP/TYPE once, then every replica's samples), as the text format requires.
"""

from __future__ import annotations


def merge_metrics(texts: dict[str, str]) -> str:
    """``{replica: its /metrics text}`` -> one text with ``replica="..."`` on every sample."""
    order: list[str] = []
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in texts.items():
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    if family not in heads:
                        order.append(family)
                        heads[family], samples[family] = [], []
                    if line not in heads[family]:
                        heads[family].append(line)
                continue
            if family not in heads:  # a sample before any HELP/TYPE
                order.append(family)
                heads[family], samples[family] = [], []
            samples[family].append(with_label(line, "replica", replica))
    out: list[str] = []
    for family in order:
        out += heads[family] + samples[family]
    return "\n".join(out) + "\n"


def with_label(sample: str, name: str, value: str) -> str:
    """One sample line with one more label (first, so any existing labels follow)."""
    label = f'{name}="{value}"'
    brace = sample.find("{")
    space = sample.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        rest = sample[brace + 1:]
        return f"{sample[:brace]}{{{label}{',' if not rest.startswith('}') else ''}{rest}"
    return f"{sample[:space]}{{{label}}}{sample[space:]}"
