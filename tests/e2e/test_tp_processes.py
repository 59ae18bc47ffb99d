"""Tensor-parallel processes when things go wrong, and under torchrun.

- a worker that dies: the next step fails at once with an error naming its rank and status;
- a worker that stalls: the watchdog's report names the rank that is behind, with its stack,
  within the timeout;
- torchrun on one machine, several processes: the same text as a single process.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fitserve.dist.group as group_mod
from fitserve.config import EngineConfig
from fitserve.dist.comm import CollectiveError
from fitserve.engine.core import Engine
from fitserve.sampling import SamplingParams
from tests.e2e.stalling_tp_worker import STALL_ENV

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [3, 17, 101, 42, 7, 250]


def _generate(engine: Engine) -> list[int]:
    rid = engine.add_request(PROMPT, GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                return out.token_ids
    raise AssertionError("no output")


def _engine(folder: Path, tp: int) -> Engine:
    return Engine(EngineConfig(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=32,
                               max_model_len=128, tensor_parallel_size=tp))


def test_dead_worker_fails_fast_naming_its_rank(tiny_hf_model_dir) -> None:  # type: ignore[no-untyped-def]
    engine = _engine(tiny_hf_model_dir("llama"), 2)
    try:
        assert len(_generate(engine)) == 8
        group = engine.tp_group
        assert group is not None
        victim = group.procs[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        t0 = time.monotonic()
        with pytest.raises(CollectiveError, match=rf"worker rank 1 \(pid {victim.pid}\) exited "
                                                  r"with status -9"):
            _generate(engine)
        assert time.monotonic() - t0 < 10
    finally:
        engine.shutdown()


def test_stalled_rank_is_named_within_the_timeout(tiny_hf_model_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # 6 query heads / 3 KV heads over 3 ranks; rank 2 sleeps 60 s before its 2nd step
    folder = tiny_hf_model_dir("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                               intermediate_size=192)
    monkeypatch.setenv("FITSERVE_TP_WATCHDOG_S", "2")
    monkeypatch.setattr(group_mod, "WORKER_MODULE", "tests.e2e.stalling_tp_worker")
    monkeypatch.setenv(STALL_ENV, "2:2:60")
    engine = _engine(folder, 3)
    try:
        rid = engine.add_request(PROMPT, GREEDY)
        engine.step()  # step 1: the prompt
        t0 = time.monotonic()
        with pytest.raises(CollectiveError) as info:
            while engine.has_unfinished_requests():
                engine.step()
        waited = time.monotonic() - t0
        text = str(info.value)
        # the collective timeout is 2 x watchdog + 5 s = 9 s: the report is in before it fails
        assert waited < 20, waited
        assert "rank 2 is behind" in text, text
        assert "rank 0: in collective" in text and "rank 1: in collective" in text
        assert "in _stall" in text  # rank 2's own stack, sent by its watchdog thread
        assert rid
    finally:
        engine.shutdown()


def test_torchrun_gives_the_single_process_text(tiny_hf_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun is not installed")
    folder = tiny_hf_model_dir("llama", vocab_size=49152)  # SmolLM2's tokenizer: text prompts
    args = ["-m", "fitserve.cli", "generate", "--model", str(folder), "--dtype", "float32",
            "--num-kv-blocks", "32", "--max-model-len", "128", "--max-tokens", "12",
            "--ignore-eos", "The quick brown fox"]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    one = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                         timeout=120)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([str(torchrun), "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
                          *args, "--tp", "2", "-v"], capture_output=True, text=True, env=env,
                         timeout=180)
    assert two.returncode == 0, two.stderr[-3000:]
    assert one.stdout.strip() and two.stdout.strip() == one.stdout.strip()
    # rank 0 printed the measured collectives beside the ledger: 2 layers x 2 per token
    assert "layer all_reduce" in two.stderr
