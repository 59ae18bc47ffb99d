"""The sampler allocates what the ledger says (fitserve.ledger.sampler_memory), path by path.

Measured with torch.profiler's memory events: the peak of bytes allocated and not yet freed
while one sampler call runs, the logits made beforehand. The formula must equal it to within
the index-sized tensors ([B] ids and thresholds, [c, k <= 256] top-k outputs), several B and V,
chunks of one row, several rows and the whole batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fitserve.ledger import sampler_memory as sm
from fitserve.ledger.sampler_memory import SamplerPath, sampler_chunk_rows, sampler_path_bytes
from fitserve.sampling import RequestSamplingState, Sampler, SamplingParams
from tests.memory_events import peak_extra


def path_params(path: SamplerPath, vocab: int) -> list[dict[str, Any]]:
    """Row parameters that take ``path`` (a wide nucleus: temperature 8 on N(0, 1) logits)."""
    wide = dict(temperature=8.0, top_p=0.9999)
    return {
        SamplerPath.ARGMAX: [dict(temperature=0.0)],
        SamplerPath.COPY: [dict(temperature=0.0, logprobs=5),
                           dict(temperature=0.0, repetition_penalty=1.3, logit_bias={3: 2.0})],
        SamplerPath.RACE: [dict(temperature=0.7, top_k=40, min_p=0.01, presence_penalty=0.5)],
        SamplerPath.TOP_K_WIDE: [dict(temperature=0.7, top_k=vocab - 1)],  # the widest
        SamplerPath.TOP_P: [dict(wide, logprobs=20), dict(temperature=0.0)],
        SamplerPath.TOP_K_TOP_P: [dict(wide, top_k=vocab - 3, min_p=1e-9, logprobs=3)],
    }[path]


def slack(batch: int, vocab: int) -> int:
    """Index-sized tensors the formula leaves out: [B] / [c] vectors, [c, 256] top-k outputs."""
    c = min(batch, sampler_chunk_rows(vocab))
    return 64 * batch + 16 * 256 * c + 4096


# (B, V, rows per chunk: None for the engine's); (14, 4096, 12) and (40, 4096) widen nuclei in
# groups of 2 and 6 rows, (30, 49152) in groups of 3
CASES = [(1, 4096, None), (5, 4096, None), (40, 4096, None), (9, 4096, 3), (14, 4096, 12),
         (6, 1000, 1), (3, 49152, None), (30, 49152, None)]


@pytest.mark.parametrize("path", list(SamplerPath))
@pytest.mark.parametrize("batch,vocab,chunk_rows", CASES)
def test_measured_peak_is_the_formula(path: SamplerPath, batch: int, vocab: int,
                                      chunk_rows: int | None,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if chunk_rows is not None:  # small chunks without a huge vocabulary
        monkeypatch.setattr(sm, "SAMPLER_CHUNK_ELEMENTS", chunk_rows * vocab)
    params = path_params(path, vocab)
    states = [RequestSamplingState(SamplingParams(**params[r % len(params)]),
                                   [r, 5, 9], [7, r % 4]) for r in range(batch)]
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch))
    sampler = Sampler(generator=torch.Generator().manual_seed(0))
    sampler(logits, states)  # warm-up: lazy imports, the C++ argmax
    measured = peak_extra(lambda: sampler(logits, states))
    formula = sampler_path_bytes(path, batch, vocab)
    assert 0 <= measured - formula <= slack(batch, vocab), (
        f"{path} B={batch} V={vocab}: measured {measured:,} B, formula {formula:,} B")


def test_the_ledger_line_is_the_worst_path() -> None:
    for batch, vocab in ((1, 4096), (64, 49152), (64, 262_144), (256, 151_936)):
        worst = max(sampler_path_bytes(p, batch, vocab) for p in SamplerPath)
        assert sm.sampler_bytes(vocab, batch) == worst
        assert worst == sampler_path_bytes(SamplerPath.TOP_K_TOP_P, batch, vocab)
    # 960 MiB before (15 copies); now the copy, two chunk buffers of 4 rows, one row's full
    # nucleus sort (6 rows: its x and probs rows, values, int64 indices, sums)
    assert sm.sampler_bytes(262_144, 64) == (64 + 2 * 4 + 6) * 262_144 * 4
