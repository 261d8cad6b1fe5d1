"""Helper processes for benchmarks and tests: a peer driven over a pipe (:class:`SpawnedProcess`)
and a group of processes that report one result (:func:`first_result`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from typing import Any, Callable, Optional

__all__ = ["SpawnedProcess", "first_result"]


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


def first_result(targets: list[tuple[Callable[..., None], tuple]], timeout: float) -> Any:
    """Start one spawned process per ``(fn, args)`` target, run as ``fn(*args, queue)``, and return
    the payload of the first message on the shared queue.

    A target reports ``("ok", payload)`` or ``("error", text)`` (in a group of ranks typically
    rank 0 the gathered results, any rank its traceback). Raises RuntimeError with the text on an
    error, or when no message came within ``timeout`` seconds (a process hung or died). Every
    process is then joined, and killed if it has not ended 30 s later.
    """
    import torch.multiprocessing as torch_mp  # torch's queues also carry tensors in a payload

    ctx = torch_mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*args, q), daemon=True) for fn, args in targets]
    for p in procs:
        p.start()
    try:
        status, payload = q.get(timeout=timeout)
    except Exception:
        status, payload = "error", f"no result within {timeout:.0f}s (a process hung or died)"
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
    if status != "ok":
        raise RuntimeError(payload)
    return payload
