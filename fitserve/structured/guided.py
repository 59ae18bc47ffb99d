"""What a request's output must match (structured output), as data: the contract between the
server (which builds it from ``response_format`` / ``guided_*`` / ``tools``) and the engine's
constrained decoding (fitserve.structured, which compiles it and masks the logits).

Torch-free and grammar-library-free, like SamplingParams.
"""

from __future__ import annotations

from dataclasses import dataclass

# kind -> what ``value`` holds
GUIDED_KINDS = {
    "json_object": "ignored (any JSON object)",
    "json_schema": "a JSON schema, as JSON text",
    "regex": "a regular expression the whole output matches",
    "choice": "a JSON list of strings: the output is exactly one of them",
    "grammar": "a context-free grammar: GBNF (llama.cpp) or Lark/EBNF",
}


@dataclass(frozen=True, slots=True)
class GuidedDecoding:
    """The output (after any prefix the caller adds) must match ``value`` of ``kind``."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise ValueError(f"guided decoding kind must be one of {', '.join(GUIDED_KINDS)}, "
                             f"got {self.kind!r}")
        if self.kind != "json_object" and not isinstance(self.value, str):
            raise ValueError(f"guided {self.kind} needs its {GUIDED_KINDS[self.kind]} as text")
