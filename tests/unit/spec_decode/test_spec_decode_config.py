"""Speculative decoding's switch (``--speculative-config``, vLLM's JSON flag, on ``fitserve
serve`` and ``fitserve generate``) and its Prometheus metrics (vLLM's counter and gauge names,
advanced by differences of the engine's totals since start)."""

from __future__ import annotations

import argparse

import pytest

from fitserve.cli.main import build_parser
from fitserve.config import EngineConfig, SpeculativeConfig
from fitserve.engine.args import add_engine_args, engine_config_from_args
from fitserve.engine.llm import Completion
from fitserve.kv.manager import KVStats
from fitserve.server.metrics import EngineGauges, Metrics
from fitserve.spec_decode.stats import SpecDecodeStats

FLAG = "--speculative-config"


def parse(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_config_from_args(p.parse_args(list(argv)))


def test_speculation_is_off_by_default() -> None:
    assert parse().speculative is None


def test_a_good_json_config_becomes_a_speculative_config() -> None:
    cfg = parse(FLAG, '{"method": "ngram", "num_speculative_tokens": 4}').speculative
    assert cfg == SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    assert (cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (4, 1)
    cfg = parse(FLAG, '{"method":"ngram","num_speculative_tokens":2,"prompt_lookup_max":3,'
                      '"prompt_lookup_min":2}').speculative
    assert cfg == SpeculativeConfig("ngram", 2, prompt_lookup_max=3, prompt_lookup_min=2)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_both_engine_commands_take_the_flag(command: str) -> None:
    argv = [command, FLAG, '{"method": "ngram", "num_speculative_tokens": 3}']
    if command == "generate":
        argv.append("a prompt")
    cfg = engine_config_from_args(build_parser().parse_args(argv)).speculative
    assert isinstance(cfg, SpeculativeConfig) and cfg.num_speculative_tokens == 3


@pytest.mark.parametrize(("value", "problem"), [
    ("{method: ngram}", "not valid JSON"),
    ('["ngram", 4]', "JSON object"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "num_lookahead": 2}', "num_lookahead"),
    ('{"method": "banana", "num_speculative_tokens": 4}', "banana"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "num_speculative_tokens"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5}', "prompt_lookup_min"),
])
def test_a_bad_config_is_an_argparse_error_naming_the_flag(
    value: str, problem: str, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(FLAG, value)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {FLAG}:" in err and problem in err, err


def kv() -> KVStats:
    return KVStats(num_blocks=10, used_blocks=2, free_blocks=8, allocated_slots=32, used_slots=20,
                   fragmentation=12 / 32, prefix_cache_queries=0, prefix_cache_hits=0,
                   cached_blocks=0, evictable_cached_blocks=0)


def samples(m: Metrics) -> dict[str, float]:
    out = {}
    for line in m.exposition().decode().splitlines():
        if line.startswith("fitserve_spec_decode_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def spec(chunks: list[tuple[int, int]], k: int = 3) -> SpecDecodeStats:
    st = SpecDecodeStats(k)
    for drafts, accepted in chunks:
        st.observe(drafts, accepted)
    return st


def test_spec_decode_metrics_are_present_at_zero_while_speculation_is_off() -> None:
    m = Metrics()
    m.set_gauges(EngineGauges(0, 0, 0, kv()))
    s = samples(m)
    for name in ("num_drafts_total", "num_draft_tokens_total", "num_accepted_tokens_total",
                 "acceptance_rate", "mean_accepted_length"):
        assert s[f"fitserve_spec_decode_{name}"] == 0.0
    assert not any("per_pos_total{" in n for n in s)  # positions appear once speculation runs


def test_spec_decode_metrics_follow_the_engine_totals() -> None:
    m = Metrics()
    m.set_gauges(EngineGauges(1, 0, 0, kv(), spec([])))
    s = samples(m)
    assert [s[f'fitserve_spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(3)] == [0] * 3
    m.set_gauges(EngineGauges(1, 0, 0, kv(), spec([(3, 3), (3, 1)])))
    m.set_gauges(EngineGauges(1, 0, 0, kv(), spec([(3, 3), (3, 1)])))  # no change: no advance
    m.set_gauges(EngineGauges(1, 0, 0, kv(), spec([(3, 3), (3, 1), (2, 0), (3, 2)])))
    s = samples(m)
    assert s["fitserve_spec_decode_num_drafts_total"] == 4
    assert s["fitserve_spec_decode_num_draft_tokens_total"] == 11
    assert s["fitserve_spec_decode_num_accepted_tokens_total"] == 6
    per_pos = [s[f'fitserve_spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(3)]
    assert per_pos == [3, 2, 1]
    assert s["fitserve_spec_decode_acceptance_rate"] == pytest.approx(6 / 11)
    assert s["fitserve_spec_decode_mean_accepted_length"] == pytest.approx(1 + 6 / 4)


def test_a_fresh_engine_restarting_its_spec_totals_does_not_go_backwards() -> None:
    m = Metrics()
    m.set_gauges(EngineGauges(0, 0, 0, kv(), spec([(3, 3), (3, 3)])))
    m.set_gauges(EngineGauges(0, 0, 0, kv(), spec([(2, 1)])))  # a new engine: the new baseline
    m.set_gauges(EngineGauges(0, 0, 0, kv(), spec([(2, 1), (3, 2)])))
    s = samples(m)
    assert s["fitserve_spec_decode_num_drafts_total"] == 3
    assert s["fitserve_spec_decode_num_draft_tokens_total"] == 9
    assert s["fitserve_spec_decode_num_accepted_tokens_total"] == 8
    assert s['fitserve_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == 3
    assert s['fitserve_spec_decode_num_accepted_tokens_per_pos_total{position="1"}'] == 3
    assert s['fitserve_spec_decode_num_accepted_tokens_per_pos_total{position="2"}'] == 2


def test_completion_counts_default_to_zero() -> None:
    c = Completion(index=0, text="", token_ids=[], logprobs=None, finish_reason=None, stop_reason=None)
    assert (c.num_draft_tokens, c.num_accepted_tokens) == (0, 0)
