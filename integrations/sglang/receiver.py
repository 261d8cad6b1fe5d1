"""``MoriKVReceiver``: one per request on a decode rank.

SGLang's ``CommonKVReceiver`` already implements the whole decode-side lifecycle
on the manager's hooks (registration / metadata messages, rank mapping, waiting
timeout, ABORT with deferred-release generation); nothing is added here. The
class exists so that ``get_kv_class(MORI, RECEIVER)`` names mori-suite's type.
"""

from __future__ import annotations

from sglang.srt.disaggregation.common.conn import CommonKVReceiver


class MoriKVReceiver(CommonKVReceiver):
    """Decode-side request handle (see module docstring)."""
