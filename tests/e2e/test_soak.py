"""A CI-sized soak (fitserve.tools.bench.soak; the long run is benchmarks/soak.py): two rounds of the
same mixed load on the shared server, with clients that leave early, random n, stop strings,
streaming and not. Each round must balance exactly (every engine request the server queued is
finished once: answered, or aborted because its client left), leave no KV block used and no
request in the table, and the second round must not grow RSS by more than RSS_BOUND_MIB."""

from __future__ import annotations

from fitserve.tools.bench.soak import SoakConfig, soak
from tests.e2e.conftest import API_KEY, MODEL, Server

RSS_BOUND_MIB = 32.0


def test_soak_balances_and_returns_to_rest(server: Server) -> None:
    cfg = SoakConfig(requests=40, concurrency=12, max_tokens=(4, 12), p_leave=0.25, seed=7)
    report = soak(server.url, API_KEY, MODEL, cfg, rounds=2, pid=server.proc.pid)
    for r in report.rounds:
        assert not r.problems(), (r.index, r.problems(), r.to_dict())
        assert r.sent == cfg.requests and r.statuses.get(200, 0) > cfg.requests // 2, r.to_dict()
    first = report.rounds[0]
    assert first.left > 0 and first.finished["abort"] > 0, "vacuous: no client left early"
    assert first.added > first.statuses[200], "vacuous: no request with n > 1"
    growth = report.rss_growth_mib
    assert growth is not None and growth <= RSS_BOUND_MIB, [r.to_dict() for r in report.rounds]
