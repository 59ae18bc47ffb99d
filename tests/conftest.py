"""Project-wide fixtures: the default model file and random-weight tiny Hugging Face folders."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.loading.pull import pull
from tests.gguf_vocab_files import default_hf_tokenizer


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker (and every server or process it starts, through
    OMP_NUM_THREADS) runs torch on its share of the cores, not on all of them.

    NOTE: two workers of 2 threads each on 2 cores make every parallel region wait for a
    descheduled thread: a served request measured 10x slower (tests/e2e/test_hostile_clients
    then ran past its deadline in CI). The kernels' thread splits are tested explicitly on 2
    and 3 threads (``test_thread_splits_give_the_same_bits`` in tests/kernels, the decode-loop
    bit-identity test in tests/numerics/test_decode_loop.py).
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch on ``n`` threads inside the block, the previous count after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture()
def num_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch on ``request.param`` threads for the test (parametrize indirectly)."""
    with torch_threads(request.param):
        yield request.param


TINY_SIZES: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The default model's GGUF file, pulled once into FITSERVE_HOME (~/.cache/fitserve)."""
    return pull("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' own tokenizer of the SmolLM2 GGUF, saved as tokenizer.json & co."""
    pytest.importorskip("transformers")
    tok = default_hf_tokenizer(smollm2_path)
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    tok.save_pretrained(folder)
    return folder


def tiny_hf_config(arch: str, **overrides: Any) -> Any:
    """A small transformers config of ``arch`` (llama3 rope scaling, sliding window, ...)."""
    import transformers as tf

    sizes = {**TINY_SIZES, **overrides}
    if arch == "llama":
        sizes.setdefault(
            "rope_parameters",
            {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        return tf.LlamaConfig(**sizes)
    if arch == "mistral":
        return tf.MistralConfig(**{"sliding_window": 16, "head_dim": 32, **sizes})
    if arch == "qwen2":
        return tf.Qwen2Config(**{"tie_word_embeddings": True, **sizes})
    if arch == "qwen3":
        return tf.Qwen3Config(**{"head_dim": 24, **sizes})
    if arch == "gemma2":  # soft-caps that bite, windowed and full layers
        return tf.Gemma2Config(**{"head_dim": 24, "query_pre_attn_scalar": 24, "sliding_window": 6,
                                  "attn_logit_softcapping": 4.0, "final_logit_softcapping": 6.0,
                                  "num_hidden_layers": 4, **sizes})
    # NOTE: TINY_SIZES' num_hidden_layers (2) wins over the 4 here: with pattern 4 both layers
    # slide (the spec's layer_types is None) and rotate with the local RoPE table (1e4)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**{"head_dim": 32, "query_pre_attn_scalar": 32,
                                      "sliding_window": 5, "num_hidden_layers": 4,
                                      "sliding_window_pattern": 4, **sizes})
    if arch == "phi3":  # fused qkv / gate_up checkpoint tensors
        return tf.Phi3Config(**{"pad_token_id": 0, **sizes})
    raise ValueError(f"no tiny config for {arch!r}")


@pytest.fixture()
def tiny_hf_model_dir(tmp_path: Path, smollm2_tokenizer_dir: Path) -> Callable[..., Any]:
    """Factory: ``make(arch, shard=False, return_model=False, **config_overrides)``.

    Saves a random-weight model of ``arch`` with save_pretrained (sharded into many small
    files with ``shard=True``) plus SmolLM2's tokenizer files, and returns the folder (and the
    transformers model, with ``return_model=True``).
    """
    import transformers as tf

    counter = itertools.count()

    def make(arch: str, shard: bool = False, return_model: bool = False, **overrides: Any) -> Any:
        torch.manual_seed(1234)
        model = tf.AutoModelForCausalLM.from_config(
            tiny_hf_config(arch, **overrides), dtype=torch.float32
        )
        folder = tmp_path / f"{arch}-{next(counter)}"
        model.save_pretrained(folder, max_shard_size="100KB" if shard else "2GB")
        for f in smollm2_tokenizer_dir.iterdir():
            shutil.copy(f, folder / f.name)
        return (folder, model.eval()) if return_model else folder

    return make


@pytest.fixture()
def one_thread() -> Iterator[None]:
    """torch on one thread for the test. NOTE: for many small tensors: on a shared 2-core
    machine every op of a multi-threaded pool waits for a busy core (up to 10x slower)."""
    with torch_threads(1):
        yield


def asked_tier(expected: str | None = None) -> str:
    """The tier a ``run_tests_at_tier`` subprocess was started with (FITSERVE_CPU_TIER), for the
    ``tier_is`` check each kernel test file ends its tier run with; skips outside such a
    subprocess, or in one for another tier than ``expected``."""
    want = os.environ.get("FITSERVE_CPU_TIER")
    if not want or (expected is not None and want != expected):
        pytest.skip(f"FITSERVE_CPU_TIER is not {expected or 'set'} (the tier subprocess tests "
                    "set it)")
    return want


def run_tests_at_tier(test_file: str, tier: str, select: str) -> None:
    """Run ``select`` (a ``-k`` expression) of ``test_file`` in a pytest subprocess whose C++
    kernels are built for ``tier`` (FITSERVE_CPU_TIER): the paths a CPU's own tier never takes
    are checked against the same references. Skips inside such a subprocess and where ``tier``
    is not below this CPU's own. The subprocess must pass, and pass without skipping its last
    selected test (the ``tier_is`` check each file has)."""
    if os.environ.get("FITSERVE_CPU_TIER"):
        pytest.skip("already inside a tier subprocess")
    from fitserve.kernels.cpu.isa import TIERS, detect_isa

    if TIERS.index(detect_isa().tier) <= TIERS.index(tier):
        pytest.skip(f"this CPU's own tier is {detect_isa().tier}: covered by the tests above")
    path = Path(test_file).resolve()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-k", select,
         str(path)],
        cwd=Path(__file__).resolve().parents[1], env={**os.environ, "FITSERVE_CPU_TIER": tier},
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]
