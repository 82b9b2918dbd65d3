"""Calls that may block past their deadline: each runs in a daemon thread, and the caller waits on a future.

The manager makes several calls that a hung peer or lighthouse can hold forever (a TCPStore read, a
lighthouse try, a status read): the caller must go on by its deadline while the call is left running.
:func:`in_thread` runs one and hands back a :class:`concurrent.futures.Future`; :func:`call_bounded`
waits for it with a deadline. A call left behind keeps running until its own I/O gives up, and its
result is dropped: such a call must not change shared state the caller has moved past.
"""

from __future__ import annotations

import concurrent.futures
import threading
from datetime import timedelta
from typing import Callable, TypeVar

T = TypeVar("T")


def in_thread(fn: Callable[[], T], name: str) -> "concurrent.futures.Future[T]":
    """Start ``fn()`` in a daemon thread named ``name``; the future ends with its result or exception.

    Never raises: whatever ``fn`` raises (``BaseException`` too) is set on the future, with its traceback.
    """
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, re-raised there
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def call_bounded(fn: Callable[[], T], timeout: timedelta, what: str) -> T:
    """Run ``fn()`` in a daemon thread (:func:`in_thread`) and wait at most ``timeout`` for it.

    Args:
        fn: the call; it must not mutate shared state (if it overruns, it keeps
            running until its own I/O gives up, and its result is dropped).
        timeout: the deadline.
        what: what was called, for the error message.

    Returns:
        ``fn()``'s result.

    Raises:
        TimeoutError: ``fn`` did not return within ``timeout``.
        Exception: whatever ``fn`` raised, re-raised with its traceback.
    """
    future = in_thread(fn, "ftbridge-bounded-call")
    done, _ = concurrent.futures.wait([future], timeout=timeout.total_seconds())
    if not done:
        raise TimeoutError(f"{what} did not answer within {timeout.total_seconds():g} s (its host hung?)")
    return future.result()


__all__ = ["call_bounded", "in_thread"]
