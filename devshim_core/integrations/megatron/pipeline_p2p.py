"""Pipeline point-to-point transfers tagged by direction.

Megatron batches a stage's four transfers (activation to the next stage, gradient to the previous one, and
the two receives) into one ``batch_isend_irecv``, all with tag 0. With two pipeline ranks the previous and
the next stage are the same rank, and backends that match messages by (peer, tag) in posting order -- gloo,
and every devshim backend staged through it -- pair the activation with the gradient slot: same shape, no
error, wrong numbers (interleaved PP 2 trains a different model). NCCL ignores tags; a tag per direction
makes the pairing exact on every backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

FORWARD_TAG = 1  # activations, stage i -> i + 1
BACKWARD_TAG = 2  # gradients, stage i -> i - 1


def batched_p2p_ops(original: Callable[..., Any], device: Any) -> Callable[..., Any]:
    def _batched_p2p_ops(*, tensor_send_prev: torch.Tensor | None, tensor_recv_prev: torch.Tensor | None,
                         tensor_send_next: torch.Tensor | None, tensor_recv_next: torch.Tensor | None,
                         group: Any, prev_pipeline_rank: int, next_pipeline_rank: int) -> list[Any]:
        dist = torch.distributed
        planned = ((tensor_send_prev, dist.isend, prev_pipeline_rank, BACKWARD_TAG),
                   (tensor_recv_prev, dist.irecv, prev_pipeline_rank, FORWARD_TAG),
                   (tensor_send_next, dist.isend, next_pipeline_rank, FORWARD_TAG),
                   (tensor_recv_next, dist.irecv, next_pipeline_rank, BACKWARD_TAG))
        ops = [dist.P2POp(op, tensor, peer, group, tag) for tensor, op, peer, tag in planned if tensor is not None]
        return dist.batch_isend_irecv(ops) if ops else []

    _batched_p2p_ops.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return _batched_p2p_ops
