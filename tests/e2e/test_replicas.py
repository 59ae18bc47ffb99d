"""``fitserve serve --replicas 2`` on a local Ray Serve (head on loopback, two 1-CPU replicas of
the default model) with the official openai client: answers equal the single server's (the
session ``server``), prefix affinity's fleet hit rate beats round robin's on a shared-system-prompt
workload (hits read from the replicas' own /metrics), a replica SIGKILLed mid-run loses no
request that had not started and hangs no stream, and SIGTERM leaves no process behind.

One fleet for the module: Ray's start-up and two model loads are the expensive part.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import API_KEY, MODEL, free_port

pytest.importorskip("ray.serve", reason="the fitserve[ray] extra is not installed")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class Fleet:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def client(self, **headers: str) -> Any:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=60,
                             default_headers=headers or None)

    def replicas(self) -> dict[str, dict[str, Any]]:
        return httpx.get(f"{self.url}/fleet", headers=AUTH, timeout=30).json()["replicas"]

    def prefix_counters(self) -> tuple[float, float]:
        """Fleet-wide prefix-cache (queries, hits) in tokens: the sum over replicas' /metrics."""
        text = httpx.get(f"{self.url}/metrics", headers=AUTH, timeout=30).text
        total = [sum(float(v) for v in re.findall(rf'^fitserve_prefix_cache_{kind}_total{{replica="[^"]+"}} (\S+)$',
                                                    text, re.M)) for kind in ("queries", "hits")]
        return total[0], total[1]


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    port = free_port()
    log = tmp_path_factory.mktemp("fleet") / "fleet.log"
    cmd = [sys.executable, "-m", "fitserve.cli", "serve", MODEL, "--replicas", "2", "--replica-cpus", "1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", "256",
           "--log-level", "warning", "--api-key", API_KEY, "--max-body-bytes", "65536",
           "--reasoning-parser", "qwen3"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    fleet = Fleet(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + 300
    while "ready at" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the fleet did not start:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    yield fleet
    tree = _descendants(proc.pid)  # Ray's head, agents and worker processes
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0, log.read_text()[-4000:]
    deadline = time.monotonic() + 20
    while (left := [p for p in tree if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes left after shutdown: {left}"


def test_openai_client_gets_the_single_servers_answers(fleet: Fleet, client: Any) -> None:
    """Chat, completions and a chat stream through the ingress equal the single server's
    (greedy); the API key is enforced as there."""
    fc = fleet.client()
    chat = [{"role": "user", "content": "Name three colours."}]
    got = fc.chat.completions.create(model=MODEL, messages=chat, max_tokens=12, temperature=0)
    want = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    got_c = fc.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    want_c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert got_c.choices[0].text == want_c.choices[0].text
    stream = fc.chat.completions.create(model=MODEL, messages=chat, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.choices[0].message.content
    assert httpx.get(f"{fleet.url}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{fleet.url}/fleet", timeout=30).status_code == 401
    assert {r["threads"] for r in fleet.replicas().values()} == {1} and len(fleet.replicas()) == 2


def _shared_prompt_run(fleet: Fleet, routing: str, tag: str) -> float:
    """16 chats over 4 shared system prompts (new ones per run), 4 at a time: the fleet hit rate."""
    fc = fleet.client(**{"X-Fitserve-Routing": routing})
    systems = [f"[{tag}{i}] You are assistant {i}. " + " ".join(f"Rule {j}: answer topic {j} {i} times." for j in range(14))
               for i in range(4)]
    jobs = [(systems[k % 4], f"Question {k}: what is {k} plus {k}?") for k in range(16)]
    random.Random(0).shuffle(jobs)  # NOTE: not k % 4 in order: round robin would partition it by chance
    q0, h0 = fleet.prefix_counters()
    with cf.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda j: fc.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": j[0]}, {"role": "user", "content": j[1]}],
            max_tokens=1, temperature=0), jobs))
    time.sleep(0.6)  # the engines publish their counters at most every 0.25 s
    q1, h1 = fleet.prefix_counters()
    return (h1 - h0) / (q1 - q0)


def test_prefix_affinity_beats_round_robin_on_shared_system_prompts(fleet: Fleet) -> None:
    """Round robin computes each system prompt on both replicas, affinity on one: with 16
    requests over 4 prompts, affinity misses 4 prompt prefixes fleet-wide and round robin up to 8."""
    round_robin = _shared_prompt_run(fleet, "round-robin", "rr")
    affinity = _shared_prompt_run(fleet, "affinity", "af")
    print(f"fleet prefix-cache hit rate: affinity {affinity:.3f}, round robin {round_robin:.3f}")
    assert affinity > round_robin + 0.05, (affinity, round_robin)


def test_killed_replica_loses_no_unstarted_request_and_hangs_no_stream(fleet: Fleet) -> None:
    """SIGKILL one replica while streams and plain requests run: every plain request is answered
    (retried on the other replica), every stream completes or ends with an error event, and Ray
    brings a replacement up. Round robin puts requests of both kinds on both replicas."""
    fc = fleet.client(**{"X-Fitserve-Routing": "round-robin"})
    msgs = [{"role": "user", "content": "Count from one to fifty in words."}]

    def stream(_: int) -> str:
        try:
            for _chunk in fc.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48, temperature=0,
                                                     stream=True):
                pass
            return "done"
        except openai.APIError as exc:
            assert "replica" in str(exc), exc
            return "error-event"

    def plain(k: int) -> str:
        r = fc.completions.create(model=MODEL, prompt=f"Story {k}: once upon a time", max_tokens=24, temperature=0)
        return r.choices[0].finish_reason

    with cf.ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(stream, i) for i in range(4)]
        plains = [pool.submit(plain, i) for i in range(4)]
        time.sleep(1.0)
        victim = max(fleet.replicas().values(), key=lambda r: r["in_flight"])["pid"]
        os.kill(victim, signal.SIGKILL)
        outcomes = [f.result(timeout=120) for f in streams]  # a hang would time out here
        finished = [f.result(timeout=120) for f in plains]
    print("stream outcomes:", outcomes)
    assert finished == ["length"] * 4
    assert set(outcomes) <= {"done", "error-event"}
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        now = fleet.replicas()
        if len(now) == 2 and victim not in {r.get("pid") for r in now.values()} and all("running" in r for r in now.values()):
            break
        time.sleep(1)
    else:
        raise AssertionError(f"no replacement replica: {fleet.replicas()}")
    assert fc.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0).choices[0].text
