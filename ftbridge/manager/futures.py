"""Calls that may block past their deadline (a TCPStore read, a lighthouse try, a status read) run in a
daemon thread while the caller waits on a future: :func:`in_thread`, :func:`call_bounded`. A call left
behind keeps running until its own I/O gives up and its result is dropped, so it must not change shared
state the caller has moved past.
"""

from __future__ import annotations

import concurrent.futures
import threading
from datetime import timedelta
from typing import Callable, TypeVar

T = TypeVar("T")


def in_thread(fn: Callable[[], T], name: str) -> "concurrent.futures.Future[T]":
    """Start ``fn()`` in a daemon thread named ``name``; the future ends with its result or exception (``BaseException``
    too). Never raises."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, re-raised there
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


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


__all__ = ["call_bounded", "in_thread"]
