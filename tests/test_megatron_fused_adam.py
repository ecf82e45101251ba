"""Spec: Megatron's optimizer='adam' gets the FusedAdam it takes from TransformerEngine or apex on CUDA, running the
plugin's ``fused_adamw`` kernel; in every other respect it is ``torch.optim.Adam``, so it computes what torch's
AdamW (or Adam with L2, ``adam_w_mode=False``) computes and its state dict is torch's.

In-process on the cpu_reference device, its optimizer kernel wrapped in a counter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from devshim_core.device import Device, build_device
from devshim_core.errors import ConfigError
from devshim_core.integrations.megatron.fused_adam import device_fused_adam, optimizer_patches
from devshim_core.plugins import discover
from devshim_core.selection import select
from devshim_core.settings import Settings

SHAPES = ((7, 13), (129,), (3, 5, 11), (1,))  # odd sizes: the kernel's vector bodies and their tails
STEPS = 12
# The kernel and torch's per-parameter loop round the same formula in a different order: fp32, after 12 steps
RTOL, ATOL = 1e-6, 1e-7
KERNEL_CALLS: list[dict[str, Any]] = []


def _cpu_reference() -> Device:
    settings = Settings(forced="cpu_reference")
    registry = discover(settings)
    return build_device(registry, select(registry, settings))


def counting(base: Device, fused_adamw: Any = "counted") -> Device:
    kernel = base.optimizer.fused_adamw

    def counted(*args: Any, **kwargs: Any) -> None:
        KERNEL_CALLS.append({"tensors": len(args[0]), **kwargs})
        kernel(*args, **kwargs)

    optimizer = dataclasses.replace(base.optimizer, fused_adamw=counted if fused_adamw == "counted" else fused_adamw)
    return Device(base.info, base.module, base.traits, base.collectives, base.allocator, optimizer, base.attention,
                  base.offload_io, base.patches)


BASE = _cpu_reference()
FusedAdam = device_fused_adam(counting(BASE))


@pytest.fixture(autouse=True)
def no_calls_yet() -> Iterator[None]:
    KERNEL_CALLS.clear()
    yield


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def groups(ps: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    """Two groups with their own options, as Megatron's (decay / no decay, scaled lr)."""
    return [{"params": ps[:2], "lr": 3e-3, "weight_decay": 0.1}, {"params": ps[2:], "lr": 1e-3, "weight_decay": 0.0}]


def train(optimizer: torch.optim.Optimizer, ps: list[torch.nn.Parameter], steps: int = STEPS, first: int = 0) -> None:
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(100 + step)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=generator)
        ps[3].grad = None if step % 3 == 1 else ps[3].grad  # a parameter without a gradient is skipped
        optimizer.step()


def assert_same_training(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer, a: list, b: list) -> None:
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[p][key], theirs.state[q][key], rtol=RTOL, atol=ATOL)
        assert torch.equal(ours.state[p]["step"], theirs.state[q]["step"])


@pytest.mark.parametrize(("adam_w_mode", "torch_class"), [(True, torch.optim.AdamW), (False, torch.optim.Adam)],
                         ids=["adamw", "adam-l2"])
def test_each_step_is_torchs_step_computed_by_the_devices_kernel(adam_w_mode, torch_class):
    ours, theirs = params(), params()
    fused = FusedAdam(groups(ours), betas=(0.8, 0.95), eps=1e-6, adam_w_mode=adam_w_mode)
    reference = torch_class(groups(theirs), betas=(0.8, 0.95), eps=1e-6)
    train(fused, ours)
    train(reference, theirs)
    assert_same_training(fused, reference, ours, theirs)
    assert isinstance(fused, torch.optim.Adam)  # what Megatron's distributed optimizer accepts
    # every update of every parameter went through the kernel (a parameter's step counts its updates): no torch
    # fallback ran; the parameter that skips steps falls behind its group-mate and gets its own calls
    assert sum(call["tensors"] for call in KERNEL_CALLS) == sum(int(fused.state[p]["step"]) for p in ours) == 44
    assert {call["adamw_mode"] for call in KERNEL_CALLS} == {adam_w_mode}
    assert {(call["lr"], call["weight_decay"]) for call in KERNEL_CALLS} == {(3e-3, 0.1), (1e-3, 0.0)}


