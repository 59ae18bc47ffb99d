"""One request's position in its grammar: the llguidance matcher the sampler masks with.

The engine owns the state's life cycle::

    add_request   CompiledGrammar.new_state()   (each n>1 child its own copy)
    every step    sampler: fill_bitmask(row)    (reads the state, never changes it)
    after update  advance(token)                (the token the scheduler kept)
    stopped?      the request finishes with finish_reason "stop"

The sampler only reads the state, so a step that is rerun (the engine isolating a failing
request) or a request that is preempted and recomputed sees the same mask again: the matcher
moves only when a token is really appended to the request's outputs.
"""

from __future__ import annotations

import llguidance
import torch


class GuidedDecodingError(RuntimeError):
    """The grammar cannot go on: a token it does not allow, or llguidance's own error state
    (e.g. a resource limit). The request fails alone (finish_reason "error")."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of the token bitmask: one bit per token id."""
    return (vocab_size + 31) // 32


class GuideState:
    """A request's matcher; ``vocab_size`` is the width its bitmask covers."""

    __slots__ = ("_matcher", "num_tokens", "vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.num_tokens = 0  # tokens consumed (the request's output tokens so far)

    @property
    def is_stopped(self) -> bool:
        """True once the grammar admits no more tokens: the output is complete."""
        return bool(self._matcher.is_stopped()) and not self._matcher.is_error()

    @property
    def is_accepting(self) -> bool:
        """True when the output so far is a complete match (EOS is then allowed)."""
        return bool(self._matcher.is_accepting())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, contiguous, on CPU)."""
        self._raise_if_error()
        target = bitmask[row]
        nbytes = target.numel() * target.element_size()
        if nbytes != 4 * bitmask_words(self.vocab_size):
            raise ValueError(f"a bitmask row of {nbytes} B, the grammar needs "
                             f"{4 * bitmask_words(self.vocab_size)} B")
        # NOTE: llguidance writes straight into the tensor's memory, without the GIL.
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), nbytes)
        self._raise_if_error()

    def advance(self, token: int) -> None:
        """Consume the request's next output token; GuidedDecodingError if it is not allowed."""
        if not self._matcher.consume_token(int(token)):
            raise GuidedDecodingError(
                f"token {token} does not fit the guided grammar after {self.num_tokens} tokens: "
                f"{self._matcher.get_error() or 'rejected'}")
        self.num_tokens += 1

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` consumed tokens (GuidedDecodingError if it cannot)."""
        if num_tokens > self.num_tokens or not self._matcher.rollback(num_tokens):
            raise GuidedDecodingError(f"cannot roll the grammar back {num_tokens} of "
                                      f"{self.num_tokens} tokens")
        self.num_tokens -= num_tokens

    def fork(self) -> GuideState:
        """An independent copy at the same position (a sibling that goes its own way)."""
        copy = GuideState(self._matcher.deep_copy(), self.vocab_size)
        copy.num_tokens = self.num_tokens
        return copy

    def _raise_if_error(self) -> None:
        if self._matcher.is_error():
            raise GuidedDecodingError(f"the guided grammar failed: {self._matcher.get_error()}")
