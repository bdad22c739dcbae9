"""RecentDemand: work offered per tenant and dispatched in all, decayed by a half-life."""

from __future__ import annotations

import pytest

from scheduler_svc.core.demand import RecentDemand


def test_work_halves_each_half_life_and_old_tenants_drop_out() -> None:
    demand = RecentDemand(half_life_s=2.0)
    demand.add("a", 100, 0.0)
    demand.add("b", 50, 1.0)
    demand.serve(80, 0.0)
    offered = demand.offered(1.0)
    assert offered["a"] == pytest.approx(100 * 0.5**0.5)
    assert offered["b"] == pytest.approx(50.0)
    assert demand.served(2.0) == pytest.approx(40.0)
    # Seen last more than a half-life ago: no longer counted.
    assert set(demand.offered(2.5)) == {"b"}
    demand.add("a", 10, 4.0)  # its old work decayed, then the new added
    assert demand.offered(4.0)["a"] == pytest.approx(100 * 0.25 + 10)


def test_at_most_max_tenants_are_remembered_the_least_recent_forgotten() -> None:
    demand = RecentDemand(half_life_s=10.0, max_tenants=3)
    for i, tenant in enumerate("abcd"):
        demand.add(tenant, 1, float(i))
    assert set(demand.offered(3.0)) == {"b", "c", "d"}


@pytest.mark.parametrize("kwargs", [{"half_life_s": 0.0}, {"half_life_s": 1.0, "max_tenants": 0}])
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RecentDemand(**kwargs)  # type: ignore[arg-type]
