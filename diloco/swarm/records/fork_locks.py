"""Locks shared by a process and its forked children that a killed holder cannot keep.

hivemind's futures (``hivemind.utils.mpfuture``) serialise every result a DHT or averager process sends back, every
start of a process' future backend and every allocation of a future's shared state with three ``multiprocessing``
locks, made once at import and inherited by every process forked after it. Such a lock is a semaphore in shared
memory: a process that dies holding it (``terminate()`` after a shutdown grace, the OOM killer, a SIGKILL) never
releases it, and every other process of the family then blocks for good on its next future, with no error. Seen as a
trainer's ``DecentralizedAverager.step`` waiting forever for the averager process to answer, and that averager
unable to shut down.

``KillSafeLock`` is the same lock made of two parts: a POSIX record lock on an unlinked file, which excludes other
processes and which the kernel drops when its holder dies, and a thread lock, which excludes the other threads of
the same process (record locks belong to a process, not a thread). ``make_hivemind_locks_kill_safe`` puts them in
place of hivemind's; it must run before the first DHT or averager process is forked, as ``start_dht`` does. Relies
on the private class attributes ``MPFuture._initialization_lock``, ``MPFuture._update_lock`` and
``SharedBytes._lock`` of hivemind 1.1.12.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading

from hivemind.utils.mpfuture import MPFuture, SharedBytes


class KillSafeLock:
    """A non-reentrant lock for the threads of a process and the processes forked from it after it was made; the
    kernel releases it when the process that holds it dies. Supports ``acquire``/``release`` and ``with``."""

    def __init__(self) -> None:
        with tempfile.TemporaryFile() as file:  # unlinked at once; the duplicate descriptor keeps it open
            self._fd = os.dup(file.fileno())  # close-on-exec (Python's default): p2pd and other exec'd programs
            # never see it, and no other descriptor of this file is ever closed (that would drop our record lock)
        self._threads = threading.Lock()
        # A thread of the parent may hold the thread lock at the moment of a fork; that thread does not exist in the
        # child, and the record lock is the parent's alone, so a child starts with the lock free.
        os.register_at_fork(after_in_child=self._renew_thread_lock)

    def _renew_thread_lock(self) -> None:
        self._threads = threading.Lock()

    def acquire(self, block: bool = True, timeout: float = -1) -> bool:
        """Take the lock: wait for it (``timeout`` bounds the wait for another thread of this process only), or
        with ``block=False`` return False at once if someone holds it."""
        if not self._threads.acquire(block, timeout if block else -1):
            return False
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX if block else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._threads.release()
            return False
        except BaseException:
            self._threads.release()
            raise
        return True

    def release(self) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN)
        self._threads.release()

    def __enter__(self) -> KillSafeLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def make_hivemind_locks_kill_safe() -> None:
    """Replace hivemind's process-family locks with ``KillSafeLock``s, once per process (idempotent). Call it before
    any hivemind process is forked: one forked earlier keeps the old locks."""
    if isinstance(MPFuture._update_lock, KillSafeLock):
        return
    MPFuture._initialization_lock = KillSafeLock()
    MPFuture._update_lock = KillSafeLock()
    SharedBytes._lock = KillSafeLock()
