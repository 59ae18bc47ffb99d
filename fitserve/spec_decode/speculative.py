"""The engine's side of speculative decoding: who proposes drafts before each schedule, and
the counters of what verification accepted.

One :class:`SpeculativeDecoding` per engine with ``speculative_config`` set. Before each
``schedule()`` it gives every decoding request that may speculate (``Tracked.speculates``: no
penalties, no logprobs; not a beam) up to k draft tokens in ``SchedRequest.spec_token_ids``, from
the n-gram lookup (:mod:`fitserve.spec_decode.ngram`), the draft model or the EAGLE-like
head (:mod:`fitserve.spec_decode.draft_model`). The scheduler verifies them in the step
(:mod:`fitserve.sched.scheduler`), the runner accepts or rejects them
(:mod:`fitserve.spec_decode.rejection`), and :meth:`SpeculativeDecoding.observe`
counts the outcome.
"""

from __future__ import annotations

import torch

from fitserve.config import ModelSpec, SpeculativeConfig
from fitserve.engine.outputs import Tracked
from fitserve.kv.manager import KVCacheManager
from fitserve.loading import load_model
from fitserve.model.eagle_head import load_eagle_head
from fitserve.model.llama import build_model, check_supported
from fitserve.runner.model_runner import ModelRunner
from fitserve.sched.request import SchedRequest
from fitserve.sched.scheduler import Scheduler
from fitserve.spec_decode.draft_model import DraftRunner, EagleProposer
from fitserve.spec_decode.ngram import propose_ngram
from fitserve.spec_decode.stats import SpecDecodeStats
from fitserve.types import SchedulerOutput


class SpeculativeDecoding:
    """Proposers and counters for one engine (its target model is ``runner``'s)."""

    def __init__(self, config: SpeculativeConfig, *, target: ModelSpec, runner: ModelRunner,
                 dtype: torch.dtype, device: torch.device, max_model_len: int, block_size: int) -> None:
        self.config = config
        self.stats = SpecDecodeStats(config.num_speculative_tokens)
        self.max_model_len = max_model_len
        self.runner = runner
        self.draft: DraftRunner | None = None
        self.eagle: EagleProposer | None = None
        if config.method == "draft_model":
            self.draft = _build_draft(config, target, dtype=dtype, device=device, max_model_len=max_model_len,
                                      num_blocks=runner.num_blocks, block_size=block_size)
        elif config.method == "eagle":
            assert config.model is not None
            head = load_eagle_head(config.model, target.hidden_size, dtype=dtype, device=device)
            runner.keep_hidden = True  # the hidden row that gave each request's latest token
            self.eagle = EagleProposer(head)

    def propose(self, scheduler: Scheduler, requests: dict[str, Tracked], kv: KVCacheManager) -> None:
        """Draft tokens for every decoding request that may speculate, for the next schedule."""
        spec = self.config
        if spec.disable_by_batch_size is not None and scheduler.num_running >= spec.disable_by_batch_size:
            return
        want: list[tuple[SchedRequest, int]] = []
        for req in scheduler.running:
            t = requests.get(req.request_id)
            if t is None or not t.speculates or req.num_tokens - req.num_computed_tokens != 1:
                continue
            # no draft past max_model_len or past the outputs the request may still emit
            k = min(spec.num_speculative_tokens, self.max_model_len - req.num_tokens,
                    req.max_tokens - len(req.output_token_ids) - 1)
            if k > 0:
                want.append((req, k))
        if self.draft is None and self.eagle is None:
            for req, k in want:
                req.spec_token_ids = propose_ngram(req.all_token_ids, k, spec.prompt_lookup_min,
                                                   spec.prompt_lookup_max)
            return
        states = {r.request_id: requests[r.request_id].sampling for r, _ in want}
        if self.draft is not None:
            proposed = self.draft.propose(want, states, kv, self.runner)
        else:
            assert self.eagle is not None
            proposed = self.eagle.propose(want, states, self.runner)
        self.runner.last_hidden = {}
        for rid, drafts in proposed.items():
            target = scheduler.get(rid)
            if target is not None:
                target.spec_token_ids = drafts

    def mirror(self, plan: SchedulerOutput, failed: set[str]) -> None:
        """Keep the draft model's cache in step with the target's (a no-op for the others)."""
        if self.draft is not None:
            self.draft.mirror(plan, skip=failed)

    def observe(self, num_draft: int, emitted: list[int], tracked: Tracked) -> None:
        """Count one verified chunk: its ``num_draft`` drafts, and the ``len(emitted) - 1`` accepted."""
        accepted = len(emitted) - 1
        self.stats.observe(num_draft, accepted)
        tracked.num_draft_tokens += num_draft
        tracked.num_accepted_tokens += accepted


def _build_draft(config: SpeculativeConfig, target: ModelSpec, *, dtype: torch.dtype, device: torch.device,
                 max_model_len: int, num_blocks: int, block_size: int) -> DraftRunner:
    """The draft model of ``method: draft_model``, in the engine's dtype, on the target's block
    tables (it must share the target's vocabulary)."""
    assert config.model is not None
    loaded = load_model(config.model, dtype=dtype)
    if loaded.spec.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model {config.model!r} has a vocabulary of {loaded.spec.vocab_size} "
                         f"tokens, the target {target.vocab_size}: they must share a tokenizer")
    check_supported(loaded.spec)
    model = build_model(loaded.spec, loaded.weights, dtype=dtype, device=device, max_positions=max_model_len)
    return DraftRunner(model, loaded.spec, num_blocks=num_blocks, block_size=block_size, kv_dtype=dtype,
                       device=device)
