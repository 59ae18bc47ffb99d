"""The dashboard's per-layer-group pools: blocks each group holds and the blocks the sliding window
has freed so far, as the snapshot publishes them (GET /dashboard/state's "kv"."groups")."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import torch

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine
from fitserve.kv.group import KVGroup
from fitserve.kv.manager import KVCacheManager
from fitserve.loading import load_model
from fitserve.sampling import SamplingParams
from fitserve.server.engine_loop import EngineLoop
from fitserve.server.metrics import Metrics
from fitserve.server.snapshot import KVSnapshot

BS, WINDOW = 4, 6


def expected_freed(computed: int) -> int:
    """Blocks a window-6 group has dropped once a query at ``computed`` runs: those wholly
    before its first key, ``computed - WINDOW + 1`` (the plain rule, block by block)."""
    first_key = computed - WINDOW + 1
    return sum(1 for i in range(64) if (i + 1) * BS <= first_key)


def test_snapshot_counts_held_and_window_freed_blocks_per_group() -> None:
    kv = KVCacheManager.from_groups([KVGroup("full", 40, None, (1,)),
                                     KVGroup("sliding", 12, WINDOW, (0, 2))], BS)
    assert kv.allocate_slots("r", 0, 10) is not None
    for c in range(10, 30):  # decode one token at a time: the query at c writes slot c
        assert kv.allocate_slots("r", c, c + 1) is not None
        groups = json.loads(json.dumps(asdict(KVSnapshot.of(kv.stats(), BS))))["groups"]
        full, sw = groups
        total = -(-(c + 1) // BS)
        assert full == {"kind": "full", "window": None, "num_layers": 1, "num_blocks": 40,
                        "used_blocks": total, "free_blocks": 40 - total,
                        "window_freed_blocks": 0}
        freed = expected_freed(c)
        assert sw == {"kind": "sliding", "window": WINDOW, "num_layers": 2, "num_blocks": 11,
                      "used_blocks": total - freed, "free_blocks": 11 - (total - freed),
                      "window_freed_blocks": freed}
    assert freed == 6
    kv.free("r")  # the count is since start: freeing the request does not undo it
    full, sw = KVSnapshot.of(kv.stats(), BS).groups
    assert (full.used_blocks, sw.used_blocks, sw.free_blocks, sw.window_freed_blocks) == (0, 0, 11, 6)


def test_engine_loop_publishes_the_groups_of_a_hybrid_model(tiny_hf_model_dir: Any) -> None:
    """A tiny Gemma 2 (a sliding layer of window 6 and a full layer): the published snapshot's
    groups are the engine's own pools at every step, and the window's frees show up."""
    folder = tiny_hf_model_dir("gemma2")
    cfg = EngineConfig(model=str(folder), dtype="float32", device="cpu", max_model_len=128,
                       num_kv_blocks=64, block_size=BS)
    engine = Engine(cfg, loaded=load_model(folder, dtype=torch.float32))
    loop = EngineLoop(cfg, Metrics())
    engine.add_request(list(range(3, 33)), SamplingParams(temperature=0.0, max_tokens=12,
                                                          ignore_eos=True), request_id="r")
    seen_freed = 0
    while engine.has_unfinished_requests():
        engine.step()
        loop._publish(engine, force=True)
        assert loop.snapshot is not None
        published = json.loads(json.dumps(loop.snapshot.to_json()))["kv"]["groups"]
        kinds = {g.group.kind: g for g in engine.kv.groups}
        assert [(g["kind"], g["window"], g["num_layers"]) for g in published] == [
            ("full", None, 1), ("sliding", WINDOW, 1)]
        for g in published:
            tables = kinds[g["kind"]]
            assert g["used_blocks"] == tables.num_used_blocks
            assert g["free_blocks"] == tables.pool.num_free_blocks
        if engine.scheduler.get("r") is not None:  # its table's null slots: the freed blocks
            full, sw = engine.kv.block_tables("r")
            assert published[1]["window_freed_blocks"] == sw.count(0)
            assert published[0]["used_blocks"] == len(full)
        seen_freed = published[1]["window_freed_blocks"]
    # the last decode step writes position 40 (30 prompt tokens, 12 generated, the last unwritten)
    assert seen_freed == expected_freed(40) == 8
