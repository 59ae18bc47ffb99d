"""SmolLM2's GGUF read by fitserve vs by transformers: weights, tokenizer, chat template.

transformers (a test dependency) is the independent reference. Equal dequantized weights prove
the tensor-name mapping and the undoing of llama.cpp's Q/K row permutation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from fitserve.loading import LoadedModel
from fitserve.loading.gguf import open_gguf
from tests.gguf_vocab_files import default_hf_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "",
    " ",
    "  leading spaces",
    "trailing   ",
    "tabs\tand\nnewlines\r\n\n\n",
    "numbers 1234567890, 3.14159 and 1,000,000",
    "١٢٣ arabic digits ⅻ",
    "emoji 😀🎉👩‍👩‍👧 and ünïcödé",
    "漢字 カタカナ 한국어 русский ελληνικά",
    "<|im_start|>user\nhi<|im_end|>\n",
    "mixed<|endoftext|>special<repo_name>tokens",
    "don't can't I'm they'll WE'RE",
    "code: def f(x):\n    return x**2  # comment",
    "a" * 200,
    "\u00a0nbsp\u2003em\u200bzw",
]
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 😀"},
    ],
]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_path: Path) -> Any:
    return default_hf_tokenizer(smollm2_path)


def test_spec(smollm2_loaded: LoadedModel) -> None:
    spec = smollm2_loaded.spec
    assert (spec.architecture, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (
        "llama",
        30,
        9,
        3,
    )
    assert (spec.hidden_size, spec.intermediate_size, spec.head_dim, spec.vocab_size) == (
        576,
        1536,
        64,
        49152,
    )
    assert spec.tie_word_embeddings and "lm_head.weight" not in smollm2_loaded.weights
    assert (
        spec.rope_theta == 100000.0
        and spec.rope_scaling is None
        and spec.max_position_embeddings == 8192
    )
    assert spec.bos_token_id == 1 and spec.eos_token_ids == (2,)
    assert smollm2_loaded.weight_format == "Q4_1" and smollm2_loaded.file_format == "gguf"


@pytest.mark.slow
def test_weights_equal_transformers_gguf_loader(
    smollm2_loaded: LoadedModel, hf_smollm2: Any
) -> None:
    reference = {k: v for k, v in hf_smollm2.state_dict().items() if k != "lm_head.weight"}
    assert set(smollm2_loaded.weights) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(smollm2_loaded.weights[name], tensor), name


def test_permutation_is_not_vacuous(smollm2_loaded: LoadedModel, smollm2_path: Path) -> None:
    """The raw file rows of attn_q differ from the loaded q_proj: the un-permutation did work."""
    raw = next(t for t in open_gguf(smollm2_path).tensors if t.name == "blk.0.attn_q.weight")
    file_rows = torch.from_numpy(np.asarray(dequantize(raw.data, raw.tensor_type)))
    loaded = smollm2_loaded.weights["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(file_rows, loaded)
    assert torch.equal(
        file_rows.sort(dim=0).values, loaded.sort(dim=0).values
    )  # same rows, reordered


def test_tokenizer_matches_transformers(smollm2_loaded: LoadedModel, hf_tokenizer: Any) -> None:
    ours = smollm2_loaded.tokenizer
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip), (
                text,
                skip,
            )


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    smollm2_loaded: LoadedModel,
    hf_tokenizer: Any,
    conversation: list[dict[str, str]],
    add_generation_prompt: bool,
) -> None:
    ours = smollm2_loaded.tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt
    )
    theirs = hf_tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == theirs
