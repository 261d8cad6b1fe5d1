"""Test-side handles of ``pd_host.py`` processes (each a fresh interpreter)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any, Dict, List, Optional

HOST_SCRIPT = Path(__file__).with_name("pd_host.py")
START_TIMEOUT_S = 180.0  # importing sglang takes ~10 s of CPU per process
CALL_TIMEOUT_S = 60.0

# Small timeouts so failure paths finish in seconds; every wait stays bounded.
BASE_ENV = {
    "SGLANG_HOST_IP": "127.0.0.1",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30",
    "SGLANG_MORI_TRANSFER_SHARDS": "2",
    "TORCHVISION_WARN_WHEN_EXTENSION_LOADING_FAILS": "",
    "PYTHONWARNINGS": "ignore",
}


class HostError(RuntimeError):
    pass


class Host:
    """One ``pd_host.py`` process; ``call`` runs a command there (bounded)."""

    def __init__(self, name: str, log_dir: Path, env: Optional[Dict[str, str]] = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._key = secrets.token_hex(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=self._key.encode())
        full_env = {**os.environ, **BASE_ENV, **(env or {})}
        full_env["PD_HOST_ADDR"] = "%s:%d" % self._listener.address
        full_env["PD_HOST_KEY"] = self._key
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(HOST_SCRIPT)], env=full_env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.conn = None

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        box: List[Any] = []
        t = threading.Thread(target=lambda: box.append(self._listener.accept()), daemon=True)
        t.start()
        t.join(timeout)
        if not box:
            self.kill()
            raise HostError(f"host {self.name} did not start within {timeout:.0f}s:\n{self.log()[-4000:]}")
        self.conn = box[0]
        if not self.conn.poll(timeout):
            raise HostError(f"host {self.name} never reported ready:\n{self.log()[-4000:]}")
        self.conn.recv()

    def call(self, cmd: str, timeout: float = CALL_TIMEOUT_S, **kwargs: Any) -> Any:
        self.conn.send((cmd, kwargs))
        if not self.conn.poll(timeout):
            raise HostError(f"{self.name}.{cmd} did not answer within {timeout:.0f}s:\n{self.log()[-4000:]}")
        kind, value = self.conn.recv()
        if kind != "ok":
            raise HostError(f"{self.name}.{cmd} failed:\n{value}")
        return value

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.conn is not None and self.proc.poll() is None:
            try:
                self.call("exit", timeout=10)
            except Exception:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        self._listener.close()
        self._log.close()


def start_hosts(names: List[str], log_dir: Path, env: Optional[Dict[str, str]] = None) -> Dict[str, Host]:
    """Start several hosts at once (their imports overlap) and wait until all are ready."""
    hosts = {n: Host(n, log_dir, env) for n in names}
    try:
        for h in hosts.values():
            h.wait_ready()
    except Exception:
        for h in hosts.values():
            h.close()
        raise
    return hosts
