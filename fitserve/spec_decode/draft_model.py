"""Speculative decoding with a draft model: a second, smaller model that shares the target's
tokenizer, block tables and slots, and proposes ``k`` tokens per request each step.

The draft keeps its own K/V tensors over the *same* block ids as the target (same number of
blocks and block size), so one block table addresses both caches and the scheduler's
allocation, copy-on-write and rollback serve both::

    target cache  [kv_heads, num_blocks, block_size, head_dim] x layers     slot(p) from the table
    draft cache   [kv_heads', num_blocks, block_size, head_dim'] x layers'  the same slot(p)

Every step the draft runs the target's chunks too (:meth:`DraftRunner.mirror`: prompts, decodes
and verification chunks), so its K/V covers every token the target computed. Then
:meth:`DraftRunner.propose` runs ``k`` one-token steps per decoding request from its last token,
writing draft K/V at the lookahead positions (their blocks are allocated first) and sampling
each draft from the draft's own distribution ``q`` (greedy: its argmax); ``q`` goes to the
rejection sampler with the target's verification.

:class:`EagleProposer` drafts from the target's own last hidden state instead
(:mod:`fitserve.model.eagle_head`): no second model, no second cache.
"""

from __future__ import annotations

import torch

from fitserve.config import ModelSpec
from fitserve.kv.manager import KVCacheManager
from fitserve.model.eagle_head import EagleHead
from fitserve.model.llama import CausalLM
from fitserve.runner.model_runner import ModelRunner, decode_rows_first
from fitserve.sampling import RequestSamplingState
from fitserve.sched.request import SchedRequest
from fitserve.types import ScheduledChunk, SchedulerOutput


class DraftRunner:
    """The draft model over the target's block tables."""

    def __init__(self, model: CausalLM, spec: ModelSpec, *, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype, device: torch.device) -> None:
        self.runner = ModelRunner(model, spec, num_blocks=num_blocks, block_size=block_size,
                                  kv_dtype=kv_dtype, device=device)
        self.block_size = block_size
        self.device = device

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes

    @torch.inference_mode()
    def mirror(self, plan: SchedulerOutput, skip: set[str]) -> None:
        """Run the draft over the step's chunks (not ``skip``'s: they failed), after the same
        copy-on-write copies, so its cache holds every token the target computed."""
        if plan.block_copies:
            self.runner.copy_blocks(plan.block_copies)
        chunks = [c for c in plan.chunks if c.request_id not in skip]
        if chunks:
            self.runner._forward(*self.runner._prepare(decode_rows_first(chunks)))

    @torch.inference_mode()
    def propose(self, reqs: list[tuple[SchedRequest, int]], states: dict[str, RequestSamplingState],
                kv: KVCacheManager, target: ModelRunner) -> dict[str, list[int]]:
        """Up to ``k`` draft tokens for each (request, k) (prompt and outputs computed but the
        last token), and ``target.draft_probs[id]`` = the draft's q at each of them for random
        requests.

        The lookahead positions ``num_computed .. num_computed + k - 1`` get their blocks first
        (copy-on-write copies made in both caches); a request the pool cannot serve gets none.
        """
        target.draft_probs.clear()  # last step's, verified or dropped
        live: list[SchedRequest] = []
        limit: dict[str, int] = {}
        for r, k in reqs:
            start = r.num_computed_tokens
            copies = kv.allocate_for_write(r.request_id, start, start + k)
            if copies is None:
                continue
            if copies:
                target.copy_blocks(copies)
                self.runner.copy_blocks(copies)
            live.append(r)
            limit[r.request_id] = k
        drafts: dict[str, list[int]] = {r.request_id: [] for r in live}
        qs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in live}
        last = {r.request_id: r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1]
                for r in live}
        sampler = target.sampler
        for j in range(max(limit.values(), default=0)):
            live = [r for r in live if j < limit[r.request_id]]
            if not live:
                break
            chunks = [ScheduledChunk(request_id=r.request_id, token_ids=[last[r.request_id]],
                                     start_pos=r.num_computed_tokens + j,
                                     block_table=kv.block_table(r.request_id), sample=True)
                      for r in live]
            hidden = self.runner._forward(*self.runner._prepare(chunks))
            logits = self.runner.model.compute_logits(hidden).float()
            row_states = [states[r.request_id] for r in live]
            q = sampler.probabilities(logits, row_states)
            for i, r in enumerate(live):
                rid = r.request_id
                st = row_states[i]
                if st.params.greedy:
                    tok = int(q[i].argmax())
                else:
                    tok = int(torch.multinomial(q[i], 1, generator=st.generator or sampler.generator))
                    qs[rid].append(q[i])
                drafts[rid].append(tok)
                last[rid] = tok
        for rid, rows in qs.items():
            if rows:
                target.draft_probs[rid] = torch.stack(rows)
        return drafts


class EagleProposer:
    """Drafts with an EAGLE-like head over the target's last hidden state of each request."""

    def __init__(self, head: EagleHead) -> None:
        self.head = head

    @torch.inference_mode()
    def propose(self, reqs: list[tuple[SchedRequest, int]], states: dict[str, RequestSamplingState],
                target: ModelRunner) -> dict[str, list[int]]:
        """Up to k drafts per (request, k) from ``target.last_hidden`` (the hidden state whose
        logits gave the request's last token) and that token; q rows to ``target.draft_probs``."""
        target.draft_probs.clear()
        live = [(r, k) for r, k in reqs if r.request_id in target.last_hidden]
        if not live:
            return {}
        model, sampler = target.model, target.sampler
        h = torch.stack([target.last_hidden[r.request_id] for r, _ in live])
        x = torch.tensor([r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1]
                          for r, _ in live], dtype=torch.long, device=h.device)
        row_states = [states[r.request_id] for r, _ in live]
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in live}
        qs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in live}
        for j in range(max(k for _, k in live)):
            h = self.head(model.embed_tokens(x).to(h.dtype), h)
            q = sampler.probabilities(model.compute_logits(h), row_states)
            toks: list[int] = []
            for i, (r, k) in enumerate(live):
                st = row_states[i]
                if st.params.greedy:
                    tok = int(q[i].argmax())
                else:
                    tok = int(torch.multinomial(q[i], 1, generator=st.generator or sampler.generator))
                toks.append(tok)
                if j < k:  # a row past its k keeps running with the batch, unused
                    drafts[r.request_id].append(tok)
                    if not st.params.greedy:
                        qs[r.request_id].append(q[i])
            x = torch.tensor(toks, dtype=torch.long, device=h.device)
        for rid, rows in qs.items():
            if rows:
                target.draft_probs[rid] = torch.stack(rows)
        return drafts
