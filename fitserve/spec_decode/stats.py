"""Counters of speculative decoding, vLLM's names and definitions. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    """Since start: verification chunks (``num_drafts``), draft tokens in them, drafts accepted,
    and accepted drafts by position (index 0 = the first draft token of a chunk).

    ``mean_accepted_length`` is tokens emitted per verification (the accepted drafts plus the
    one token every verification yields), vLLM's "mean acceptance length".
    """

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafts_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.accepted_per_position = self.accepted_per_position or [0] * k
        self.drafts_per_position = self.drafts_per_position or [0] * k

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """One verified chunk: ``num_draft`` drafts of which the first ``num_accepted`` held."""
        if not 0 <= num_accepted <= num_draft <= self.num_speculative_tokens:
            raise ValueError(f"accepted {num_accepted} of {num_draft} drafts (k={self.num_speculative_tokens})")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for i in range(num_draft):
            self.drafts_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed drafts (0.0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: 1 + accepted drafts per chunk (0.0 before any)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_by_position(self) -> list[float]:
        """Per draft position: accepted over proposed there."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafts_per_position, strict=True)]
