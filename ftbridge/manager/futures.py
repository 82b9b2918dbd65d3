"""Calls that may block past their deadline (a TCPStore read, a lighthouse try, a status read) run in a
daemon thread while the caller waits on a future: :func:`in_thread`, :func:`call_bounded`. A call left
behind keeps running until its own I/O gives up and its result is dropped, so it must not change shared
state the caller has moved past.

At interpreter exit, calls still running are waited for, at most :data:`EXIT_WAIT_S` (:func:`wait_at_exit`):
Python 3.11 ends a daemon thread that returns from C++ during finalization by unwinding it, and an unwind
through c10d's frames aborts the process (SIGABRT, "terminate called without an active exception") instead
of letting it exit with its own status. Why: docs/design.md, "Hung stores".
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import threading
from datetime import timedelta
from typing import Callable, Optional, Set, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)

EXIT_WAIT_S = 5.0
"""Longest wait (s) at interpreter exit for calls of :func:`in_thread` still running (their own I/O bounds them:
a store connection attempt, a status read)."""
_running: Set["concurrent.futures.Future"] = set()
_running_lock = threading.Lock()


def in_thread(fn: Callable[[], T], name: str) -> "concurrent.futures.Future[T]":
    """Start ``fn()`` in a daemon thread named ``name``; the future ends with its result or exception (``BaseException``
    too). Never raises."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, re-raised there
            future.set_exception(exc)
        finally:
            with _running_lock:
                _running.discard(future)

    with _running_lock:
        _running.add(future)
    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def wait_at_exit(timeout_s: Optional[float] = None) -> int:
    """Wait until every call of :func:`in_thread` has returned, at most ``timeout_s`` seconds (default
    :data:`EXIT_WAIT_S`); registered with :mod:`atexit` when this module is imported. Returns how many still
    run (they may abort the process at exit)."""
    timeout_s = EXIT_WAIT_S if timeout_s is None else timeout_s
    with _running_lock:
        pending = list(_running)
    if not pending:
        return 0
    logger.info("waiting up to %g s at exit for %d call(s) left running past their deadline", timeout_s,
                len(pending))
    _, not_done = concurrent.futures.wait(pending, timeout=timeout_s)
    return len(not_done)


def call_bounded(fn: Callable[[], T], timeout: timedelta, what: str) -> T:
    """``fn()`` run by :func:`in_thread`, waited for at most ``timeout``; ``fn`` must not mutate shared state.

    Raises:
        TimeoutError: ``fn`` did not return within ``timeout`` (the message names ``what``).
        Exception: whatever ``fn`` raised, with its traceback.
    """
    future = in_thread(fn, "ftbridge-bounded-call")
    done, _ = concurrent.futures.wait([future], timeout=timeout.total_seconds())
    if not done:
        raise TimeoutError(f"{what} did not answer within {timeout.total_seconds():g} s "
                           "(its host hung, or opening the connection stalled)")
    return future.result()


atexit.register(wait_at_exit)

__all__ = ["EXIT_WAIT_S", "call_bounded", "in_thread", "wait_at_exit"]
