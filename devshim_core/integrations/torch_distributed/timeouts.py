"""A collective that times out says which collective it was, on which rank, and how to change the timeout.

When one rank never reaches a collective, the others fail after the process group's timeout with the
backend's words only: gloo says "Timed out waiting 5000ms for recv operation to complete", naming neither the
collective nor the group. These wrappers re-raise such an error as the same exception type, with the
collective's name, this rank, the group's size and how a DeepSpeed user sets the timeout; the backend's
message follows, and the original exception is chained. Anything that is not a timeout passes through
untouched, and a call that does not fail costs one Python frame. A collective built on another
(``all_gather_object`` on ``all_gather``) is named by the outer one, the one the caller made.

Only calls through the module attributes are named (``torch.distributed.all_reduce``, as DeepSpeed's and
Megatron's communication layers call them); a function copied with ``from torch.distributed import
all_reduce`` before devshim activated keeps the backend's message. An ``async_op=True`` collective fails in
``Work.wait()``, outside these wrappers, with the backend's message.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from devshim_core.device import Device
from devshim_core.integrations.torch_distributed import TORCH
from devshim_core.patching import PatchSet, SetAttributes

# the blocking collectives and point-to-point calls of torch.distributed a training job makes
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
               "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object",
               "monitored_barrier", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
               "scatter_object_list", "send")
HOW_TO_SET = ("Every rank must reach the same collectives in the same order; a rank that crashed, hung or took "
              "another branch leaves the others waiting until the timeout. Set it with "
              "deepspeed.init_distributed(timeout=datetime.timedelta(minutes=N)), DeepSpeed's DEEPSPEED_TIMEOUT "
              "variable (minutes) or torch.distributed.init_process_group(timeout=...)")


def is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _where(group: Any) -> str:
    import torch.distributed as dist

    try:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
    except Exception:  # the group is gone or was never ours: say what is still known
        return f"rank {dist.get_rank() if dist.is_initialized() else '?'}"
    whole = size == dist.get_world_size()
    return f"rank {rank} of {'the' if whole else 'a'} {size}-rank {'world' if whole else 'group'}"


def named(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``original``, with a timeout re-raised naming the collective (same exception type, original chained)."""

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except RuntimeError as exc:
            if not is_timeout(exc):
                raise
            # named already by a collective inside
            backend: RuntimeError = getattr(exc, "__devshim_backend_error__", exc)
            named_exc = type(backend)(f"torch.distributed.{name} timed out on {_where(kwargs.get('group'))}: a "
                                      f"rank did not reach this {name}. {HOW_TO_SET}. The backend said: {backend}")
            named_exc.__devshim_backend_error__ = backend  # type: ignore[attr-defined]  # devshim's marker, read above
            raise named_exc from backend

    collective.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return collective


def _wrapped(originals: dict[str, Any], device: Device) -> dict[str, Any]:
    return {name: named(fn, name) for name, fn in originals.items() if fn is not None}


def patch_set(device: Device) -> PatchSet:
    return PatchSet(
        name="torch.distributed-timeouts",
        requires=(TORCH,),
        reason="a collective that times out names itself, the rank and how to set the timeout",
        patches=(
            SetAttributes(name="named-collectives", target="torch.distributed.distributed_c10d", names=COLLECTIVES,
                          make=_wrapped, reason="the backend's timeout message names no collective"),
            SetAttributes(name="named-collectives-reexport", target="torch.distributed", names=COLLECTIVES,
                          make=_wrapped, reason="torch.distributed re-exports them; frameworks call those names"),
        ),
    )
