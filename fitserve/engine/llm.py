"""LLM: offline batch generation over an Engine, with a progress bar."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.loading.chat_template import load_chat_template
from fitserve.sampling import SamplingParams
from fitserve.sampling.beam_search import BeamSearchParams
from fitserve.spec_decode.stats import SpecDecodeStats
from fitserve.types import BeamSequence, FinishReason, TokenLogprobs

Prompt = str | Sequence[int]


@dataclass(slots=True)
class Completion:
    """One of the n outputs of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: str | int | None
    # speculative decoding: this output's draft tokens verified by the target, and accepted
    # (0 and 0 when speculation is off or the request did not speculate)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class GenerationResult:
    """The result for one prompt, in the order the prompts were given."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[Completion]

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids


@dataclass(slots=True)
class BeamSearchOutput:
    """The beams of one prompt, best first (vLLM's ``BeamSearchOutput``)."""

    prompt_token_ids: list[int]
    sequences: list[BeamSequence]


class LLM:
    """``LLM(model).generate(prompts, params)``: batch generation with continuous batching.

    Keyword arguments are EngineConfig keywords (dtype, max_model_len, num_kv_blocks, ...),
    among them ``weights`` ("auto" = as stored, "bf16", "float32", "int4", "int8") and
    ``quantization`` (None, "int4", "int8": RTN at load, vLLM's spelling). ``chat_template``
    (a Jinja file or the template text, as ``--chat-template``) replaces the model's own.
    """

    def __init__(self, model: str = "smollm2-135m", *, chat_template: str | None = None,
                 **engine_kwargs: object) -> None:
        template = None if chat_template is None else load_chat_template(chat_template)  # fails before loading
        self.engine = Engine(EngineConfig(model=model, **engine_kwargs))  # type: ignore[arg-type]
        self.tokenizer = self.engine.tokenizer
        if template is not None:
            self.tokenizer.chat_template = template

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended defaults (vLLM's method of this name).

        The fields the model file sets (generation_config.json / GGUF general.sampling.*) take
        its values, the rest SamplingParams' own; ``generate(prompts)`` without params keeps
        using plain ``SamplingParams()``, as in vLLM.
        """
        return SamplingParams(**self.engine.loaded.generation_defaults.values())  # type: ignore[arg-type]

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's counters since the engine started (a copy), None when off.

        vLLM reports these through ``LLM.get_metrics()``; here they are the engine's
        :class:`~fitserve.spec_decode.stats.SpecDecodeStats` (drafts, draft and accepted
        tokens, per position; ``acceptance_rate``, ``mean_accepted_length``).
        """
        return self.engine.stats().spec_decode

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (n outputs each); results come in the prompts' order.

        ``priority`` (vLLM's): one per prompt, lower first, with ``scheduling_policy="priority"``.

        A request that fails inside an engine step raises RuntimeError (caused by its error)
        after the engine has isolated it; the other requests are then aborted.
        """
        prompt_list = _as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(f"{len(param_list)} sampling params for {len(prompt_list)} prompts")
        prios = [0] * len(prompt_list) if priority is None else list(priority)
        if len(prios) != len(prompt_list):
            raise ValueError(f"{len(prios)} priorities for {len(prompt_list)} prompts")
        # Validate and queue every sub-request first; on a bad one, withdraw what was queued.
        keys: dict[str, tuple[int, int]] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompt_list, param_list, strict=True)):
                # n samples of one prompt: one prefill, the children fork its blocks; child j
                # is seeded seed + j (vLLM's rule)
                children = [dataclasses.replace(p, n=1, seed=None if p.seed is None else p.seed + j)
                            for j in range(p.n)]
                rids = [f"llm-{id(self)}-{i}-{j}" for j in range(p.n)]
                self.engine.add_requests(prompt, children, rids, priority=prios[i])
                keys.update({rid: (i, j) for j, rid in enumerate(rids)})
        except Exception:
            for rid in keys:
                self.engine.abort(rid)
            raise
        results: list[GenerationResult] = []
        for prompt, p in zip(prompt_list, param_list, strict=True):
            results.append(GenerationResult(prompt if isinstance(prompt, str) else None, [], [None] * p.n))  # type: ignore[list-item]
        show = use_tqdm if use_tqdm is not None else len(keys) > 8
        bar = tqdm(total=len(keys), desc="generate", unit="req", disable=not show)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    # Only the final output carries the cumulative text/tokens: the deltas
                    # before it are not needed here.
                    if not out.finished or out.request_id not in keys:
                        continue
                    if out.error is not None:
                        i, j = keys[out.request_id]
                        raise RuntimeError(f"generation failed for prompt {i} (output {j})") from out.error
                    i, j = keys[out.request_id]
                    results[i].prompt_token_ids = list(out.prompt_token_ids)
                    results[i].outputs[j] = Completion(
                        index=j, text=out.text or "", token_ids=out.token_ids or [],
                        logprobs=out.logprobs, finish_reason=_reason(out.finish_reason),
                        stop_reason=out.stop_reason, num_draft_tokens=out.num_draft_tokens,
                        num_accepted_tokens=out.num_accepted_tokens,
                    )
                    bar.update(1)
        finally:
            bar.close()
            for rid in keys:
                self.engine.abort(rid)
        return results

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        *,
        use_tqdm: bool | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: per prompt, the ``beam_width`` best beams, best first.

        Every prompt's beams run in the engine together, over shared copy-on-write blocks
        (:mod:`fitserve.sampling.beam_search`).
        """
        prompt_list = _as_prompt_list(prompts)
        keys: dict[str, int] = {}
        try:
            for i, prompt in enumerate(prompt_list):
                rid = self.engine.add_beam_search(prompt, params, request_id=f"llm-{id(self)}-beam-{i}")
                keys[rid] = i
        except Exception:
            for rid in keys:
                self.engine.abort(rid)
            raise
        results: list[BeamSearchOutput | None] = [None] * len(prompt_list)
        bar = tqdm(total=len(keys), desc="beam search", unit="req",
                   disable=not (use_tqdm if use_tqdm is not None else len(keys) > 8))
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if not out.finished or out.request_id not in keys:
                        continue
                    i = keys[out.request_id]
                    if out.error is not None:
                        raise RuntimeError(f"beam search failed for prompt {i}") from out.error
                    results[i] = BeamSearchOutput(list(out.prompt_token_ids), list(out.beams or []))
                    bar.update(1)
        finally:
            bar.close()
            for rid in keys:
                self.engine.abort(rid)
        return [r for r in results if r is not None]

    def chat(
        self,
        messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        params: SamplingParams | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, object] | None = None,
        **kwargs: object,
    ) -> list[GenerationResult]:
        """Apply the chat template to one conversation (or a list of them), then generate.

        As vLLM's ``LLM.chat``: ``chat_template`` (its text) replaces the model's for this call,
        ``chat_template_kwargs`` are more template variables; ``continue_final_message`` ends the
        prompt inside the last message (then ``add_generation_prompt`` must be false).
        """
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        # The template writes its own special tokens, so none are added when encoding.
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(
                    list(c), add_generation_prompt=add_generation_prompt,  # type: ignore[arg-type]
                    chat_template=chat_template, continue_final_message=continue_final_message,
                    **(chat_template_kwargs or {})),
                add_special_tokens=False,
            )
            for c in convs
        ]
        return self.generate(prompts, params, **kwargs)  # type: ignore[arg-type]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text or token ids) or a list of them -> a list."""
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value
