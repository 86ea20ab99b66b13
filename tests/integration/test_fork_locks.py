"""hivemind's process-family locks, made kill-safe by ``start_dht``: a forked process that dies holding one leaves the
rest of the family working (with hivemind's own locks, every later DHT reply would wait for it forever)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture, SharedBytes

from diloco.swarm.records.fork_locks import KillSafeLock
from tests.support.threads import within

FORK = mp.get_context("fork")
OWNERS = {"_update_lock": MPFuture, "_initialization_lock": MPFuture, "_lock": SharedBytes}


def _die_holding(owner: type, name: str) -> None:
    getattr(owner, name).acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def _hold_until(lock: KillSafeLock, held: mp.Event, leave: mp.Event) -> None:
    with lock:
        held.set()
        leave.wait(30)


@pytest.mark.parametrize("name", sorted(OWNERS))
def test_a_process_killed_holding_a_hivemind_lock_does_not_stop_the_dht(bootstrap, name):
    owner = OWNERS[name]
    assert isinstance(getattr(owner, name), KillSafeLock)  # start_dht put them in place
    dying = FORK.Process(target=_die_holding, args=(owner, name))
    dying.start()
    dying.join(30)
    assert dying.exitcode == -signal.SIGKILL
    # a store and a get are each answered by the DHT process through a future: the update lock carries the
    # reply, and a process forked now starts its own future backend (the other two locks)
    assert within(30, bootstrap.store, "after", name, get_dht_time() + 60)
    assert within(30, bootstrap.get, "after", True).value == name
    assert within(10, getattr(owner, name).acquire, True, 5)
    getattr(owner, name).release()
    child = FORK.Process(target=_die_holding, args=(owner, name))  # and a new child can take it too
    child.start()
    child.join(30)
    assert child.exitcode == -signal.SIGKILL


def test_the_lock_excludes_other_processes_and_threads_until_released():
    lock = KillSafeLock()
    held, leave = FORK.Event(), FORK.Event()
    holder = FORK.Process(target=_hold_until, args=(lock, held, leave))
    holder.start()
    try:
        assert held.wait(30)
        assert not lock.acquire(block=False)  # another process holds it
        leave.set()
        holder.join(30)
        assert within(10, lock.acquire)
        assert not within(10, lambda: lock.acquire(True, 0.2))  # another thread (this one) holds it
        assert not lock.acquire(block=False)
        lock.release()
        with lock:
            assert not within(10, lambda: lock.acquire(block=False))
        assert lock.acquire(block=False)
        lock.release()
    finally:
        leave.set()
        holder.join(30)
        if holder.is_alive():
            holder.kill()
            holder.join()