def test_its_state_dict_is_torchs_and_loads_either_way():
    ours, theirs = params(), params()
    fused, reference = FusedAdam(groups(ours)), torch.optim.AdamW(groups(theirs))
    train(fused, ours, steps=3)
    train(reference, theirs, steps=3)
    mine, torchs = fused.state_dict(), reference.state_dict()
    assert mine["state"].keys() == torchs["state"].keys()
    for index, state in mine["state"].items():
        assert {k: (v.dtype, v.shape) for k, v in state.items()} == {
            k: (v.dtype, v.shape) for k, v in torchs["state"][index].items()}
    # swap the optimizers' checkpoints: each goes on as the other would have
    swapped_ours, swapped_theirs = params(), params()
    for src, dst in ((ours, swapped_ours), (theirs, swapped_theirs)):
        with torch.no_grad():
            for s, d in zip(src, dst, strict=True):
                d.copy_(s)
    resumed_fused, resumed_torch = FusedAdam(groups(swapped_theirs)), torch.optim.AdamW(groups(swapped_ours))
    resumed_fused.load_state_dict(torchs)
    resumed_torch.load_state_dict(mine)
    train(resumed_fused, swapped_theirs, steps=4, first=3)
    train(resumed_torch, swapped_ours, steps=4, first=3)
    assert_same_training(resumed_fused, resumed_torch, swapped_theirs, swapped_ours)


def test_parameters_at_different_steps_are_corrected_for_their_own():
    """A checkpoint can hold per-parameter steps (devshim's distributed-optimizer-step-per-param patch keeps them):
    each parameter's bias correction uses its own."""
    ours, theirs = params(), params()
    fused, reference = FusedAdam(ours, weight_decay=0.01), torch.optim.AdamW(theirs, weight_decay=0.01)
    train(fused, ours, steps=2)
    train(reference, theirs, steps=2)
    for optimizer, p in ((fused, ours[0]), (reference, theirs[0])):
        optimizer.state[p]["step"] = torch.tensor(40.0)
    KERNEL_CALLS.clear()
    train(fused, ours, steps=1, first=2)
    train(reference, theirs, steps=1, first=2)
    assert_same_training(fused, reference, ours, theirs)
    assert sorted(call["step"] for call in KERNEL_CALLS) == [2, 3, 41]  # ps[3] skipped one step; ps[0] loaded 40


@pytest.mark.parametrize("option", [{"amsgrad": True}, {"maximize": True}, {"lr": torch.tensor(2e-3)}],
                         ids=["amsgrad", "maximize", "tensor-lr"])
def test_what_the_kernel_does_not_serve_runs_torchs_own_step(option):
    ours, theirs = params(), params()
    fused, reference = FusedAdam(ours, **option), torch.optim.Adam(theirs, decoupled_weight_decay=True,
                                                                    **option)
    train(fused, ours, steps=4)
    train(reference, theirs, steps=4)
    assert KERNEL_CALLS == []
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)  # the same code ran


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16}, "use_precision_aware_optimizer"),
    ({"master_weights": True}, "use_precision_aware_optimizer"),
    ({"bias_correction": False}, "bias_correction=False"),
])
def test_te_and_apex_options_it_cannot_serve_are_refused_by_name(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        FusedAdam(params(), **kwargs)


def test_a_plugin_without_the_kernel_leaves_megatron_torchs_adamw():
    without = counting(BASE, fused_adamw=None)
    assert device_fused_adam(without) is None
    assert optimizer_patches(without) == []


def test_a_torch_whose_adam_has_no_adamw_mode_leaves_megatron_torchs_adamw(monkeypatch):
    from devshim_core.integrations.megatron import fused_adam

    assert fused_adam.TORCH_ADAM_DECOUPLES  # torch 2.13, which CI runs
    assert optimizer_patches(BASE) != []
    monkeypatch.setattr(fused_adam, "TORCH_ADAM_DECOUPLES", False)  # torch < 2.7
    assert optimizer_patches(BASE) == []


megatron_optimizer = pytest.importorskip("megatron.core.optimizer", reason="the fused Adam is Megatron's")


def test_megatron_builds_it_for_optimizer_adam_and_gets_torchs_adamw_back_on_revert():
    from devshim_core.patching import REGISTRY, PatchSet

    device = counting(BASE)
    # without TE or apex, Megatron's torch fallback; or devshim's, if a session in this process patched Megatron
    before = (megatron_optimizer.Adam, megatron_optimizer.USING_PYTORCH_OPTIMIZER)
    name = "megatron-fused-adam-under-test"
    REGISTRY.apply(PatchSet(name=name, requires=(), patches=tuple(optimizer_patches(device)),
                            reason="what devshim's Megatron integration applies"), device)
    try:
        assert megatron_optimizer.USING_PYTORCH_OPTIMIZER is False  # Megatron takes its TE/apex branch ...
        adam = megatron_optimizer.Adam
        assert adam.__module__ == "devshim_core.integrations.megatron.fused_adam"
        # ... and passes apex's adam_w_mode from decoupled_weight_decay
        ps = params()
        built = adam(params=ps, lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8, adam_w_mode=False)
        assert built.param_groups[0]["decoupled_weight_decay"] is False
        train(built, ps, steps=1)
    finally:
        REGISTRY.revert(name)
    assert (megatron_optimizer.Adam, megatron_optimizer.USING_PYTORCH_OPTIMIZER) == before
