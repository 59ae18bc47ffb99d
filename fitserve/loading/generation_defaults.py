"""Sampling defaults a model file recommends, and the defaults a server puts in force.

Two sources of *model* defaults, read torch-free:

- a Hugging Face folder's ``generation_config.json``: ``temperature``, ``top_p``, ``top_k``,
  ``min_p``, ``repetition_penalty`` (what vLLM's ``--generation-config auto`` reads);
- a GGUF file's ``general.sampling.*`` keys: ``temp``, ``top_p``, ``top_k``, ``min_p``,
  ``penalty_repeat`` (``gguf.Keys.General.SAMPLING_*``).

Then :func:`resolve_default_sampling` decides, field by field, what a request that omits a
field gets::

    explicit server flag (--default-top-k 20)            wins over
    the model's file (generation-config "auto")           wins over
    the server's built-in defaults (SERVER_DEFAULTS)      (only when the model says nothing)

When the model's file names some fields, the ones it leaves out are *neutral* (OpenAI/vLLM:
temperature 1, no top-p/top-k/min-p cut, no penalty), as in vLLM, so the creator's recipe is
not mixed with another one. A field given in the request itself always wins; that is the
protocol's job (``fitserve.server.protocol``).
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fitserve.loading.errors import ModelLoadError

log = logging.getLogger("fitserve.loading")

SAMPLING_FIELDS: tuple[str, ...] = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The request fields that take a default from the model or the server."""

# NOTE: llama.cpp's own defaults (common/common.h: temp 0.80, top_k 40, top_p 0.95, min_p 0.05,
# penalty_repeat 1.00). OpenAI's temperature 1 with no cut makes small models write gibberish;
# these keep the 135M default model coherent, and they are what a llama.cpp user already knows.
SERVER_DEFAULTS: dict[str, float | int] = {
    "temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.0,
}
# The values of SamplingParams() (OpenAI/vLLM): what "not set by the model's recipe" means.
NEUTRAL: dict[str, float | int] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
}

