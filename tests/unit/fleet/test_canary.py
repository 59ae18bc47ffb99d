"""A canary group's staged share (``plan canary``'s stages): the split sends exactly floor(k f)
of a stage's first k requests to the canary (checked against the fraction's own arithmetic at
every k), a stage ends when both arms hold the plan's n per arm or on a command, the ingress's
group choice puts the canary first exactly for those requests, and ``POST /fleet/canary`` takes
``fitserve plan canary --json``'s output as is."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from fractions import Fraction
from typing import Any

import pytest

from fitserve.fleet.canary import CanarySplit, canary_from_body
from fitserve.fleet.groups import GroupPicker
from fitserve.fleet.routing import RoutingPolicy
from fitserve.tools.sheets.sheet import build_sheet


@pytest.mark.parametrize("percent", [1, 5, 12.5, 25, 33, 50, 99])
def test_each_prefix_of_a_stage_sends_exactly_its_share(percent: float) -> None:
    split = CanarySplit("canary", [Fraction(str(percent)) / 100])
    sent = 0
    for k in range(1, 1001):
        sent += split.take()
        assert sent == (k * Fraction(str(percent))) // 100  # floor(k f), exact
    assert (split.canary, split.baseline) == (sent, 1000 - sent)


def test_a_stage_ends_when_both_arms_hold_n_per_arm() -> None:
    """25% with n = 3: the canary's third request is the stage's 12th (floor(12 / 4) = 3), the
    baseline then holds 9 >= 3; at 50% both reach 3 at the 6th; 100% stays."""
    split = CanarySplit("canary", [Fraction(1, 4), Fraction(1, 2), Fraction(1)], n_per_arm=3)
    taken = [split.take() for _ in range(11)]
    assert (split.stage, sum(taken)) == (0, 2)
    split.take()
    assert split.stage == 1 and split.history == [{"percent": 25.0, "canary": 3, "baseline": 9}]
    for _ in range(6):
        split.take()
    assert split.stage == 2 and split.history[-1] == {"percent": 50.0, "canary": 3, "baseline": 3}
    assert all(split.take() for _ in range(20)) and split.stage == 2
    assert not split.advance()


def test_the_ingress_choice_puts_the_canary_first_for_its_share_only() -> None:
    picker = GroupPicker({"big": 2.0, "small": 1.0, "canary": 1.0}, RoutingPolicy("least-load"))
    picker.start_canary(CanarySplit("canary", [Fraction(1, 10)]))
    firsts = []
    for _ in range(40):
        order = picker.order("")
        assert sorted(order) == ["big", "canary", "small"]
        firsts.append(order[0])
        picker.started(order[0], "")  # held open: the baseline's least-load split shows
    assert firsts.count("canary") == 4
    assert (firsts.count("big"), firsts.count("small")) == (24, 12)  # 2:1 by capacity units
    assert all(o == "canary" for k, o in enumerate(firsts) if (k + 1) % 10 == 0)


def test_plan_canarys_json_is_the_admin_routes_plan() -> None:
    sheet = build_sheet("canary", ["--baseline-rate", "0.02", "--regression-rate", "0.04",
                                   "--stages", "5,25,100", "--json"])
    printed = json.loads(json.dumps(dataclasses.asdict(sheet), default=str))  # what --json prints
    split = canary_from_body({"group": "canary", "plan": printed})
    assert split.stages == [Fraction(1, 20), Fraction(1, 4), Fraction(1)]
    assert split.n_per_arm == sheet.data["n_per_arm"] > 0
    n = split.n_per_arm
    for _ in range(math.ceil(n / Fraction(1, 20))):  # the 5% arm fills last: k = n / f
        split.take()
    assert split.stage == 1 and split.history[0]["canary"] == n


@pytest.mark.parametrize(("body", "message"), [
    ({"stages": [5]}, "needs 'group'"),
    ({"group": "canary", "stages": [0, 5]}, r"in \(0, 100\] percent"),
    ({"group": "canary", "stages": [150]}, r"in \(0, 100\] percent"),
    ({"group": "canary", "stages": "5,25"}, "list of percents"),
    ({"group": "canary", "plan": {"data": {}}}, "plan canary --json"),
    ({"group": "canary", "stages": [5], "n_per_arm": 2.5}, "'n_per_arm' must be an integer"),
])
def test_bad_canary_bodies_are_clear_errors(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        canary_from_body(body)


def test_a_canary_needs_a_known_group_beside_others() -> None:
    with pytest.raises(ValueError, match="no replica group 'nope'"):
        GroupPicker({"a": 1.0, "b": 1.0}, RoutingPolicy()).start_canary(CanarySplit("nope", [Fraction(1)]))
    with pytest.raises(ValueError, match="another replica group"):
        GroupPicker({"a": 1.0}, RoutingPolicy()).start_canary(CanarySplit("a", [Fraction(1)]))


def test_admin_route_starts_advances_and_stops_a_canary() -> None:
    pytest.importorskip("ray.serve", reason="the fitserve[ray] extra is not installed")
    from starlette.requests import Request

    from fitserve.fleet.ingress import FleetIngress

    ingress = FleetIngress([("base", None, 1.0), ("canary", None, 1.0)], api_key="k")  # type: ignore[list-item]

    def post(path: str, body: Any, key: str = "k") -> tuple[int, Any]:
        raw = json.dumps(body).encode()
        scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
                 "headers": [(b"authorization", f"Bearer {key}".encode())]}

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": raw, "more_body": False}

        resp = asyncio.run(ingress(Request(scope, receive)))
        return resp.status_code, json.loads(resp.body)

    assert post("/fleet/canary", {"group": "canary", "stages": [10, 50]}, key="bad")[0] == 401
    status, out = post("/fleet/canary", {"group": "canary", "stages": [10, 50]})
    assert status == 200 and out["canary"]["percent"] == 10
    assert post("/fleet/canary", {"action": "advance"})[1]["canary"]["percent"] == 50
    assert post("/fleet/canary", {"action": "stop"}) == (200, {"canary": None})
    status, out = post("/fleet/canary", {"action": "advance"})
    assert status == 400 and "no canary is running" in out["error"]["message"]
    assert post("/fleet/rollout", {})[1] == {"generation": 1, "status": "rolling"}
    assert asyncio.run(ingress.take_rollout(0.1)) == 1
    assert asyncio.run(ingress.take_rollout(0.05)) is None


def test_a_canary_named_by_its_fleet_file_group_finds_its_deployment() -> None:
    picker = GroupPicker({"fitserve-big": 2.0, "fitserve-small": 1.0}, RoutingPolicy())
    picker.start_canary(CanarySplit("small", [Fraction(1, 2)]))
    assert picker.canary is not None and picker.canary.group == "fitserve-small"


def test_advance_by_time_follows_the_plans_stage_times() -> None:
    """plan canary --traffic-rps 10: each stage's time n / (min(f, 1 - f) R); with advance_by
    "time" a stage ends at the first request past it (a fake clock), whatever the counts."""
    sheet = build_sheet("canary", ["--baseline-rate", "0.02", "--regression-rate", "0.04", "--stages", "10,50,100",
                                   "--traffic-rps", "10"])
    n = sheet.data["n_per_arm"]
    assert sheet.data["stage_s"] == [pytest.approx(n / (0.1 * 10)), pytest.approx(n / (0.5 * 10)), None]
    now = [0.0]
    plan = json.loads(json.dumps(dataclasses.asdict(sheet), default=str))
    split = canary_from_body({"group": "c", "plan": plan, "advance_by": "time"}, clock=lambda: now[0])
    split.take()
    now[0] = sheet.data["stage_s"][0] - 1e-6
    split.take()
    assert split.stage == 0
    now[0] = sheet.data["stage_s"][0]
    split.take()
    assert split.stage == 1 and split.history[0]["canary"] + split.history[0]["baseline"] == 2
    now[0] += sheet.data["stage_s"][1]
    split.take()
    now[0] += 1e9
    assert split.take() and split.stage == 2  # 100% holds


def test_advance_by_needs_what_it_advances_on() -> None:
    with pytest.raises(ValueError, match="needs stage_seconds"):
        canary_from_body({"group": "c", "stages": [5, 100], "advance_by": "time"})
    with pytest.raises(ValueError, match="needs n_per_arm"):
        canary_from_body({"group": "c", "stages": [5, 100], "advance_by": "requests"})
    with pytest.raises(ValueError, match="advance_by must be one of"):
        canary_from_body({"group": "c", "stages": [5, 100], "advance_by": "sometimes"})
    split = canary_from_body({"group": "c", "stages": [50, 100], "n_per_arm": 1, "advance_by": "command"})
    assert [split.take() for _ in range(4)] == [False, True, False, True] and split.stage == 0
