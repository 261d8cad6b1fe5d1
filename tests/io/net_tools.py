"""Man-in-the-middle tools of the IO tests (they live in mori_core.bench.netsim, shared with the chaos harness)."""

from mori_core.bench.netsim import HandshakeRelay, Proxy, desc_at  # noqa: F401
