"""Adam/AdamW with ``torch.optim.AdamW``'s arithmetic: bias correction ``1 - beta**step``, decoupled decay.

``fused_adamw`` updates lists of device tensors; ``host_adam_step``/``host_adam_rollback`` serve
ZeRO-Offload's host optimizer (DeepSpeed's ``cpu_adam`` API). Both take amsgrad's running maximum
(``max_exp_avg_sq(s)``) and a low-precision copy of the params (``param_copy``/``param_copies``, bf16 or
fp16) that receives the updated params.

Two implementations, both within 1e-6 of ``torch.optim.AdamW``/``Adam`` over many steps:

- native: a C kernel compiled when devshim-kernels is installed (``devshim_kernels/_native/adam.c``), for
  contiguous CPU tensors: params fp32/bf16/fp16, grads fp32 or the param dtype, states fp32. It runs the
  operations of PyTorch's fused CPU kernel in its order, reads and writes every tensor once per step, the copy
  included (PyTorch makes a second pass over the fp32 params to write it), with AVX2/FMA/F16C (CPUs without
  them use PyTorch unless ``DEVSHIM_KERNELS_NATIVE=generic`` asks for the portable loop) on
  ``torch.get_num_threads()`` threads (torch's own OpenMP team when torch runs on OpenMP, else pthreads).
- torch: PyTorch's fused kernel where the dtypes allow it, else the update computed in fp32 and written back
  in the tensors' dtypes. Everything the native kernel does not cover runs here, and everything runs here
  with ``DEVSHIM_KERNELS_NATIVE=0``.

:func:`implementation` says which one runs.
"""

from __future__ import annotations

import math
import os
from array import array
from collections.abc import Sequence
from typing import TypedDict, cast

import torch

from devshim_kernels import _native

Tensor = torch.Tensor
# param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad), param copy
_Entry = tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None]


class _Hyper(TypedDict):
    """The keywords every update takes."""

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    bias_correction: bool


NATIVE_SWITCH = _native.NATIVE_SWITCH
# Elements per thread below which another thread costs about what it saves: a parallel region of torch's OpenMP
# team (already started) costs microseconds, like one of torch's own ops; starting a pthread, tens of them.
_MIN_ELEMENTS_PER_THREAD = {"torch's OpenMP threads": 1 << 15, "pthreads": 1 << 17, "no threads": 1 << 62}
_NATIVE_DTYPES = {torch.float32: _native.DT_F32, torch.bfloat16: _native.DT_BF16, torch.float16: _native.DT_F16}
_COPY_DTYPES = (torch.bfloat16, torch.float16)
_FUSABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _native_isa() -> int | None:
    """The native kernel variant to run, or ``None`` for the PyTorch implementation."""
    if _native.LIBRARY is None or _native.switched_off():
        return None
    if os.environ.get(NATIVE_SWITCH, "").strip().lower() == "generic":
        return _native.ISA_GENERIC
    # The portable loop is only on request: on x86 without AVX2 its fma is a call per element (3-4x slower than
    # PyTorch, measured), and elsewhere it has not been measured against PyTorch.
    return None if _native.BEST_ISA == _native.ISA_GENERIC else _native.BEST_ISA


def implementation() -> str:
    """Which implementation updates contiguous CPU tensors, e.g.
    ``"native (avx2+fma+f16c, 2 threads: torch's OpenMP threads)"`` or ``"torch (DEVSHIM_KERNELS_NATIVE=0)"``."""
    isa = _native_isa()
    if isa is not None:
        threads = 1 if _native.threads() == "no threads" else torch.get_num_threads()
        return f"native ({_native.ISA_NAMES[isa]}, {threads} thread{'' if threads == 1 else 's'}: {_native.threads()})"
    if _native.LIBRARY is None:
        return f"torch ({_native.REASON})"
    if _native.switched_off():
        return f"torch ({NATIVE_SWITCH}={os.environ[NATIVE_SWITCH]})"
    return (f"torch (the native kernel has no SIMD variant for this CPU; {NATIVE_SWITCH}=generic runs its "
            "slower portable loop)")


