"""``MoriKVSender``: one per request on a prefill rank (SGLang's ``CommonKVSender`` lifecycle)."""

from __future__ import annotations

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVSender

from mori_integrations.sglang.manager import MoriKVManager

PREFILL_ABORT_REASON = "Aborted on the prefill side (AbortReq)"


class MoriKVSender(CommonKVSender):
    """Adds to SGLang's sender: fail at once for a room decode already gave up on, and tell
    decode when prefill aborts (SGLang's Common sender only marks the room locally)."""

    kv_mgr: MoriKVManager

    def __init__(
        self,
        mgr: MoriKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        reason = mgr.take_early_failure(bootstrap_room)
        if reason is not None and self.conclude_state is None:
            mgr.record_failure(bootstrap_room, reason)
            mgr.update_status(bootstrap_room, KVPoll.Failed)

    def abort(self) -> None:
        """Mark the room failed here and report it to its decode ranks."""
        super().abort()
        self.kv_mgr.notify_prefill_abort(self.bootstrap_room, PREFILL_ABORT_REASON)

    def clear(self) -> None:
        # Serialised with the workers' outstanding-write accounting, so an ABORT_ACK
        # armed for this room is sent exactly once, after its writes stopped.
        with self.kv_mgr._abort_ack_lock:
            super().clear()
