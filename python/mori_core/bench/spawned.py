"""A helper process driven over a pipe (benchmarks and tests that need a peer in another process)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from typing import Any, Callable, Optional

__all__ = ["SpawnedProcess"]


class SpawnedProcess:
    """A process started with multiprocessing's ``spawn``, driven by ``(command, argument)`` pairs.

    ``serve(pipe, *args)`` sends one hello message first (kept as :attr:`hello`; an
    Exception instead aborts the start), then one reply per command; a reply that is an
    Exception is raised by :meth:`call`. Command ``"stop"`` ends the serve loop. Every wait
    is bounded.
    """

    def __init__(self, serve: Callable[..., None], args: tuple, start_timeout: float, call_timeout: float) -> None:
        ctx = mp.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self._call_timeout = call_timeout
        self.proc = ctx.Process(target=serve, args=(child, *args), daemon=True)
        self.proc.start()
        if not self._pipe.poll(start_timeout):
            self.kill()
            raise RuntimeError(f"helper process did not start within {start_timeout} s")
        self.hello = self._pipe.recv()
        if isinstance(self.hello, Exception):
            self.kill()
            raise self.hello

    def call(self, cmd: str, arg: Any = None, timeout: Optional[float] = None) -> Any:
        self.send(cmd, arg)
        return self.result(timeout, cmd)

    def send(self, cmd: str, arg: Any = None) -> None:
        """Start a command without waiting; collect its reply with :meth:`result`."""
        self._pipe.send((cmd, arg))

    def result(self, timeout: Optional[float] = None, cmd: str = "the last command") -> Any:
        """The reply to the command started last (raised if it is an Exception)."""
        if not self._pipe.poll(self._call_timeout if timeout is None else timeout):
            raise TimeoutError(f"helper process did not answer {cmd}")
        reply = self._pipe.recv()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=20)
            except Exception:
                pass
        self.kill()