# -- argument handling ---------------------------------------------------------------------------------------------

def _entry(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, max_exp_avg_sq: Tensor | None,
           param_copy: Tensor | None, where: str) -> _Entry:
    """Check one tensor's arguments: every tensor the param's size, the copy bf16 or fp16."""
    n = param.numel()
    if (grad.numel() != n or exp_avg.numel() != n or exp_avg_sq.numel() != n
            or (max_exp_avg_sq is not None and max_exp_avg_sq.numel() != n)
            or (param_copy is not None and param_copy.numel() != n)):
        named = {"grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "max_exp_avg_sq": max_exp_avg_sq,
                 "param_copy": param_copy}
        name, tensor = next((k, t) for k, t in named.items() if t is not None and t.numel() != n)
        raise ValueError(f"{where}: {name} has {tensor.numel()} elements, the param {n}")
    if param_copy is not None and param_copy.dtype not in _COPY_DTYPES:
        raise TypeError(f"{where}: param_copy must be torch.bfloat16 or torch.float16, got {param_copy.dtype}")
    return param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_copy


def _same_shape(entry: _Entry, where: str) -> _Entry:
    """For PyTorch's elementwise ops: tensors of one size but different shapes are flattened (if contiguous)."""
    shape = entry[0].shape
    if all(t is None or t.shape == shape for t in entry):
        return entry
    try:
        # views of the six, None where there was None
        return cast(_Entry, tuple(None if t is None else t.view(-1) for t in entry))
    except RuntimeError as error:
        raise ValueError(f"{where}: tensors of different shapes must be contiguous to be updated as flat "
                         f"tensors ({error})") from None


def _corrections(step: int, beta1: float, beta2: float, bias_correction: bool) -> tuple[float, float]:
    if not bias_correction:
        return 1.0, 1.0
    return 1.0 - beta1**step, 1.0 - beta2**step  # in double, as torch.optim does


def _native_eligible(entry: _Entry) -> bool:
    """Contiguous CPU tensors (of any shapes: the kernel sees them flat) in dtypes the kernel has."""
    param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, _ = entry
    if (param.dtype not in _NATIVE_DTYPES or (grad.dtype is not param.dtype and grad.dtype is not torch.float32)
            or exp_avg.dtype is not torch.float32 or exp_avg_sq.dtype is not torch.float32
            or (max_exp_avg_sq is not None and max_exp_avg_sq.dtype is not torch.float32)):
        return False
    for t in entry:
        if t is not None and not (t.is_cpu and t.layout is torch.strided and t.is_contiguous()):
            return False
    return True


# -- native --------------------------------------------------------------------------------------------------------

