"""The scheduler over layer groups: windowed tables with exact ids, and every key a query reads
(through prefix hits, chunking, preemption, n>1 forks with copy-on-write) holds what an
unshared run wrote; every block comes back."""

from __future__ import annotations

import random

import pytest

from fitserve.config import SchedulerConfig
from fitserve.kv.group import NULL_BLOCK, KVGroup
from fitserve.kv.manager import KVCacheManager
from fitserve.ledger.kv import window_blocks_held
from fitserve.sched.request import SchedRequest
from fitserve.sched.scheduler import Scheduler
from fitserve.types import SchedulerOutput
from tests.unit.sched.test_scheduler import alone, fake_token


def make(kv: KVCacheManager, budget: int = 8, max_num_seqs: int = 8) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=128)
    return Scheduler(cfg, kv)


def test_windowed_tables_exact() -> None:
    s = make(KVCacheManager(16, 4, window=6))
    s.add_request(SchedRequest("A", list(range(20)), 3))
    tables = []
    for _ in range(5):
        out = s.schedule()
        (c,) = out.chunks
        tables.append((c.start_pos, c.block_table))
        s.update(out, {"A": 7} if c.sample else {})
    # chunk 16..19: its first query (16) sees 11.., so blocks 1 (0..3) and 2 (4..7) are freed
    # (cached, so evictable: fresh blocks go first); query 20 sees 15.. (block 3 freed), 21
    # sees 16.. (block 4 freed)
    assert tables == [(0, [1, 2]), (8, [1, 2, 3, 4]), (16, [0, 0, 3, 4, 5]),
                      (20, [0, 0, 0, 4, 5, 6]), (21, [0, 0, 0, 0, 5, 6])]
    assert s.kv.stats().used_blocks == window_blocks_held(4, 21, 22, 6) == 2


class Cache:
    """Slot contents per group: the prefix whose K/V each slot holds."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.slot: list[dict[int, tuple[int, ...]]] = [{} for _ in s.kv.groups]

    def run(self, out: SchedulerOutput) -> dict[str, int]:
        kv, bs = self.s.kv, self.s.kv.block_size
        copies = out.group_block_copies or [out.block_copies]
        for g, pairs in enumerate(copies):
            for src, dst in pairs:
                for o in range(bs):
                    if src * bs + o in self.slot[g]:
                        self.slot[g][dst * bs + o] = self.slot[g][src * bs + o]
        sampled: dict[str, int] = {}
        for c in out.chunks:
            r = self.s.get(c.request_id)
            assert r is not None
            toks = r.all_token_ids
            tables = c.group_tables or [c.block_table]
            for g, table in enumerate(tables):
                w = kv.groups[g].window
                for p in range(c.start_pos, c.start_pos + len(c.token_ids)):
                    self.slot[g][table[p // bs] * bs + p % bs] = tuple(toks[: p + 1])
                for q in range(c.start_pos, c.start_pos + len(c.token_ids)):
                    for k in range(0 if w is None else max(0, q - w + 1), q + 1):
                        assert table[k // bs] != NULL_BLOCK or w is None
                        assert self.slot[g][table[k // bs] * bs + k % bs] == tuple(toks[: k + 1])
            if c.sample:
                for rid in (c.request_id, *c.fanout):
                    sampled[rid] = fake_token(toks) + (0 if rid == c.request_id else int(rid[-1]) + 1)
        return sampled


@pytest.mark.parametrize("seed", range(12))
def test_reads_equal_an_unshared_run(seed: int) -> None:
    rng = random.Random(seed)
    w = rng.choice([5, 9, 13])
    full, windowed = rng.choice([(40, 16), (22, 14), (16, 12)])  # small pools preempt
    kv = KVCacheManager.from_groups([KVGroup("full", full, None), KVGroup("sliding", windowed, w)], 4)
    s = make(kv, budget=rng.choice([6, 8, 16]), max_num_seqs=6)
    cache = Cache(s)
    base = [rng.randrange(4) for _ in range(30)]
    reqs: list[SchedRequest] = []
    for i in range(8):
        prompt = base[: rng.randrange(3, 30)] + [rng.randrange(4) for _ in range(rng.randrange(1, 5))]
        r = SchedRequest(f"r{i}", prompt, rng.randrange(2, 12))
        if rng.random() < 0.3:
            r.fork_children = [SchedRequest(f"r{i}c{j}", list(prompt), r.max_tokens) for j in range(2)]
        try:
            s.add_request(r)
        except ValueError as e:  # larger than a small pool: refused up front, as it should be
            assert "KV pool has" in str(e)
            continue
        reqs.append(r)
        reqs.extend(r.fork_children)
    for _ in range(2000):
        if not s.has_unfinished():
            break
        out = s.schedule()
        sampled = cache.run(out)
        s.update(out, sampled)
        for rid in sampled:
            r = s.get(rid)
            if r is not None and len(r.output_token_ids) >= r.max_tokens:
                s.finish(rid)
    assert not s.has_unfinished()
    for r in reqs:
        if not r.request_id[1:].isdigit():
            continue  # a child's tokens depend on its first, fanned-out token
        assert r.output_token_ids == alone(r.prompt_token_ids, r.max_tokens)
    st = s.kv.stats()
    assert st.used_blocks == 0 and st.group_used_blocks == (0, 0)
