"""awa_fast.limits: the Rate value, its CLI spelling, max_running validation."""

from __future__ import annotations

import pytest

import awa_fast
from awa_fast.errors import ConfigError
from awa_fast.limits import Rate, check_max_running, parse_rate


def test_rate_defaults_and_public_name() -> None:
    assert awa_fast.Rate is Rate
    r = awa_fast.Rate(100, per=1.0, burst=100)
    assert (r.count, r.per, r.burst, r.per_second) == (100, 1.0, 100, 100.0)
    assert Rate(20, per=2.0).burst == 20.0  # one period's worth
    assert Rate(0.5, per=1.0).burst == 1.0  # at least one job can ever start
    assert str(Rate(100, per=1.0, burst=10)) == "100/1s burst 10"


@pytest.mark.parametrize("text,count,per", [("100/1s", 100, 1.0), ("100/s", 100, 1.0), ("5/250ms", 5, 0.25),
                                            ("600/1m", 600, 60.0), ("10/1h", 10, 3600.0), (" 2.5 / 2 s ", 2.5, 2.0)])
def test_parse_rate(text: str, count: float, per: float) -> None:
    r = parse_rate(text, burst=7)
    assert (r.count, r.per, r.burst) == (count, per, 7)


@pytest.mark.parametrize("bad", ["", "100", "100/", "/1s", "100/1d", "-1/1s", "1/0s", "x/1s"])
def test_parse_rate_refuses(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_rate(bad)


@pytest.mark.parametrize("kw", [{"count": 0}, {"count": -1}, {"count": float("nan")}, {"count": True},
                                {"count": 1, "per": 0}, {"count": 1, "burst": 0.5}, {"count": 1, "burst": "3"}])
def test_rate_refuses(kw: dict) -> None:
    with pytest.raises(ConfigError):
        Rate(**kw)


def test_max_running_validation() -> None:
    assert check_max_running(None) is None
    assert check_max_running(0) == 0 and check_max_running(5) == 5
    for bad in (-1, 2.5, True, "5"):
        with pytest.raises(ConfigError):
            check_max_running(bad)
