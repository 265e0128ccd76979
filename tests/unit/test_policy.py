"""The engine-lost rule (sluice.wire.policy), the one place gateway code asks."""

from sluice.wire import policy


def test_live_engine_means_keep_waiting():
    assert not policy.engine_lost(live_engines=1, emitted=True, no_engine_for_s=1e9)


def test_emitted_and_no_engine_is_lost_at_once():
    assert policy.engine_lost(live_engines=0, emitted=True, no_engine_for_s=0.0)


def test_untouched_work_waits_up_to_the_bound():
    assert not policy.engine_lost(live_engines=0, emitted=False, no_engine_for_s=policy.NO_ENGINE_WAIT_S - 0.1)
    assert policy.engine_lost(live_engines=0, emitted=False, no_engine_for_s=policy.NO_ENGINE_WAIT_S)
    assert policy.engine_lost(live_engines=0, emitted=False, no_engine_for_s=2.0, wait_s=1.0)
