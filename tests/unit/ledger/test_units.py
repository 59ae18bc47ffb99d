"""Byte sizes with their unit spelled out (issue 42, item 5): GB is 10^9, GiB is 2^30, a bare
G is refused naming both readings."""

from __future__ import annotations

import pytest

from fitserve.ledger.errors import PlanError
from fitserve.ledger.units import fmt_bytes_both, parse_size


@pytest.mark.parametrize(("text", "value"), [
    ("500GB", 500 * 10**9), ("500 gb", 500 * 10**9), ("500e9", 500 * 10**9),
    ("500000000000", 500 * 10**9), ("500e9B", 500 * 10**9),
    ("500GiB", 500 * 2**30), ("1.5GiB", 3 * 2**29), ("64MiB", 64 * 2**20), ("2TB", 2 * 10**12),
])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text, "--model-bytes") == value


@pytest.mark.parametrize(("text", "message"), [
    ("500G", "a bare G is ambiguous; write 500GB (500,000,000,000 B) or 500GiB "
             "(536,870,912,000 B)"),
    ("2T", "a bare T is ambiguous"),
    ("500x", "not a size"),
    ("0.5B", "not a whole number of bytes"),
])
def test_parse_size_refuses(text: str, message: str) -> None:
    with pytest.raises(PlanError, match="--model-bytes") as e:
        parse_size(text, "--model-bytes")
    assert message in str(e.value)


def test_fmt_bytes_both() -> None:
    # 500e9 B = 500.00 GB = 500e9 / 2^30 = 465.66 GiB
    assert fmt_bytes_both(500e9) == "500.00 GB = 465.66 GiB"
    assert fmt_bytes_both(500 * 2**30) == "536.87 GB = 500.00 GiB"
    assert fmt_bytes_both(512) == "512 B"
