"""Prefix caching's switches (EngineConfig, CLI flags in vLLM's spelling) and its Prometheus
metrics (queries / hits counters in tokens, the evictable-blocks gauge). Torch-free."""

from __future__ import annotations

import argparse

import pytest

from fitserve.config import EngineConfig
from fitserve.engine.args import add_engine_args, engine_config_from_args
from fitserve.kv.manager import KVStats
from fitserve.server.metrics import EngineGauges, Metrics


def parse(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_config_from_args(p.parse_args(list(argv)))


def test_prefix_caching_is_on_by_default_and_the_flags_turn_it_off() -> None:
    assert EngineConfig().cache.enable_prefix_caching is True
    assert parse().cache.enable_prefix_caching is True
    assert parse("--enable-prefix-caching").cache.enable_prefix_caching is True
    assert parse("--no-enable-prefix-caching").cache.enable_prefix_caching is False
    assert parse("--no-prefix-caching").cache.enable_prefix_caching is False
    assert parse("--no-prefix-caching", "--enable-prefix-caching").cache.enable_prefix_caching is True


def kv(queries: int, hits: int, evictable: int) -> KVStats:
    return KVStats(num_blocks=10, used_blocks=2, free_blocks=8, allocated_slots=32, used_slots=20,
                   fragmentation=12 / 32, prefix_cache_queries=queries, prefix_cache_hits=hits,
                   cached_blocks=evictable + 1, evictable_cached_blocks=evictable)


def sample(m: Metrics, name: str) -> float:
    for line in m.exposition().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_prefix_cache_metrics_follow_the_engine_totals() -> None:
    m = Metrics()
    m.set_gauges(EngineGauges(1, 0, 0, kv(queries=40, hits=16, evictable=3)))
    assert sample(m, "fitserve_prefix_cache_queries_total") == 40
    assert sample(m, "fitserve_prefix_cache_hits_total") == 16
    assert sample(m, "fitserve_prefix_cache_evictable_blocks") == 3
    # the engine reports totals since start; the counters advance by the difference only
    m.set_gauges(EngineGauges(1, 0, 0, kv(queries=40, hits=16, evictable=5)))
    m.set_gauges(EngineGauges(1, 0, 0, kv(queries=65, hits=32, evictable=0)))
    assert sample(m, "fitserve_prefix_cache_queries_total") == 65
    assert sample(m, "fitserve_prefix_cache_hits_total") == 32
    assert sample(m, "fitserve_prefix_cache_evictable_blocks") == 0


@pytest.mark.parametrize("queries", [0, 7])
def test_a_fresh_engine_restarting_its_totals_does_not_go_backwards(queries: int) -> None:
    m = Metrics()
    m.set_gauges(EngineGauges(0, 0, 0, kv(queries=50, hits=20, evictable=0)))
    m.set_gauges(EngineGauges(0, 0, 0, kv(queries=queries, hits=0, evictable=0)))  # a new engine
    m.set_gauges(EngineGauges(0, 0, 0, kv(queries=queries + 10, hits=4, evictable=0)))
    assert sample(m, "fitserve_prefix_cache_queries_total") == 60
    assert sample(m, "fitserve_prefix_cache_hits_total") == 24
