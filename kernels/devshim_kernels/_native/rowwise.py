"""The ahead-of-time compiled row-wise fp32 kernels (``rowwise.c``): RMSNorm and SwiGLU, forward and backward.

Loaded with ctypes (which releases the GIL for each call). If the library was not built at install time,
``LIBRARY`` is ``None``, ``REASON`` says why, and ``devshim_kernels.norm`` / ``.glu`` run their torch-op versions.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from devshim_kernels._native import open_library, switched_off

ABI_VERSION = 1  # must equal DEVSHIM_ROWWISE_ABI in rowwise.c
# aten runs an elementwise op on one thread below this many elements (its grain size): a single-threaded kernel
# gives up nothing there, whatever torch's thread count
SINGLE_THREAD_NUMEL = 32768


def _load() -> tuple[ctypes.CDLL | None, str]:
    library, reason = open_library("_rowwise", "devshim_rowwise_abi_version", ABI_VERSION,
                                   "devshim's native row-wise kernels")
    if library is None:
        return None, reason
    pointer, count = ctypes.c_void_p, ctypes.c_int64
    library.devshim_rms_norm_forward.argtypes = [pointer] * 4 + [count, count, ctypes.c_double]
    library.devshim_rms_norm_backward.argtypes = [pointer] * 6 + [count, count]
    library.devshim_swiglu_forward.argtypes = [pointer, pointer, count, count]
    library.devshim_swiglu_backward.argtypes = [pointer, pointer, pointer, count, count]
    for name in ("devshim_rms_norm_forward", "devshim_rms_norm_backward", "devshim_swiglu_forward",
                 "devshim_swiglu_backward"):
        getattr(library, name).restype = None
    return library, ""


LIBRARY, REASON = _load()
_log = logging.getLogger("devshim.kernels")  # a child of devshim's logger: its handler and DEVSHIM_LOG_LEVEL apply


def serves(*tensors: torch.Tensor | None) -> bool:
    """Whether the native kernels compute these: host fp32 tensors, contiguous (``None`` entries are absent
    operands), in a process whose torch runs one thread or for a size torch would run on one thread anyway, and
    ``DEVSHIM_KERNELS_NATIVE`` does not turn them off."""
    present = [t for t in tensors if t is not None]
    served = (LIBRARY is not None and not switched_off()
              and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in present)
              and (torch.get_num_threads() == 1 or max(t.numel() for t in present) <= SINGLE_THREAD_NUMEL))
    if _log.isEnabledFor(logging.DEBUG):  # DEVSHIM_LOG_LEVEL=debug: every dispatch decision
        _log.debug("row-wise kernel for %s %s: %s", present[0].dtype if present else "-",
                   tuple(present[0].shape) if present else (), "native" if served else "PyTorch")
    return served


def address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()