HF_FILE = "generation_config.json"
GGUF_KEYS: dict[str, str] = {  # gguf.Keys.General.SAMPLING_* -> request field
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
GenerationConfigMode = Literal["auto", "vllm"]


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Sampling defaults a model file recommends; ``None`` where the file says nothing.

    ``source`` names where they were read (``"generation_config.json"``, ``"GGUF
    general.sampling.*"``), or is None when the file has none.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    source: str | None = None

    def values(self) -> dict[str, float | int]:
        """The fields the file sets, by request field name."""
        out: dict[str, float | int] = {}
        for name in SAMPLING_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    @property
    def is_empty(self) -> bool:
        return not self.values()


@dataclass(frozen=True, slots=True)
class DefaultSampling:
    """The defaults in force for requests that omit a field, and where each one came from."""

    values: dict[str, float | int] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for the log: ``temperature=0.8 (server default), top_p=0.95 (...)``."""
        return ", ".join(f"{k}={self.values[k]} ({self.sources[k]})" for k in self.values)


def _valid(name: str, raw: object) -> bool:
    """Whether ``raw`` is a usable value of the sampling field ``name`` (SamplingParams' ranges)."""
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        return False
    if name == "top_k":
        return float(raw).is_integer() and raw >= -1
    if name == "temperature":
        return raw >= 0
    if name == "top_p":
        return 0 < raw <= 1
    if name == "min_p":
        return 0 <= raw <= 1
    return raw > 0  # repetition_penalty


def _check(name: str, raw: object, where: str) -> float | int | None:
    """``raw`` as a value of ``name``, or None (logged) if the file's value is unusable."""
    if not _valid(name, raw):
        # NOTE: a bad recommendation is not worth refusing the model over: warn and ignore it,
        # so the field falls back to the next source.
        log.warning("%s: ignoring invalid default %s=%r", where, name, raw)
        return None
    assert isinstance(raw, int | float)
    return int(raw) if name == "top_k" else float(raw)


def from_hf_generation_config(data: Mapping[str, Any], where: str = HF_FILE) -> GenerationDefaults:
    """The sampling defaults of a parsed ``generation_config.json``.

    NOTE: with ``"do_sample": false`` transformers' generate() is greedy and ignores the
    sampling fields, so we ignore them too (temperature/top_p/top_k/min_p); the repetition
    penalty still applies, as in greedy HF generation. Absent ``do_sample`` counts as "not
    false" (as in vLLM, which reads the fields whatever do_sample says). Values are taken as
    written; vLLM additionally drops values equal to transformers' class defaults (e.g. an
    explicit ``top_k: 50``), we do not.
    """
    sampling = data.get("do_sample") is not False
    found: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        if name not in data or data[name] is None:
            continue
        if not sampling and name != "repetition_penalty":
            continue
        value = _check(name, data[name], where)
        if value is not None:
            found[name] = value
    return GenerationDefaults(**found, source=HF_FILE if found else None)


def _shortest_float32(x: float) -> float:
    """The shortest decimal that is the same float32 as ``x`` (0.6000000238 -> 0.6), else ``x``.

    NOTE: GGUF stores these keys as float32; the model card should show the 0.6 the file's
    author wrote, and 0.6 is the very same float32, so sampling is unchanged.
    """
    as_f32 = struct.unpack("<f", struct.pack("<f", x))[0]
    if as_f32 != x:
        return x  # a float64 value that float32 cannot hold: keep it
    for digits in range(1, 10):
        short = float(f"{x:.{digits}g}")
        if struct.unpack("<f", struct.pack("<f", short))[0] == x:
            return short
    return x


def from_gguf_metadata(fields: Mapping[str, Any], where: str = "GGUF") -> GenerationDefaults:
    """The sampling defaults among a GGUF file's metadata (``{key: field.contents()}``)."""
    found: dict[str, Any] = {}
    for key, name in GGUF_KEYS.items():
        if fields.get(key) is None:
            continue
        value = _check(name, fields[key], f"{where} {key}")
        if isinstance(value, float):
            value = _shortest_float32(value)
        if value is not None:
            found[name] = value
    return GenerationDefaults(**found, source="GGUF general.sampling.*" if found else None)


def read_generation_defaults(path: Path) -> GenerationDefaults:
    """The sampling defaults of a model: an HF folder (or its config.json) or a .gguf file.

    The loader passes metadata it has already parsed (see ``fitserve.loading.gguf``); this
    reads the file itself, for the planner and tools. A folder without
    ``generation_config.json`` has no defaults; an unreadable one is logged and ignored.
    """
    folder = path.parent if path.name == "config.json" else path
    if folder.is_dir():
        gen = folder / HF_FILE
        if not gen.is_file():
            return GenerationDefaults()
        try:
            data = json.loads(gen.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            log.warning("%s: unreadable, no sampling defaults taken: %s", gen, exc)
            return GenerationDefaults()
        return from_hf_generation_config(data, str(gen)) if isinstance(data, dict) else GenerationDefaults()
    return from_gguf_metadata(gguf_scalar_metadata(path, GGUF_KEYS), str(path))


# GGUF value types (gguf.GGUFValueType) -> struct format of a scalar; 8 STRING, 9 ARRAY
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
                 12: "d"}


def gguf_scalar_metadata(path: Path, keys: Mapping[str, object] | None = None) -> dict[str, Any]:
    """Scalar and string metadata of a GGUF file (only ``keys``' if given); arrays skipped.

    NOTE: gguf.GGUFReader parses every array (~100k vocabulary strings) into numpy objects,
    seconds for a small model; this walks the key/value section with struct and skips
    arrays by length, in milliseconds. Layout (GGUF v2/v3)::

        "GGUF" u32 version  u64 n_tensors  u64 n_kv  { str key  u32 type  value } * n_kv
        str = u64 length + UTF-8 bytes;  array = u32 item type  u64 count  items
    """
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _scan_gguf(mm, keys)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: unreadable GGUF metadata ({type(exc).__name__}: {exc})") from exc


def _scan_gguf(mm: mmap.mmap, keys: Mapping[str, object] | None) -> dict[str, Any]:
    if mm[:4] != b"GGUF":
        raise ValueError(f"not a GGUF file (starts with {mm[:4]!r})")
    e = "<" if struct.unpack_from("<I", mm, 4)[0] & 0xFFFF else ">"  # a swapped version: big-endian
    version = struct.unpack_from(e + "I", mm, 4)[0]
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    n_kv = struct.unpack_from(e + "Q", mm, 16)[0]
    off, out = 24, {}

    def string(at: int) -> tuple[str, int]:
        n = struct.unpack_from(e + "Q", mm, at)[0]
        if at + 8 + n > len(mm):
            raise ValueError("a string runs past the end of the file")
        return mm[at + 8: at + 8 + n].decode("utf-8"), at + 8 + n

    def skip_array(at: int) -> int:
        item, count = struct.unpack_from(e + "IQ", mm, at)
        at += 12
        if item in _GGUF_SCALARS:
            return int(at + count * struct.calcsize(_GGUF_SCALARS[item]))
        for _ in range(count):
            if item == 8:
                at += 8 + struct.unpack_from(e + "Q", mm, at)[0]
            elif item == 9:
                at = skip_array(at)
            else:
                raise ValueError(f"unknown GGUF value type {item}")
        return at

    for _ in range(n_kv):
        key, off = string(off)
        vtype = struct.unpack_from(e + "I", mm, off)[0]
        off += 4
        value: Any = None
        if vtype in _GGUF_SCALARS:
            value = struct.unpack_from(e + _GGUF_SCALARS[vtype], mm, off)[0]
            off += struct.calcsize(_GGUF_SCALARS[vtype])
        elif vtype == 8:
            value, off = string(off)
        elif vtype == 9:
            off = skip_array(off)
            continue
        else:
            raise ValueError(f"unknown GGUF value type {vtype} for key {key!r}")
        if keys is None or key in keys:
            out[key] = value
    return out


def resolve_default_sampling(
    model: GenerationDefaults,
    mode: GenerationConfigMode = "auto",
    overrides: Mapping[str, float | int | None] | None = None,
) -> DefaultSampling:
    """The defaults a server applies to omitted request fields, each with its source.

    ``mode="vllm"`` ignores the model's file (like vLLM's ``--generation-config vllm``);
    ``overrides`` are the server flags the user gave (``None`` values: flag not given).
    """
    if mode not in ("auto", "vllm"):
        raise ValueError(f"generation config mode must be 'auto' or 'vllm', got {mode!r}")
    use_model = mode == "auto" and not model.is_empty
    values: dict[str, float | int] = dict(NEUTRAL if use_model else SERVER_DEFAULTS)
    base = "neutral (not in the model's recipe)" if use_model else "server default"
    sources = dict.fromkeys(values, base)
    if use_model:
        for name, recommended in model.values().items():
            values[name], sources[name] = recommended, f"model {model.source}"
    for name, value in (overrides or {}).items():
        if name not in SAMPLING_FIELDS:
            raise ValueError(f"unknown sampling default {name!r}; known: {', '.join(SAMPLING_FIELDS)}")
        if value is None:
            continue
        flag = f"--default-{name.replace('_', '-')}"
        if not _valid(name, value):
            raise ValueError(f"{flag}: invalid value {value!r}")
        values[name], sources[name] = value, flag
    return DefaultSampling(values, sources)


__all__ = [
    "GGUF_KEYS", "NEUTRAL", "SAMPLING_FIELDS", "SERVER_DEFAULTS", "DefaultSampling",
    "GenerationConfigMode", "GenerationDefaults", "from_gguf_metadata",
    "from_hf_generation_config", "read_generation_defaults", "resolve_default_sampling",
]
