"""Redis auth for every process: an engine and a gateway (real processes) on a Redis Cluster that
admits only an ACL user with a password, and the offline ``WireClient`` on the same URL."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai import OpenAI

from sluice.wire.client import WireClient
from tests.e2e.conftest import start_stack, stop_stack

pytestmark = [pytest.mark.model, pytest.mark.docker, pytest.mark.redis]


def test_engine_gateway_and_wire_client_authenticate(redis_cluster_factory, model_dir, tmp_path) -> None:
    cluster = redis_cluster_factory(username="sluice", password="pa:ss@w/rd", replicas_per_master=0)
    assert "sluice:" in cluster.url and "pa%3Ass%40w%2Frd@" in cluster.url  # percent-encoded in the URL
    stack = start_stack(cluster.url, Path(model_dir), tmp_path, num_gateways=1)
    try:
        client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=stack.model_name, max_tokens=4, temperature=0.0,
                                               messages=[{"role": "user", "content": "Hi"}])
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
        wire = WireClient.from_url(cluster.url)
        assert [e.model for e in wire.engines().values()] == [stack.model_name]
        result = wire.submit(stack.model_name, [1, 2, 3], {"temperature": 0.0, "max_tokens": 2}).collect(timeout=60)
        assert result.finish_reason == "length" and len(result.token_ids) == 2
        wire.close()
    finally:
        stop_stack(stack)
