"""``gateway.prepare_pool.PreparePool`` with real worker processes: bounded admission (a full pool
refuses at once with 429 ``gateway_busy`` and ``Retry-After``, and takes jobs again as soon as
places free), a waiting job whose client left is dropped unrun, a job's 400 comes back as itself,
a crash or a job past the timeout is a 500 and the worker is replaced, and the model card reaches a
worker once, its tokenizer built there from the card's text."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway import errors, prepare_pool
from gateway.errors import OpenAIError
from gateway.prepare_pool import PreparePool
from sluice.wire.card import ModelCard

# --- jobs (module-level: a worker imports this module to run them) -------------------------------


def wait_for(_ctx, path: str, value: int) -> int:
    while not os.path.exists(path):
        time.sleep(0.01)
    return value


def touch(_ctx, path: str) -> None:
    Path(path).touch()


def pid(_ctx) -> int:
    return os.getpid()


def refuse(_ctx) -> None:
    raise errors.invalid("Invalid value for 'x': no.", param="x")


def fail(_ctx) -> None:
    raise ValueError("a bug")


def crash(_ctx) -> None:
    os._exit(3)


def card_facts(ctx, text: str) -> tuple:
    return ctx.max_model_len, ctx.max_chars_per_token, ctx.tokenizer.encode(text), os.getpid()


@dataclass
class Card:
    """What the pool reads of a LoadedCard."""

    card: ModelCard
    fingerprint: str


# --- tests ---------------------------------------------------------------------------------------


async def _until(predicate, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


@pytest.fixture
def pool():
    pools: list[PreparePool] = []

    def make(workers: int, waiting: int, retry_after_s: int = 1) -> PreparePool:
        p = PreparePool(workers, waiting, retry_after_s)
        p.start()
        pools.append(p)
        return p

    yield make
    for p in pools:
        p.close()


async def test_a_full_pool_refuses_at_once_and_takes_jobs_again_when_places_free(pool, tmp_path) -> None:
    p = pool(1, 1, retry_after_s=2)
    gate = tmp_path / "go"
    running = asyncio.ensure_future(p.run(wait_for, None, str(gate), 1))
    waiting = asyncio.ensure_future(p.run(wait_for, None, str(gate), 2))
    await _until(lambda: p.admitted == 2)
    with pytest.raises(OpenAIError) as refused:
        await p.run(pid, None)
    assert refused.value.status == 429 and refused.value.code == "gateway_busy"
    assert refused.value.headers == {"Retry-After": "2"}
    gate.touch()
    assert (await running, await waiting) == (1, 2)
    await _until(lambda: p.admitted == 0)
    assert isinstance(await p.run(pid, None), int)


async def test_a_waiting_job_whose_client_left_is_dropped_unrun(pool, tmp_path) -> None:
    p = pool(1, 2)
    gate, marker = tmp_path / "go", tmp_path / "ran"
    running = asyncio.ensure_future(p.run(wait_for, None, str(gate), 1))
    left = asyncio.ensure_future(p.run(touch, None, str(marker)))
    await _until(lambda: p.admitted == 2)
    left.cancel()
    await _until(lambda: p.admitted == 1)  # its place is free at once
    gate.touch()
    assert await running == 1
    await p.run(pid, None)  # the worker has taken everything queued before this
    assert not marker.exists()


async def test_a_refusal_comes_back_as_itself_and_failures_are_500s_with_the_worker_replaced(pool, monkeypatch,
                                                                                            tmp_path) -> None:
    p = pool(1, 0)
    with pytest.raises(OpenAIError) as refused:
        await p.run(refuse, None)
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, "x", "invalid_value")
    assert refused.value.message == "Invalid value for 'x': no."
    with pytest.raises(OpenAIError) as failed:
        await p.run(fail, None)
    assert failed.value.status == 500
    first = await p.run(pid, None)  # a job that raised leaves its worker alive
    assert await p.run(pid, None) == first
    with pytest.raises(OpenAIError) as crashed:
        await p.run(crash, None)
    assert crashed.value.status == 500 and "died" in crashed.value.message
    second = await p.run(pid, None)
    assert second != first
    monkeypatch.setattr(prepare_pool, "JOB_TIMEOUT_S", 1.0)
    with pytest.raises(OpenAIError) as stuck:
        await p.run(wait_for, None, str(tmp_path / "never"), 0)
    assert stuck.value.status == 500 and "ran past" in stuck.value.message
    monkeypatch.setattr(prepare_pool, "JOB_TIMEOUT_S", 60.0)  # the next worker has to start first
    assert await p.run(pid, None) not in (first, second)
    assert p.admitted == 0


@pytest.mark.model
async def test_the_card_reaches_a_worker_once_and_its_tokenizer_is_the_card_s(pool, model_dir) -> None:
    from sluice.text.tokenizer import Tokenizer

    card = ModelCard.from_model_dir(model_dir, name="m", max_model_len=512, vocab_size=49152, eos_token_ids=[2])
    loaded = Card(card, card.encode()["fingerprint"])
    p = pool(1, 0)
    text = "Hello, ünïcödé 🙂 <|im_start|>"
    local = Tokenizer.from_dir(model_dir)
    facts = await p.run(card_facts, loaded, text)
    assert facts[:3] == (512, local.max_chars_per_token, local.encode(text))
    assert p._workers[0].cards == {loaded.fingerprint}  # noqa: SLF001 - the next job goes without the card
    again = await p.run(card_facts, Card(None, loaded.fingerprint), text)  # no card to send: the worker's own
    assert again == facts
