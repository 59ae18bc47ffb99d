"""Rebuild the held-out texts of ``fitserve eval`` from Debian packages (stdlib only).

    cd /tmp && apt-get download r-cran-janeaustenr bible-kjv bible-kjv-text
    for f in *.deb; do dpkg-deb -x "$f" root; done
    python fitserve/tools/eval/data/extract_heldout.py /tmp/root fitserve/tools/eval/data

Writes ``austen_persuasion.txt`` (chapters 1-3 of *Persuasion*, from the R
package janeaustenr's lazy-load database) and ``kjv_ecclesiastes.txt`` (chapters 1-6 of
Ecclesiastes, King James Version, printed by the ``bible`` program of bible-kjv). See
README.md in this folder for the versions, licences and checksums.

The R data sit in ``data/Rdata.rdb``: each object is a 4-byte big-endian length followed by a
zlib stream of R's XDR serialization; ``Rdata.rdx`` (gzip, the same serialization) maps each
object name to its (offset, length). The small reader below handles the node types these
files use (character/numeric vectors, pairlists, symbols, references), not all of R.
"""

from __future__ import annotations

import gzip
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

_NIL, _REF, _SYM, _LIST, _CHAR = 254, 255, 1, 2, 9
_VECTORS = {10: ">i", 13: ">i", 14: ">d"}  # logical, integer, double
_LISTS = (16, 19, 20)  # character, list, expression
_PAIRS = (2, 3, 5, 6, 17)  # pairlist, closure, promise, language, dots
_EMPTY = (241, 242, 251, 252, 253)  # baseenv, emptyenv, missing arg, unbound, globalenv


class _XDR:
    """A reader of R's XDR serialization (format versions 2 and 3)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos, self.refs = data, 0, []
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialization")
        self.pos = 2
        version = self.int()
        self.int(), self.int()  # writer's and minimal reader's R version
        if version == 3:
            n = self.int()  # then the native encoding's name
            self.pos += n

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return int(v)

    def length(self) -> int:
        n = self.int()
        return n if n != -1 else (self.int() << 32) + self.int()

    def item(self) -> Any:
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == _NIL or kind in _EMPTY:
            return None
        if kind == _REF:
            idx = flags >> 8 or self.int()
            return self.refs[idx - 1]
        if kind == _SYM:
            sym = ("sym", self.item())
            self.refs.append(sym)
            return sym
        if kind == _CHAR:
            n = self.int()
            value = None if n == -1 else self.data[self.pos:self.pos + n].decode("utf-8")
            self.pos += max(n, 0)
            return value
        if kind in _PAIRS:
            attr = self.item() if has_attr else None
            tag = self.item() if has_tag else None
            car, cdr = self.item(), self.item()
            return {"tag": tag, "car": car, "cdr": cdr, "attr": attr}
        if kind in _VECTORS:
            fmt, n = _VECTORS[kind], self.length()
            size = struct.calcsize(fmt)
            out: Any = list(struct.unpack_from(">" + fmt[1] * n, self.data, self.pos))
            self.pos += size * n
        elif kind in _LISTS:
            out = [self.item() for _ in range(self.length())]
        else:
            raise ValueError(f"R node type {kind} is not handled by this small reader")
        attrs = _pairlist(self.item()) if has_attr else {}
        if kind == 19 and attrs.get("names"):
            return dict(zip(attrs["names"], out, strict=True))  # a named list
        return out


def _pairlist(node: Any) -> dict[str, Any]:
    out = {}
    while isinstance(node, dict):
        out[node["tag"][1]] = node["car"]
        node = node["cdr"]
    return out


def read_rdata(data_dir: Path) -> dict[str, Any]:
    """Every object of an R package's lazy-loaded ``data/Rdata.rd[bx]``, by name."""
    index = _XDR(gzip.decompress((data_dir / "Rdata.rdx").read_bytes())).item()
    db = (data_dir / "Rdata.rdb").read_bytes()
    out = {}
    for name, (offset, length) in index["variables"].items():
        blob = db[int(offset):int(offset) + int(length)]
        out[name] = _XDR(zlib.decompress(blob[4:])).item()
    return out


def _paragraphs(lines: list[str]) -> str:
    """Rejoin the book's wrapped lines into one paragraph per line, blank lines between."""
    paras, cur = [], []
    for line in lines:
        if line.strip():
            cur.append(line.strip())
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    return "\n\n".join(paras) + "\n"


def austen_chapters(root: Path, book: str = "persuasion", first: int = 1, last: int = 3) -> str:
    """Chapters ``first``..``last`` of one of janeaustenr's books (default *Persuasion*)."""
    lib = root / "usr/lib/R/site-library/janeaustenr/data"
    lines: list[str] = read_rdata(lib)[book]
    heads = [i for i, s in enumerate(lines) if re.fullmatch(r"Chapter \d+", s.strip(), re.I)]
    start, stop = heads[first - 1], heads[last] if last < len(heads) else len(lines)
    return _paragraphs(lines[start:stop])


def kjv_book(root: Path, ref: str = "Ecclesiastes1:1-6:12") -> str:
    """A passage of the KJV, printed by the ``bible`` program (one verse a line, ``-f``: each
    with its reference, ``Eccl1:1 ...``, which is dropped here)."""
    exe, data = root / "usr/bin/bible", root / "usr/lib/bible.data"
    out = subprocess.run([str(exe), "-f", "-d", str(data), ref], check=True,
                         capture_output=True, text=True).stdout
    verses = [re.sub(r"^\S+\d+:\d+ ", "", line.strip()) for line in out.splitlines()]
    return "\n".join(v for v in verses if v) + "\n"


def main(argv: list[str]) -> int:
    """``extract_heldout.py ROOT OUT_DIR``: ROOT holds the unpacked .deb files."""
    root, out = Path(argv[1]), Path(argv[2])
    (out / "austen_persuasion.txt").write_text(austen_chapters(root), encoding="utf-8")
    (out / "kjv_ecclesiastes.txt").write_text(kjv_book(root), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
