"""Short sleeps that stay short: a thread's timer slack.

Linux lets a sleep of a thread overrun by its timer slack, 50 us by default. A thread that
polls something every ~20 us between sleeps (a doorbell, a socket) would oversleep each time.
"""

from __future__ import annotations

import ctypes
import threading

__all__ = ["short_timer_slack"]

_PR_SET_TIMERSLACK = 29
_slack = threading.local()


def short_timer_slack() -> None:
    """Let this thread's short sleeps be short (1 us timer slack instead of Linux's 50 us default).

    A thread that polls between sleeps of tens of microseconds would otherwise
    oversleep each by up to 50 us. Once per thread; a no-op where prctl is unavailable.
    """
    if getattr(_slack, "set", False):
        return
    _slack.set = True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(1000), 0, 0, 0)
    except (OSError, AttributeError):
        pass
