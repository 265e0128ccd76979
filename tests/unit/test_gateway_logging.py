"""The gateway's access log: uvicorn logged every /health and /metrics request at
INFO, so a load balancer's probes and Prometheus' scrapes buried the requests. Through the logging
configuration `sluice gateway` hands uvicorn (applied in every worker), their successful access
lines are dropped unless debug logging is on; failures and every other path are still logged."""

from __future__ import annotations

import logging
import logging.config

import pytest

from gateway.main import QuietProbes, log_config


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
                         ("/health", 503), ("/v1/completions", 200), ("/tokenize", 200)):
        access_logger.handle(access_record(path, status))
    out = capsys.readouterr().out
    assert "/v1/completions" in out and "/tokenize" in out
    assert "GET /health HTTP/1.1\" 503" in out  # a failing probe is news
    assert "/metrics" not in out and "/ping" not in out and "/health?x=1" not in out
    assert out.count("/health") == 1


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
