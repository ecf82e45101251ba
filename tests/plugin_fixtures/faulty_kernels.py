"""A plugin with one planted mistake, for ``devshim compare``'s specs (``tests/test_compare_faults.py``).

It is another plugin (``FAULTY_BASE``: ``cpu_reference``, or ``ascend`` on the emulated npu) answering
every hook as that plugin does, except for the one kernel ``FAULTY_KERNEL`` names, which it gets wrong the
way real ports have:

- ``mask``: attention with the mask's polarity flipped (kept where it should be masked; causal looks ahead);
- ``scale``: attention with the softmax scale 1 instead of 1/sqrt(d);
- ``rotary``: rotary embedding applied with the two halves swapped;
- ``adamw``: fused AdamW without bias correction;
- ``allreduce``: ``torch.distributed.all_reduce`` that averages where it should sum;
- unset: no mistake (a clean run).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from devshim_core import DeviceReport, hookimpl
from devshim_core.patching import SetAttribute

FAULT = os.environ.get("FAULTY_KERNEL", "")
HOOKS = ("devshim_environment_map", "devshim_device_module", "devshim_device_traits", "devshim_collectives",
         "devshim_allocator", "devshim_offload_io", "devshim_runtime_versions")


def _base() -> Any:
    return importlib.import_module({"cpu_reference": "devshim_cpu_reference", "ascend": "devshim_ascend"}[
        os.environ.get("FAULTY_BASE", "cpu_reference")])


def _flipped_mask_attention(attention: Any) -> Any:
    def wrong(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        if kw.get("attn_mask") is not None and not kw["attn_mask"].is_floating_point():
            kw["attn_mask"] = ~kw["attn_mask"].bool()
        elif kw.get("causal"):  # the triangle the other way: each query sees the keys after it
            kw["causal"] = False
            layout = kw.get("layout", "BNSD")
            seq_q, seq_k = (q.shape[2], k.shape[2]) if layout == "BNSD" else (
                (q.shape[0], k.shape[0]) if layout == "SBH" else (q.shape[1], k.shape[1]))
            kw["attn_mask"] = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril(-1)
            kw["mask_true_means_masked"] = True
        return attention(q, k, v, **kw)
    return wrong


def _unscaled_attention(attention: Any) -> Any:
    def wrong(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        kw["scale"] = 1.0
        return attention(q, k, v, **kw)
    return wrong


def _swapped_rotary(rotary: Any) -> Any:
    def wrong(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **kw: Any) -> torch.Tensor:
        rot = cos.shape[-1]
        first, second = x[..., :rot // 2], x[..., rot // 2:rot]
        swapped = torch.cat((second, first, x[..., rot:]), dim=-1)
        return rotary(swapped, cos, sin, **kw)
    return wrong


def _without_bias_correction(fused_adamw: Any) -> Any:
    def wrong(*args: Any, **kw: Any) -> None:
        kw["bias_correction"] = False
        return fused_adamw(*args, **kw)
    return wrong


def _averaging_all_reduce(original: Any, device: Any) -> Any:
    def wrong(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        import torch.distributed as dist

        work = original(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group, async_op=async_op)
        if op in (None, dist.ReduceOp.SUM) and tensor.is_floating_point():
            if work is not None:
                work.wait()
            tensor.div_(dist.get_world_size(group))
        return work
    return wrong


class FaultyKernels:
    @hookimpl
    def devshim_detect(self) -> DeviceReport:
        report = _base().devshim_detect()
        return DeviceReport(available=report.available, device_type=report.device_type,
                            device_count=report.device_count, priority=report.priority,
                            reason=f"{report.reason}; with the planted mistake {FAULT or 'none'!r}")

    @hookimpl
    def devshim_attention_kernels(self, report: DeviceReport) -> Any:
        import dataclasses

        kernels = _base().devshim_attention_kernels(report)
        if FAULT == "mask":
            return dataclasses.replace(kernels, attention=_flipped_mask_attention(kernels.attention))
        if FAULT == "scale":
            return dataclasses.replace(kernels, attention=_unscaled_attention(kernels.attention))
        if FAULT == "rotary":
            return dataclasses.replace(kernels, rotary=_swapped_rotary(kernels.rotary))
        return kernels

    @hookimpl
    def devshim_optimizer_kernels(self, report: DeviceReport) -> Any:
        import dataclasses

        kernels = _base().devshim_optimizer_kernels(report)
        if FAULT == "adamw":
            return dataclasses.replace(kernels, fused_adamw=_without_bias_correction(kernels.fused_adamw))
        return kernels

    @hookimpl
    def devshim_patches(self, report: DeviceReport) -> list[Any]:
        base = getattr(_base(), "devshim_patches", None)
        patches = list(base(report) or []) if base is not None else []
        if FAULT == "allreduce":
            patches.append(SetAttribute("averaging-all-reduce", "torch.distributed:all_reduce", _averaging_all_reduce,
                                        "a planted mistake: all_reduce averages where it should sum"))
        return patches


def _delegate(hook: str) -> Any:
    def answer(self: FaultyKernels, report: DeviceReport) -> Any:
        found = getattr(_base(), hook, None)
        return None if found is None else found(report)
    answer.__name__ = hook
    return hookimpl(answer)


for _hook in HOOKS:
    setattr(FaultyKernels, _hook, _delegate(_hook))

faulty = FaultyKernels()
