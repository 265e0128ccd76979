"""docs/metrics.md against live processes: a scrape of a running engine (its Redis I/O threads and
step loop on a real Redis, a model-free engine inside) and of a running gateway finds every
documented metric, each sample with the documented labels (and, where the docs list them, only the
documented label values: no ``code="3"``), and no Sluice series the docs do not list. (That every
metric name any doc mentions is defined at all is tests/unit/test_docs.py's static check.)"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_service.service.metrics import EngineMetrics
from sluice.wire.client import WireClient
from tests.docs_check import metric_tables
from tests.integration import test_gateway_support as support
from tests.integration.test_engine_reliability import MODEL as ENGINE_MODEL
from tests.integration.test_engine_reliability import FakeService, wait_until
from tests.integration.test_gateway_support import MODEL

fake_engine = support.fake_engine
gateway = support.gateway
make_gateway = support.make_gateway

pytestmark = [pytest.mark.model, pytest.mark.docker, pytest.mark.redis]

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
ENGINE_LABELS = {"model", "engine_id"}
# prometheus-client's own series (documented as such in docs/metrics.md)
FOREIGN = ("process_", "python_")


def documented() -> tuple[dict[str, dict[str, set[str] | None]], dict[str, dict[str, set[str] | None]]]:
    """(engine, gateway): metric -> {label: allowed values, or None when any value is allowed}."""
    text = DOC.read_text(encoding="utf-8")
    engine_part = text[text.index("## Engine"):text.index("## Gateway")]
    gateway_part = text[text.index("## Gateway"):text.index("## Scraping")]
    return metric_tables(engine_part), metric_tables(gateway_part)


def scrape(url: str) -> tuple[set[str], list]:
    """The metric families (by the name of their TYPE line) and every sample."""
    text = httpx.get(url, timeout=10).text
    families = set(re.findall(r"^# TYPE (\S+) ", text, flags=re.M))
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    return families, samples


def _base(name: str, docs: dict) -> str | None:
    for suffix in ("", "_bucket", "_sum", "_count", "_created"):
        if suffix and not name.endswith(suffix):
            continue
        stem = name[: len(name) - len(suffix)] if suffix else name
        for candidate in (stem, stem + "_total"):
            if candidate in docs:
                return candidate
    return None


def check(url: str, docs: dict, always: set[str]) -> None:
    families, samples = scrape(url)
    assert docs, "no metric parsed from docs/metrics.md"
    missing = set(docs) - families
    assert not missing, f"documented but not exported: {sorted(missing)}"
    for s in samples:
        if s.name.startswith(FOREIGN):
            continue
        base = _base(s.name, docs)
        assert base is not None, f"exported but not documented: {s.name}{s.labels}"
        allowed = {**docs[base], **dict.fromkeys(always)}
        extra = set(s.labels) - set(allowed) - ({"le"} if s.name.endswith("_bucket") else set())
        assert not extra, f"{s.name}: undocumented labels {extra} ({s.labels})"
        assert always <= set(s.labels), f"{s.name}: missing {always - set(s.labels)}"
        for label, values in docs[base].items():
            if values is not None and label in s.labels:
                assert s.labels[label] in values, f"{s.name}: {label}={s.labels[label]!r} not in {sorted(values)}"


def test_a_live_engine_exports_what_the_docs_say(clean_redis, redis_client):
    svc = FakeService(clean_redis)
    metrics = EngineMetrics(ENGINE_MODEL, svc.settings.engine_id)
    metrics.bind(svc.worker.snapshot, io_stats=svc.io.stats, worker_counters=svc.worker.counters)
    svc.worker.metrics = svc.io.metrics = metrics
    metrics.cache_config(block_size=16, cache_dtype="float32", num_blocks=64, enable_prefix_caching=True)  # no cache here
    port = metrics.serve(0, "127.0.0.1")
    svc.start()
    try:
        client = WireClient(redis_client)
        client.wait_for_engine(ENGINE_MODEL, timeout=10)
        ok = client.submit(ENGINE_MODEL, [1, 2, 3], {"temperature": 0.0, "max_tokens": 3}).collect(timeout=10)
        bad = client.submit(ENGINE_MODEL, [1, 2, 3], {"max_tokens": 3, "n": 17}).collect(timeout=10)
        assert ok.finish_reason == "length" and bad.error_code is not None
        wait_until(lambda: svc.io.stats["published_batches"] > 0, 5, "a batch published")
        engine_docs, _ = documented()
        check(f"http://127.0.0.1:{port}/metrics", engine_docs, ENGINE_LABELS)
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'sluice:request_errors_total{code="invalid_request"' in text
        assert re.search(r'^sluice:worker_requests_total\{[^}]*outcome="invalid"[^}]*\} 1\.0$', text, re.M), text
    finally:
        svc.stop()
        metrics.close()


def test_a_live_gateway_exports_what_the_docs_say(gateway, fake_engine):
    r = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200, r.text
    _, gateway_docs = documented()
    check(f"{gateway.url}/metrics", gateway_docs, set())
