"""``MoriKVBootstrapServer``: the prefill's rank registry (SGLang's aiohttp server).

Adds to ``CommonKVBootstrapServer``: it waits (bounded) until the listener is up
and raises if it could not bind, instead of logging from its thread while the
server silently never serves; and ``port=0`` binds an OS-chosen port, published
as :attr:`port` (tests and several PD pairs on one host need no port guessing).
"""

from __future__ import annotations

import time

from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

STARTUP_TIMEOUT_S = 30.0


class MoriKVBootstrapServer(CommonKVBootstrapServer):
    """Bootstrap server that reports the port it actually bound."""

    def __init__(self, host: str, port: int) -> None:
        self._runner = None
        self._loop = None
        super().__init__(host, port)
        self.port = self._wait_bound_port(host, port)

    def _wait_bound_port(self, host: str, port: int) -> int:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            runner = self._runner
            addresses = list(getattr(runner, "addresses", None) or []) if runner is not None else []
            if addresses:
                return int(addresses[0][1])
            if not self.thread.is_alive():
                break
            time.sleep(0.01)
        raise RuntimeError(
            f"PD bootstrap server could not listen on {host}:{port} (port in use? use a distinct "
            "--disaggregation-bootstrap-port per PD pair on one host)"
        )
