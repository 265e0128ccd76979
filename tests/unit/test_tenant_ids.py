"""The tenant id and weight rules of the contract (sluice.wire.tenants), and the engine's check of
them on a queue entry (sluice.wire.limits.check_request)."""

from __future__ import annotations

import pytest

from sluice.wire import codec, limits, tenants


@pytest.mark.parametrize("tenant", ["", "a", "team-a", "Team_7.prod", "x" * 64])
def test_valid_tenant_ids(tenant):
    assert tenants.check_tenant_id(tenant) is None


@pytest.mark.parametrize("tenant", ["-a", ".a", "a b", "a}b", "a{b", "a:b", "x" * 65, "é", None, 3])
def test_invalid_tenant_ids_say_why(tenant):
    assert tenants.check_tenant_id(tenant)


@pytest.mark.parametrize(("weight", "ok"), [(1, True), (1000, True), (0, False), (1001, False), (True, False),
                                             (2.0, False)])
def test_weights(weight, ok):
    assert (tenants.check_weight(weight) is None) is ok


def test_label_of_the_default_tenant_is_not_empty():
    assert tenants.label("") == "default" and tenants.label("team-a") == "team-a"


def _request(**kw):
    return codec.make_request("r1", "m", [1, 2, 3], {"max_tokens": 4}, reply_to="g", **kw)


def test_engine_refuses_a_malformed_tenant_on_the_wire():
    assert limits.check_request(_request(tenant="team-a", tenant_weight=5), vocab_size=10, max_model_len=64) is None
    bad = limits.check_request(_request(tenant="a}b"), vocab_size=10, max_model_len=64)
    assert bad is not None and bad.param == "tenant"
    heavy = limits.check_request(_request(tenant="a", tenant_weight=10_000), vocab_size=10, max_model_len=64)
    assert heavy is not None and heavy.param == "tenant_weight"
