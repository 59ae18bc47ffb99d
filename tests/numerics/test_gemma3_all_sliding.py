"""Gemma 3 whose layers all slide vs transformers (regression).

Such a config (e.g. 2 layers with sliding_window_pattern 4, as tests/conftest.py's tiny
Gemma 3) is read into a spec with ``layer_types=None`` (one kind) and a ``sliding_window``.
transformers rotates every sliding layer with the local RoPE table (base 1e4, no scaling);
the engine once read ``layer_types=None`` as "no local layers" and rotated them all with the
global table (base 1e6, linear scaling): logprobs off by ~0.02-0.09 and different greedy
tokens once prompts pass a few positions. Greedy tokens must equal transformers' for 32 tokens
and top-5 logprobs be within ``derived_tolerance``, from the HF folder and from a GGUF file
(whose all-True sliding_window_pattern loads the same way).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.loading import load_model
from tests.gguf_vocab_files import default_hf_tokenizer

from .conftest import hf_greedy
from .hf_to_gguf import write_gguf_like_llama_cpp
from .test_new_families_vs_transformers import (
    NUM_TOKENS,
    Family,
    check,
    derived_tolerance,
    make,
    run,
)
from .tiny_models import build_tiny

transformers = pytest.importorskip("transformers")

ARCH = "gemma3_all_sliding"


@pytest.fixture(scope="module")
def family(smollm2_gguf: Path, tmp_path_factory: Any) -> Family:
    tokenizer = default_hf_tokenizer(smollm2_gguf)
    folder = tmp_path_factory.mktemp("tiny-gemma3-all-sliding")
    ref = build_tiny(ARCH, folder, tokenizer)
    loaded = load_model(folder, dtype=torch.float32)
    rng = random.Random(ARCH)
    prompts = [[rng.randrange(3, loaded.spec.vocab_size) for _ in range(n)] for n in (1, 9, 40)]
    want = [hf_greedy(ref, p, NUM_TOKENS) for p in prompts]
    return Family(ARCH, folder, ref, loaded, prompts, want, derived_tolerance(ref, prompts[-1]))


def test_every_layer_slides_with_the_local_rope_table(family: Family) -> None:
    spec = family.loaded.spec
    assert spec.layer_types is None and spec.sliding_window == 5  # one kind: all sliding
    assert (spec.rope_theta, spec.sliding_rope_theta) == (1e6, 1e4)
    check(family, run(make(family.loaded, long_prefill_token_threshold=7), family.prompts,
                      together=True), "all sliding, chunk 7")


def test_every_layer_slides_from_gguf(family: Family, tmp_path: Path) -> None:
    loaded = load_model(write_gguf_like_llama_cpp(family.ref, tmp_path / "g.gguf"),
                        dtype=torch.float32)
    assert loaded.spec.layer_types is None and loaded.spec.sliding_window == 5
    assert loaded.spec.sliding_rope_theta == 1e4
    check(family, run(make(loaded), family.prompts, together=False), "all sliding, gguf")
