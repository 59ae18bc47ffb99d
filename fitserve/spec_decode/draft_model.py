"""Speculative decoding with a draft model: a second, smaller model that shares the target's
tokenizer, block tables and slots, and proposes ``k`` tokens per request each step.

The draft keeps its own K/V tensors over the *same* block ids as the target (same number of
blocks and block size), so one block table addresses both caches and the scheduler's
allocation, copy-on-write and rollback serve both::

    target cache  [kv_heads, num_blocks, block_size, head_dim] x layers     slot(p) from the table
    draft cache   [kv_heads', num_blocks, block_size, head_dim'] x layers'  the same slot(p)

After every step the draft runs the target's chunks too (:meth:`DraftModelProposer.after_step`:
prompts, decodes and verification chunks), so its K/V covers every token the target computed.
Then :meth:`DraftModelProposer.propose` runs ``k`` one-token steps per decoding request from its
last token, writing draft K/V at the lookahead positions (their blocks are allocated first) and
sampling each draft from the draft's own distribution ``q`` (greedy: its argmax); ``q`` goes to
the rejection sampler with the target's verification.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

import torch

from fitserve.config import ModelSpec
from fitserve.kv.manager import KVCacheManager
from fitserve.loading import load_model
from fitserve.model.llama import CausalLM
from fitserve.model.loader import build_model, check_supported
from fitserve.runner.model_runner import ModelRunner, decode_rows_first
from fitserve.sampling import RequestSamplingState, Sampler
from fitserve.spec_decode.proposer import Draft, DraftRequest, Drafts
from fitserve.types import ScheduledChunk, SchedulerOutput


class DraftModelProposer:
    """The draft model over the target's block tables (a Proposer)."""

    needs_hidden_states = False

    def __init__(self, model: CausalLM, spec: ModelSpec, *, target: ModelRunner, kv: KVCacheManager,
                 kv_dtype: torch.dtype, device: torch.device) -> None:
        self.runner = ModelRunner(model, spec, num_blocks=target.num_blocks, block_size=target.block_size,
                                  kv_dtype=kv_dtype, device=device)
        self.kv = kv
        # NOTE: lookahead blocks are allocated here, before the step, so a copy-on-write copy
        # they need is made in the target's cache too, at once (the block may be reused later)
        self.copy_target_blocks = target.copy_blocks
        self.sampler = target.sampler  # the target's: the same unseeded RNG stream as before

    @torch.inference_mode()
    def after_step(self, plan: SchedulerOutput, failed: Set[str]) -> None:
        """Run the draft over the step's chunks (not ``failed``'s), after the same copy-on-write
        copies, so its cache holds every token the target computed."""
        if plan.block_copies:
            self.runner.copy_blocks(plan.block_copies)
        chunks = [c for c in plan.chunks if c.request_id not in failed]
        if chunks:
            self.runner.forward_chunks(decode_rows_first(chunks))

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        """Up to ``num_drafts`` drafts per request, with q rows for random requests.

        The lookahead positions ``num_computed .. num_computed + k - 1`` get their blocks first
        (copy-on-write copies made in both caches); a request the pool cannot serve gets none.
        """
        live: list[DraftRequest] = []
        for r in requests:
            start = r.num_computed_tokens
            copies = self.kv.allocate_for_write(r.request_id, start, start + r.num_drafts)
            if copies is None:
                continue
            if copies:
                self.copy_target_blocks(copies)
                self.runner.copy_blocks(copies)
            live.append(r)
        drafts = {r.request_id: Draft([]) for r in live}
        qs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in live}
        last = {r.request_id: r.last_token_id for r in live}
        for j in range(max((r.num_drafts for r in live), default=0)):
            live = [r for r in live if j < r.num_drafts]
            chunks = [ScheduledChunk(request_id=r.request_id, token_ids=[last[r.request_id]],
                                     start_pos=r.num_computed_tokens + j,
                                     block_table=self.kv.block_table(r.request_id), sample=True)
                      for r in live]
            logits = self.runner.model.compute_logits(self.runner.forward_chunks(chunks)).float()
            states = [r.sampling for r in live]
            q = self.sampler.probabilities(logits, states)
            for i, (r, tok) in enumerate(zip(live, sample_drafts(q, states, self.sampler), strict=True)):
                drafts[r.request_id].token_ids.append(tok)
                last[r.request_id] = tok
                if not r.sampling.params.greedy:
                    qs[r.request_id].append(q[i])
        for rid, rows in qs.items():
            if rows:
                drafts[rid].probs = torch.stack(rows)
        return drafts


def sample_drafts(q: torch.Tensor, states: Sequence[RequestSamplingState], sampler: Sampler) -> list[int]:
    """One draft per row of ``q`` ([B, V] from ``Sampler.probabilities``): a greedy row's argmax,
    a random row's draw from its request's generator, else the sampler's; rows in order."""
    out: list[int] = []
    for row, st in zip(q, states, strict=True):
        if st.params.greedy:
            out.append(int(row.argmax()))
        else:
            out.append(int(torch.multinomial(row, 1, generator=st.generator or sampler.generator)))
    return out


def load_draft_model(path: str, target: ModelSpec, *, dtype: torch.dtype, device: torch.device,
                     max_model_len: int) -> tuple[CausalLM, ModelSpec]:
    """The draft model of ``method: draft_model`` in the engine's dtype; it must share the
    target's vocabulary (ValueError otherwise)."""
    loaded = load_model(path, dtype=dtype)
    if loaded.spec.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model {path!r} has a vocabulary of {loaded.spec.vocab_size} "
                         f"tokens, the target {target.vocab_size}: they must share a tokenizer")
    check_supported(loaded.spec)
    # consume: nothing else holds these weights, so each fused part is freed as it goes
    model = build_model(loaded.spec, loaded.weights, dtype=dtype, device=device,
                        max_positions=max_model_len, consume=True)
    return model, loaded.spec
