"""Start-up is honest: from a fresh FITSERVE_HOME, every C++ extension the default configuration
uses is loaded (and warmed) before /health says ok, and serving requests loads none after it.

NOTE: cheap by construction. A fresh home's kernels are seeded from this session's cache (the
builds ``make setup`` makes: ``python -m fitserve.kernels.cpu.build``), so the test costs a
server start, not a ~40-110 s compile. What it proves: with the default model and flags, the set
of extensions loaded before /health is ok is the whole set the served requests use (a lazily
loaded one - the old ``decode_step`` after /health - logs its "loaded C++ kernels" line after the
"ready in" summary and fails it), nothing is compiled when the cache holds the builds, and the
summary names what was loaded. What it does not prove: how long a cold compile takes, or that
paths these requests do not take (beam search, a quantized KV cache, speculation) load nothing
late - each of those loads its extension when its engine is built with that option.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

from fitserve.envs import fitserve_home
from fitserve.kernels.cpu import build
from tests.e2e.conftest import MODEL, start_server, stop_server

LOADED = re.compile(r"loaded C\+\+ kernels (\w+) ")


def _seed_home(home: Path) -> list[str]:
    """A fresh FITSERVE_HOME: the session's model (linked) and a copy of its kernel builds."""
    build.build_all()  # present already after `make setup`; builds what is missing otherwise
    session = fitserve_home()
    (home / "models").symlink_to(session / "models", target_is_directory=True)
    seeded = []
    for name, source in build.EXTENSIONS.items():
        src = build.build_dir(name, source)
        if any(src.glob("*.so")):
            dst = home / "extensions" / src.name
            dst.mkdir(parents=True)
            for so in src.glob("*.so"):
                shutil.copy2(so, dst / so.name)
            seeded.append(name)
    return seeded


def test_no_kernel_loads_after_health_is_ok(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            smollm2_path: Path) -> None:
    if build.cpp_disabled():
        pytest.skip("FITSERVE_DISABLE_CPP is set: no kernels to load")
    home = tmp_path / "home"
    home.mkdir()
    seeded = _seed_home(home)
    monkeypatch.setenv("FITSERVE_HOME", str(home))
    monkeypatch.setenv("FITSERVE_LOG_STATS_INTERVAL", "0.5")  # the throughput line, often
    # the default configuration (dtype, compile setting, sampler), a small KV pool
    srv = start_server(tmp_path, "--dtype", "auto", "--num-kv-blocks", "128", "--log-level", "info")
    try:
        at_ready = srv.log.read_text()
        ready = [ln for ln in at_ready.splitlines() if "fitserve.server: ready in" in ln]
        assert len(ready) == 1, at_ready[-3000:]
        before = set(LOADED.findall(at_ready))
        assert before, "no C++ kernel was loaded before /health was ok"
        # requests down each path: sampled with the server's defaults, streamed, n=2 (a batch of
        # two decodes); then greedy chat (batch-1 decode)
        r = httpx.post(f"{srv.url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "n": 2, "stream": True})
        assert r.status_code == 200 and "[DONE]" in r.text, r.text
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        srv.wait_idle()
        time.sleep(0.6)  # one more throughput line: it covers the interval the requests ended in
    finally:
        assert stop_server(srv) == 0
    log = srv.log.read_text()
    after_ready = log.split(ready[0], 1)[1]
    assert not LOADED.findall(after_ready), f"a kernel loaded after /health was ok:\n{after_ready[-3000:]}"
    assert "building C++ kernels" not in log, "a kernel was compiled though the cache held it"
    assert before <= set(seeded), (before, seeded)
    # the summary names exactly what was loaded, and that nothing was compiled now
    kernels = re.search(r"C\+\+ kernels \(\w+\): ([\w, ]+)", ready[0])
    assert kernels is not None and set(kernels.group(1).split(", ")) == before, ready[0]
    assert "compiled now" not in ready[0]
    for field in ("model SmolLM2-135M-Instruct", "weights ", "KV cache ", "warm-up "):
        assert field in ready[0], ready[0]
    # the logs a vLLM user reads: an access line per request, the periodic throughput line
    assert re.search(r'"POST /v1/completions HTTP/1.1" 200 [\d.]+ ms', after_ready)
    assert re.search(r'"POST /v1/chat/completions HTTP/1.1" 200 [\d.]+ ms', after_ready)
    rates = re.findall(r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) "
                       r"tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%", after_ready)
    assert any(float(gen) > 0 for _, gen in rates), after_ready[-3000:]
