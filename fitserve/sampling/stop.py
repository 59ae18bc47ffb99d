"""Stop conditions checked after every sampled token (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from fitserve.types import FinishReason


@dataclass(slots=True)
class StopDecision:
    reason: FinishReason
    stop_reason: str | int | None  # the stop string or token id that matched, like vLLM
    text_end: int | None = None  # truncate the output text here (stop strings)


def find_stop_string(
    text: str, new_text_len: int, stops: list[str], include: bool
) -> tuple[str, int] | None:
    """First stop string that ends inside the newest ``new_text_len`` characters of ``text``.

    Returns (stop, cut) where ``text[:cut]`` is the output kept. Only the tail that could
    contain a new match is searched, so a long generation stays linear.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_text_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx >= 0 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return None
    idx, stop = best
    return stop, idx + len(stop) if include else idx


def check_stop(
    *,
    token_id: int,
    num_output_tokens: int,
    max_tokens: int,
    num_total_tokens: int,
    max_model_len: int,
    eos_token_ids: tuple[int, ...],
    stop_token_ids: list[int],
    ignore_eos: bool,
    text: str,
    new_text_len: int,
    stop_strings: list[str],
    include_stop_str: bool,
    min_tokens: int = 0,
) -> StopDecision | None:
    """vLLM order: EOS / stop tokens, then stop strings, then the length limits.

    Before ``min_tokens`` output tokens only the length limits apply (vLLM's ``check_stop``;
    the sampler also bans EOS and stop tokens until then, see sampling.token_masks).
    """
    if num_output_tokens < min_tokens:
        stop_strings, stop_token_ids, ignore_eos = [], [], True
    if not ignore_eos and token_id in eos_token_ids:
        return StopDecision(FinishReason.STOP, None)
    if token_id in stop_token_ids:
        return StopDecision(FinishReason.STOP, token_id)
    if stop_strings:
        hit = find_stop_string(text, new_text_len, stop_strings, include_stop_str)
        if hit is not None:
            return StopDecision(FinishReason.STOP, hit[0], text_end=hit[1])
    if num_output_tokens >= max_tokens or num_total_tokens >= max_model_len:
        return StopDecision(FinishReason.LENGTH, None)
    return None
