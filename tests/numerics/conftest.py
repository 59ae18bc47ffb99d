"""Shared fixtures for numerics tests: the real SmolLM2 weights, in fitserve and in transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.loading import LoadedModel, load_model
from fitserve.loading.pull import pull


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return pull("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_gguf: Path) -> LoadedModel:
    return load_model(smollm2_gguf, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf: Path):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture()
def make_engine(smollm2_loaded: LoadedModel):  # type: ignore[no-untyped-def]
    """Build an fp32 engine over the shared SmolLM2 weights with the given EngineConfig fields."""

    def make(**kwargs: object) -> Engine:
        fields: dict[str, object] = {"model": str(smollm2_loaded.path), "dtype": "float32",
                                     "device": "cpu", "max_model_len": 1024, "num_kv_blocks": 256}
        fields.update(kwargs)
        return Engine(EngineConfig(**fields), loaded=smollm2_loaded)  # type: ignore[arg-type]

    return make


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    """Independent reference: plain greedy decoding with transformers' own KV cache.

    Returns the tokens and, per step, the float64 log-softmax of the logits that chose them.
    """
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens: list[int] = []
    logprobs: list[torch.Tensor] = []
    for _ in range(num_tokens):
        logits = out.logits[0, -1].double()
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(torch.log_softmax(logits, -1))
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs
