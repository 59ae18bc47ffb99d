"""Speculative decoding with an EAGLE-like head (:mod:`fitserve.model.eagle_head`): drafts from
the target's own last hidden state, through the target's embedding and ``lm_head``; no second
model, no second cache.

The hidden state comes explicitly: the runner returns it in ``RunnerOutput.hidden_states`` (the
row whose logits gave each request's latest token, a verification's last emitted one included)
and :class:`~fitserve.spec_decode.speculative.SpeculativeDecoding` hands it over in
``DraftRequest.hidden_state`` at the next proposal.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

import torch

from fitserve.model.eagle_head import EagleHead
from fitserve.model.llama import CausalLM
from fitserve.sampling import Sampler
from fitserve.spec_decode.draft_model import sample_drafts
from fitserve.spec_decode.proposer import Draft, DraftRequest, Drafts
from fitserve.types import SchedulerOutput


class EagleProposer:
    """Drafts with ``head`` over the target ``model``'s hidden states (a Proposer)."""

    needs_hidden_states = True

    def __init__(self, head: EagleHead, *, model: CausalLM, sampler: Sampler) -> None:
        self.head = head
        self.model = model
        self.sampler = sampler

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        """Up to k drafts per request that has a hidden state (from it and the request's last
        token); q rows for random requests."""
        live = [r for r in requests if r.hidden_state is not None]
        if not live:
            return {}
        h = torch.stack([r.hidden_state for r in live if r.hidden_state is not None])
        x = torch.tensor([r.last_token_id for r in live], dtype=torch.long, device=h.device)
        states = [r.sampling for r in live]
        drafts = {r.request_id: Draft([]) for r in live}
        qs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in live}
        for j in range(max(r.num_drafts for r in live)):
            h = self.head(self.model.embed_tokens(x).to(h.dtype), h)
            q = self.sampler.probabilities(self.model.compute_logits(h), states)
            toks = sample_drafts(q, states, self.sampler)
            for i, r in enumerate(live):
                if j < r.num_drafts:  # a row past its k keeps running with the batch, unused
                    drafts[r.request_id].token_ids.append(toks[i])
                    if not r.sampling.params.greedy:
                        qs[r.request_id].append(q[i])
            x = torch.tensor(toks, dtype=torch.long, device=h.device)
        for rid, rows in qs.items():
            if rows:
                drafts[rid].probs = torch.stack(rows)
        return drafts

    def after_step(self, plan: SchedulerOutput, failed: Set[str]) -> None:
        """Nothing to catch up: the head has no cache of its own."""
