"""The process's CPU split by what its threads do (mnv3.thread_cpu), which /metrics exports and stage 5 reports."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mnv3 import thread_cpu
from mnv3.thread_cpu import ENGINE_AND_OTHER, EVENT_LOOP, INFERENCE, PREPROCESS, ROLES, cpu_seconds_by_role

pytestmark = pytest.mark.unit

BURN_S = 0.15


def burn(seconds: float = BURN_S) -> None:
    """Spend `seconds` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def spent(before: dict, after: dict) -> dict:
    return {role: after[role] - before[role] for role in ROLES}


def test_each_thread_counts_for_its_role_and_the_roles_add_up_to_the_process():
    me = {threading.get_ident(): EVENT_LOOP}
    with (
        ThreadPoolExecutor(1, thread_name_prefix=thread_cpu.PREPROCESS_THREADS) as decoding,
        ThreadPoolExecutor(1, thread_name_prefix=thread_cpu.INFERENCE_THREADS) as inferring,
        ThreadPoolExecutor(1, thread_name_prefix="someone-else") as unnamed,
    ):
        for pool in (decoding, inferring, unnamed):
            pool.submit(burn, 0).result()  # started: their clocks exist before the first reading
        process_before, before = time.process_time(), cpu_seconds_by_role(me)
        decoding.submit(burn, 2 * BURN_S).result()
        inferring.submit(burn).result()
        unnamed.submit(burn).result()
        burn(BURN_S / 2)
        after, process_after = cpu_seconds_by_role(me), time.process_time()

    used = spent(before, after)
    assert used[PREPROCESS] == pytest.approx(2 * BURN_S, abs=0.03)
    assert used[INFERENCE] == pytest.approx(BURN_S, abs=0.03)
    # the unnamed thread is not the engine, but no role claims it: it is counted with the engine's threads
    assert used[ENGINE_AND_OTHER] == pytest.approx(BURN_S, abs=0.03)
    assert used[EVENT_LOOP] == pytest.approx(BURN_S / 2, abs=0.03)
    # every reading is the process's CPU time split, so what they spent adds up to what the process spent
    assert before[EVENT_LOOP] > 0 and sum(before.values()) >= process_before
    assert sum(after.values()) <= process_after
    assert sum(used.values()) == pytest.approx(process_after - process_before, abs=0.01)


def test_a_thread_that_exits_keeps_its_seconds_in_the_total():
    before = cpu_seconds_by_role()
    with ThreadPoolExecutor(1, thread_name_prefix=thread_cpu.PREPROCESS_THREADS) as decoding:
        decoding.submit(burn).result()
    after = cpu_seconds_by_role()  # the pool's thread has exited: its clock is gone, not its seconds
    assert sum(after.values()) - sum(before.values()) >= BURN_S - 0.01
    assert after[ENGINE_AND_OTHER] - before[ENGINE_AND_OTHER] >= BURN_S - 0.01


def test_without_per_thread_clocks_the_process_is_one_role(monkeypatch):
    monkeypatch.delattr(time, "pthread_getcpuclockid")
    seconds = cpu_seconds_by_role({threading.get_ident(): EVENT_LOOP})
    assert set(seconds) == set(ROLES)
    assert seconds[ENGINE_AND_OTHER] > 0 and all(seconds[role] == 0 for role in ROLES if role != ENGINE_AND_OTHER)
