"""Routing handle of one EPv2 dispatch (MORI's ``EpDispatchRoutingHandle``).

MORI's handle carries the kernels' slot maps so a later combine (or a replayed dispatch) can use
them. Here the engine keeps the slot maps of its latest dispatch on the device, so the handle
carries what combine needs from the caller's side: this rank's routing (``indices``), its token
count, the received-row count, and which dispatch of the op it belongs to. A handle of an older
dispatch is refused by combine (the engine no longer holds its slot maps).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


class EpDispatchRoutingHandle:
    """What one dispatch leaves for its combine.

    Attributes (MORI's names):
        disp_dest_tok_id_map: this rank's ``[num_tokens, topk]`` int32 routing given to dispatch.
        inter_node_disp_dest_tok_id_map, inter_node_disp_send_map: empty (MORI's inter-node slot
            maps; the engine keeps its own).
        total_recv_token_num: int32 ``[1]`` rows received by the dispatch (device tensor).
        disp_tok_id_to_src_tok_id_local: int32 ``[total_recv]`` flat source index per received
            row (``src_rank * world_size * max_tokens + src_token``), built on first access
            (it synchronises the host).
        cur_rank_num_token: tokens this rank dispatched.
    """

    def __init__(
        self,
        disp_dest_tok_id_map: torch.Tensor,
        inter_node_disp_dest_tok_id_map: torch.Tensor,
        inter_node_disp_send_map: torch.Tensor,
        total_recv_token_num: torch.Tensor,
        disp_tok_id_to_src_tok_id_local: Optional[torch.Tensor] = None,
        cur_rank_num_token: int = 0,
        *,
        sequence: int = -1,
        reverse_map: Optional[Callable[[], torch.Tensor]] = None,
    ) -> None:
        self.disp_dest_tok_id_map = disp_dest_tok_id_map
        self.inter_node_disp_dest_tok_id_map = inter_node_disp_dest_tok_id_map
        self.inter_node_disp_send_map = inter_node_disp_send_map
        self.total_recv_token_num = total_recv_token_num
        self.cur_rank_num_token = int(cur_rank_num_token)
        self.sequence = sequence  # which dispatch of its op produced it (-1: rebuilt from tensors)
        self._reverse = disp_tok_id_to_src_tok_id_local
        self._reverse_map = reverse_map

    @property
    def disp_tok_id_to_src_tok_id_local(self) -> Optional[torch.Tensor]:
        if self._reverse is None and self._reverse_map is not None:
            self._reverse = self._reverse_map()
        return self._reverse

    def tensors(self) -> tuple:
        """The five tensors in MORI's order."""
        return (
            self.disp_dest_tok_id_map,
            self.inter_node_disp_dest_tok_id_map,
            self.inter_node_disp_send_map,
            self.total_recv_token_num,
            self.disp_tok_id_to_src_tok_id_local,
        )

    @classmethod
    def from_tensors(cls, tensors: tuple, cur_rank_num_token: int = 0) -> "EpDispatchRoutingHandle":
        """Rebuild a handle from :meth:`tensors` (combine accepts it for the op's latest dispatch)."""
        return cls(*tensors, cur_rank_num_token=cur_rank_num_token)
