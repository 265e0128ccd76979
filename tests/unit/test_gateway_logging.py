"""The gateway's access log: uvicorn logged every /health and /metrics request at
INFO, so a load balancer's probes and Prometheus' scrapes buried the requests. Through the logging
configuration `sluice gateway` hands uvicorn (applied in every worker), their successful access
lines are dropped unless debug logging is on, and so is /health's "not ready" 503 (a stack that
starts polls it: `sluice serve` did hundreds of times); server errors and every other path are
still logged."""

from __future__ import annotations

import logging
import logging.config

import pytest

from gateway.main import QuietProbes, QuietStartup, log_config


def access_record(path: str, status: int) -> logging.LogRecord:
    # what uvicorn's httptools/h11 protocols log for a request
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 0, '%s - "%s %s HTTP/%s" %d',
                             ("127.0.0.1:5000", "GET", path, "1.1", status), None)


@pytest.fixture
def access_logger():
    logger = logging.getLogger("uvicorn.access")
    level, handlers, propagate = logger.level, logger.handlers[:], logger.propagate
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers
    logger.propagate = propagate


def test_probes_and_scrapes_are_quiet_at_info(access_logger, capsys):
    logging.config.dictConfig(log_config())  # what uvicorn.run(log_config=...) does in each worker
    access_logger.setLevel(logging.INFO)
    for path, status in (("/health", 200), ("/metrics", 200), ("/ping", 200), ("/health?x=1", 200),
                         ("/health", 503), ("/health", 500), ("/metrics", 500), ("/v1/completions", 200),
                         ("/v1/completions", 503), ("/tokenize", 200)):
        access_logger.handle(access_record(path, status))
    out = capsys.readouterr().out
    assert "/v1/completions HTTP/1.1\" 200" in out and "/v1/completions HTTP/1.1\" 503" in out
    assert "/tokenize" in out
    assert "GET /health HTTP/1.1\" 500" in out and "GET /metrics HTTP/1.1\" 500" in out  # a broken probe is news
    assert "GET /health HTTP/1.1\" 503" not in out  # not ready yet: the normal answer while a stack starts
    assert "/ping" not in out and "/health?x=1" not in out
    assert out.count("/health") == 1 and out.count("/metrics") == 1


def test_debug_logging_shows_them():
    logger = logging.getLogger("uvicorn.access")
    old = logger.level
    try:
        logger.setLevel(logging.DEBUG)
        assert QuietProbes().filter(access_record("/health", 200))
        logger.setLevel(logging.INFO)
        assert not QuietProbes().filter(access_record("/health", 200))
    finally:
        logger.setLevel(old)


def test_response_ids_never_reach_the_access_log(access_logger, capsys):
    logging.config.dictConfig(log_config())
    access_logger.setLevel(logging.INFO)
    for path in ("/v1/responses/resp_5f1e2d3c4b5a69788796a5b4c3d2e1f0", "/v1/responses/resp_abc/input_items",
                 "/v1/responses/resp_abc?stream=true&starting_after=3", "/v1/responses"):
        access_logger.handle(access_record(path, 200))
    out = capsys.readouterr().out
    assert "resp_" not in out
    assert "/v1/responses/{id} " in out and "/v1/responses/{id}/input_items" in out
    assert "/v1/responses/{id}?stream=true" in out and '"GET /v1/responses HTTP' in out


def test_uvicorns_start_narration_gives_way_to_the_gateways_ready_line():
    """uvicorn's "Started server process", "Waiting for application startup." ... lines are dropped
    at INFO (the gateway logs one ready line instead); errors and debug logging still show them."""
    logger = logging.getLogger("uvicorn.error")
    old = logger.level
    try:
        logger.setLevel(logging.INFO)
        record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 0, "Started server process [%d]", (7,), None)
        assert not QuietStartup().filter(record)
        running = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 0,
                                    "Uvicorn running on %s://%s:%d (Press CTRL+C to quit)", ("http", "h", 1), None)
        assert not QuietStartup().filter(running)
        assert QuietStartup().filter(logging.LogRecord("uvicorn.error", logging.INFO, __file__, 0, "Shutting down",
                                                       None, None))
        assert QuietStartup().filter(logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 0,
                                                       "Started server process failed", None, None))
        logger.setLevel(logging.DEBUG)
        assert QuietStartup().filter(record)
    finally:
        logger.setLevel(old)


def test_conversation_and_item_ids_never_reach_the_access_log(access_logger, capsys):
    logging.config.dictConfig(log_config())
    access_logger.setLevel(logging.INFO)
    for path in ("/v1/conversations/conv_5f1e2d3c", "/v1/conversations/conv_5f1e2d3c/items?after=msg_9",
                 "/v1/conversations/conv_5f1e2d3c/items/msg_77", "/v1/conversations"):
        access_logger.handle(access_record(path, 200))
    out = capsys.readouterr().out
    assert "conv_" not in out and "msg_77" not in out
    assert "/v1/conversations/{id} " in out and "/v1/conversations/{id}/items/{id} " in out
    assert "/v1/conversations/{id}/items?after=msg_9" in out and '"GET /v1/conversations HTTP' in out