def _native_update(entries: list[_Entry], isa: int, *, step: int, lr: float, beta1: float, beta2: float,
                   eps: float, weight_decay: float, adamw_mode: bool, bias_correction: bool) -> None:
    table = array("q")
    total = 0
    codes, none = _NATIVE_DTYPES, _native.DT_NONE
    for param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, copy in entries:
        n = param.numel()
        table.extend((n, param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                      0 if max_exp_avg_sq is None else max_exp_avg_sq.data_ptr(),
                      0 if copy is None else copy.data_ptr(), codes[param.dtype], codes[grad.dtype],
                      none if copy is None else codes[copy.dtype]))
        total += n
    threads = max(1, min(torch.get_num_threads(), total // _MIN_ELEMENTS_PER_THREAD[_native.threads()]))
    bc1, bc2 = _corrections(step, beta1, beta2, bias_correction)
    # ctypes releases the GIL for the call; the tensors stay referenced by `entries` until it returns
    _native.step(table, len(entries), lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                 bias_correction1=bc1, bias_correction2=bc2, adamw_mode=adamw_mode, num_threads=threads, isa=isa)


# -- torch ---------------------------------------------------------------------------------------------------------

def _fusable(entry: _Entry) -> bool:
    """PyTorch's fused kernel: one dtype for everything, and contiguous tensors (it indexes them as flat)."""
    tensors = [t for t in entry[:5] if t is not None]
    dtype, device = entry[0].dtype, entry[0].device
    return dtype in _FUSABLE_DTYPES and all(t.dtype == dtype and t.device == device and t.is_contiguous()
                                            for t in tensors)


def _fused(entries: list[_Entry], *, amsgrad: bool, step: int, lr: float, beta1: float, beta2: float, eps: float,
           weight_decay: float, adamw_mode: bool) -> None:
    # the maxima are tensors where amsgrad, and read only then
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs = (cast("list[Tensor]", [e[k] for e in entries])
                                                             for k in range(5))
    step_tensor = torch.tensor(float(step), dtype=torch.float32, device=params[0].device)
    kernel = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
    kernel(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [], [step_tensor] * len(params),
           lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=False)


def _as_fp32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _reference_step(entry: _Entry, *, step: int, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, adamw_mode: bool, bias_correction: bool) -> None:
    param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, _ = entry
    p, g, m, v = _as_fp32(param), _as_fp32(grad), _as_fp32(exp_avg), _as_fp32(exp_avg_sq)
    if weight_decay and not adamw_mode:
        g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bc1, bc2 = _corrections(step, beta1, beta2, bias_correction)
    if weight_decay and adamw_mode:
        p.mul_(1.0 - lr * weight_decay)
    written = [(param, p), (exp_avg, m), (exp_avg_sq, v)]
    second_moment = v
    if max_exp_avg_sq is not None:
        second_moment = _as_fp32(max_exp_avg_sq)
        torch.maximum(second_moment, v, out=second_moment)
        written.append((max_exp_avg_sq, second_moment))
    denom = (second_moment.sqrt() / math.sqrt(bc2)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bc1)
    for target, value in written:
        if target is not value:
            target.copy_(value)


def _torch_update(entries: list[_Entry], *, amsgrad: bool, step: int, lr: float, beta1: float, beta2: float,
                  eps: float, weight_decay: float, adamw_mode: bool, bias_correction: bool) -> None:
    groups: dict[tuple[torch.device, torch.dtype], list[_Entry]] = {}
    for entry in entries:
        if bias_correction and _fusable(entry):
            groups.setdefault((entry[0].device, entry[0].dtype), []).append(entry)
        else:
            _reference_step(entry, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                            adamw_mode=adamw_mode, bias_correction=bias_correction)
    for group in groups.values():
        _fused(group, amsgrad=amsgrad, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
               weight_decay=weight_decay, adamw_mode=adamw_mode)
    for param, *_, copy in entries:
        if copy is not None:
            copy.copy_(param)  # PyTorch's second pass over the params: what the native kernel saves


def _update(entries: list[_Entry], where: str, *, amsgrad: bool, step: int, lr: float, beta1: float, beta2: float,
            eps: float, weight_decay: float, adamw_mode: bool, bias_correction: bool) -> None:
    if step < 1:
        raise ValueError(f"step must be >= 1 (the number of this update), got {step}")
    hyper: _Hyper = {"step": step, "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay,
                     "adamw_mode": adamw_mode, "bias_correction": bias_correction}
    isa = _native_isa()
    native: list[_Entry] = []
    rest: list[tuple[int, _Entry]] = []
    for k, entry in enumerate(entries):
        if isa is not None and _native_eligible(entry):
            native.append(entry)
        else:
            rest.append((k, entry))
    if native:
        _native_update(native, cast(int, isa), **hyper)  # isa is not None: native holds entries only then
    if rest:
        flat = [_same_shape(entry, where.format(k)) for k, entry in rest]
        with torch.no_grad():  # an optimizer update, never part of a graph (params may be leaves)
            _torch_update(flat, amsgrad=amsgrad, **hyper)


# -- public API ----------------------------------------------------------------------------------------------------

def fused_adamw(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                exp_avg_sqs: Sequence[Tensor], *, step: int, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, adamw_mode: bool = True, bias_correction: bool = True,
                max_exp_avg_sqs: Sequence[Tensor] | None = None,
                param_copies: Sequence[Tensor | None] | None = None) -> None:
    """One Adam(W) step over lists of tensors, in place. ``step`` counts this update (1 for the first).

    ``max_exp_avg_sqs`` (one per param) turns on amsgrad; ``param_copies`` (bf16/fp16, ``None`` entries
    allowed) receive the updated params, rounded to nearest even."""
    count = len(params)
    maxima: list[Tensor | None] = [None] * count if max_exp_avg_sqs is None else list(max_exp_avg_sqs)
    copies: list[Tensor | None] = [None] * count if param_copies is None else list(param_copies)
    entries = [_entry(p, g, m, v, maximum, copy, f"fused_adamw tensor {k}") for k, (p, g, m, v, maximum, copy) in
               enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, maxima, copies, strict=True))]
    _update(entries, "fused_adamw tensor {}", amsgrad=max_exp_avg_sqs is not None, step=step, lr=lr, beta1=beta1,
            beta2=beta2, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=bias_correction)


