"""The fleet router's pure parts (no Ray): the prefix index against the plain longest-common-prefix
over every prompt each replica was sent, the ranking rules, the request's routing text and the
merged /metrics exposition (parsed back by prometheus_client's own parser)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from fitserve.fleet.metrics_merge import merge_metrics
from fitserve.fleet.request import routing_text
from fitserve.fleet.routing import PrefixIndex, ReplicaLoad, RoutingPolicy, rank_replicas

CHUNK = 4


def naive_match(text: str, sent: list[str]) -> int:
    """The longest chunk-aligned common prefix of ``text`` with any prompt in ``sent`` (bytes)."""
    data = text.encode()
    best = 0
    for s in sent:
        other = s.encode()
        n = 0
        while n + CHUNK <= min(len(data), len(other)) and data[n:n + CHUNK] == other[n:n + CHUNK]:
            n += CHUNK
        best = max(best, n)
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["r1", "r2", "r3"]), st.text("ab", max_size=20)), max_size=12),
       st.text("ab", max_size=20))
def test_prefix_index_matches_the_plain_longest_common_prefix(sent: list[tuple[str, str]], query: str) -> None:
    index = PrefixIndex(chunk_chars=CHUNK)
    for replica, prompt in sent:
        index.insert(prompt, replica)
    got = index.match(query, ["r1", "r2", "r3"])
    for replica in ("r1", "r2", "r3"):
        assert got[replica] == naive_match(query, [p for r, p in sent if r == replica]), replica


def test_prefix_index_forgets_a_removed_replica_and_old_chains() -> None:
    index = PrefixIndex(chunk_chars=CHUNK, max_entries=2)
    index.insert("aaaabbbb", "r1")
    assert index.match("aaaabbbbcccc", ["r1"]) == {"r1": 8}
    index.insert("ccccdddd", "r2")  # two more chains: the oldest two are dropped
    assert index.match("aaaabbbb", ["r1"]) == {"r1": 0}
    index.remove("r2")
    assert index.match("ccccdddd", ["r2"]) == {"r2": 0}


def loads(*spec: tuple[str, int, float]) -> list[ReplicaLoad]:
    return [ReplicaLoad(r, n, c) for r, n, c in spec]


def test_affinity_prefers_the_holder_within_the_load_bound_and_the_least_loaded_past_it() -> None:
    policy = RoutingPolicy("affinity", balance_abs=2)
    ls = loads(("a", 2, 1.0), ("b", 0, 1.0))
    assert rank_replicas(policy, ls, {"a": 100, "b": 0}, 120, 0) == [["a"], ["b"]]
    ls = loads(("a", 3, 1.0), ("b", 0, 1.0))  # a is 3 requests above b: past the bound
    assert rank_replicas(policy, ls, {"a": 100, "b": 0}, 120, 0) == [["b"], ["a"]]
    # a match under match_threshold of the prompt does not count
    assert rank_replicas(policy, loads(("a", 1, 1.0), ("b", 0, 1.0)), {"a": 5}, 120, 0)[0] == ["b"]


def test_load_is_weighted_by_capacity_units() -> None:
    """Under least-load, a replica of capacity 2 takes two requests for each of a capacity-1
    replica's: the counts the ranking produces when each request goes to its first choice."""
    policy = RoutingPolicy("least-load")
    in_flight = {"big": 0, "small": 0}
    for _ in range(30):
        first = rank_replicas(policy, loads(("big", in_flight["big"], 2.0), ("small", in_flight["small"], 1.0)),
                              {}, 0, 0)[0][0]
        in_flight[first] += 1
    assert in_flight == {"big": 20, "small": 10}


def test_load_counts_what_the_replica_reports_and_kv_usage_breaks_ties() -> None:
    """A replica busy with another router's requests (its stats say 6 running + waiting) is more
    loaded than an idle one this router has 1 request on; equal loads go to the emptier KV pool."""
    policy = RoutingPolicy("least-load")
    busy, idle = ReplicaLoad("busy", 0, 1.0, 0.0, reported=6), ReplicaLoad("idle", 1, 1.0, 0.0)
    assert rank_replicas(policy, [busy, idle], {}, 0, 0)[0] == ["idle"]
    full, empty = ReplicaLoad("full", 1, 1.0, 0.9), ReplicaLoad("empty", 1, 1.0, 0.1)
    assert rank_replicas(policy, [full, empty], {}, 0, 0)[0] == ["empty"]


def test_round_robin_rotates() -> None:
    policy = RoutingPolicy("round-robin")
    ls = loads(("a", 5, 1.0), ("b", 0, 1.0), ("c", 0, 1.0))
    assert [rank_replicas(policy, ls, {}, 10, t)[0][0] for t in range(4)] == ["a", "b", "c", "a"]


def test_bad_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="routing mode must be one of"):
        RoutingPolicy("random")  # type: ignore[arg-type]


def test_routing_text_of_chat_and_completions_bodies() -> None:
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]}
    assert routing_text(json.dumps(chat).encode()) == "<system>S\n<user>U\n"
    assert routing_text(b'{"prompt": "hello"}') == "hello"
    assert routing_text(b'{"prompt": [1, 2, 3]}') == "1 2 3"
    assert routing_text(b"not json") == ""


def test_merged_metrics_parse_with_a_replica_label_per_sample() -> None:
    text = ('# HELP x_total X\n# TYPE x_total counter\nx_total 3.0\n'
            '# HELP y Y\n# TYPE y gauge\ny{kind="a"} 1.0\n')
    merged = merge_metrics({"r1": text, "r2": text.replace("3.0", "4.0")})
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    xs = {s.labels["replica"]: s.value for s in families["x"].samples}
    assert xs == {"r1": 3.0, "r2": 4.0}
    assert {(s.labels["replica"], s.labels["kind"]) for s in families["y"].samples} == {("r1", "a"), ("r2", "a")}