def host_adam_step(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int, lr: float,
                   beta1: float, beta2: float, eps: float, weight_decay: float, adamw_mode: bool = True,
                   bias_correction: bool = True, max_exp_avg_sq: Tensor | None = None,
                   param_copy: Tensor | None = None) -> None:
    """One Adam(W) step on host tensors; params fp32/bf16/fp16, states fp32 or the param dtype.

    ``max_exp_avg_sq`` turns on amsgrad; ``param_copy`` (bf16/fp16, the param's size) receives the updated
    param in the same pass."""
    entry = _entry(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_copy, "host_adam_step")
    _update([entry], "host_adam_step", amsgrad=max_exp_avg_sq is not None, step=step, lr=lr, beta1=beta1,
            beta2=beta2, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=bias_correction)


@torch.no_grad()
def host_adam_rollback(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int, lr: float,
                       beta1: float, beta2: float, eps: float, weight_decay: float, adamw_mode: bool = True,
                       bias_correction: bool = True, max_exp_avg_sq: Tensor | None = None,
                       param_copy: Tensor | None = None) -> None:
    """Undo the update :func:`host_adam_step` made at ``step`` with the same gradient and hyperparameters.

    An amsgrad step cannot be undone (``max(old, v)`` forgets the old maximum): passing ``max_exp_avg_sq``
    raises ``ValueError``. ``param_copy`` is rewritten from the restored param."""
    if max_exp_avg_sq is not None:
        raise ValueError("host_adam_rollback: an amsgrad step cannot be undone, the running maximum "
                         "max(max_exp_avg_sq, exp_avg_sq) does not keep the value it replaced")
    entry = _entry(param, grad, exp_avg, exp_avg_sq, None, param_copy, "host_adam_rollback")
    param, grad, exp_avg, exp_avg_sq, _, param_copy = _same_shape(entry, "host_adam_rollback")
    p, g, m, v = _as_fp32(param), _as_fp32(grad), _as_fp32(exp_avg), _as_fp32(exp_avg_sq)
    bc1, bc2 = _corrections(step, beta1, beta2, bias_correction)
    denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
    p.addcdiv_(m, denom, value=lr / bc1)
    if weight_decay and adamw_mode:
        p.div_(1.0 - lr * weight_decay)
    if weight_decay and not adamw_mode:
        g = g.add(p, alpha=weight_decay)
    m.sub_(g, alpha=1.0 - beta1).div_(beta1)
    v.addcmul_(g, g, value=-(1.0 - beta2)).div_(beta2).clamp_(min=0.0)
    for target, value in ((param, p), (exp_avg, m), (exp_avg_sq, v)):
        if target is not value:
            target.copy_(value)
    if param_copy is not None:
        param_copy.copy_(param)
