"""Megatron's ``jit_fuser`` (``torch.compile``) on a device that torch's compiler cannot generate code for.

Inductor generates kernels for a handful of device types (cpu, cuda, xpu, mps); a PrivateUse1 device without an
inductor backend fails at the first call of a fused function (``InductorError: KeyError: 'npu'``). There the
fusions run eagerly: same numbers, no compile step. Applied the moment ``megatron.core.jit`` has executed, before
the fusion modules decorate their functions.
"""

from __future__ import annotations

import sys
from typing import Any

from devshim_core.device import Device
from devshim_core.integrations.megatron.flavor import MEGATRON_CORE
from devshim_core.patching import PatchSet, RebindReferences, SetAttribute

JIT = "megatron.core.jit"
_INDUCTOR_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps"})


def compiles_for(device_type: str) -> bool:
    """Whether torch.compile's default backend generates code for ``device_type``. Only inductor's own device
    types count: it also maps 'tpu' to a Pallas backend that needs JAX, which no devshim device has."""
    return device_type in _INDUCTOR_DEVICES


def _noop_decorator(func: Any) -> Any:
    return func


def _eager_fuser(original: Any, device: Device) -> Any:
    # Megatron's own no-op decorator where it has one (0.16); 0.12's jit module has none
    return getattr(sys.modules[JIT], "noop_decorator", _noop_decorator)


def _compiled_functions(device: Device) -> list[tuple[Any, Any]]:
    """(compiled wrapper, original function) for fusions Megatron decorated before devshim activated."""
    pairs = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("megatron."):
            continue
        for value in list(vars(module).values()):
            original = getattr(value, "_torchdynamo_orig_callable", None)
            if original is not None and callable(value):
                pairs.append((value, original))
    return pairs


def jit_patch_set(device: Device) -> PatchSet:
    return PatchSet(
        name="megatron-core-jit", requires=(MEGATRON_CORE,),
        reason=f"torch.compile cannot generate code for {device.type}: Megatron's fusions run eagerly",
        patches=(
            SetAttribute(name="eager-jit-fuser", target=f"{JIT}:jit_fuser", make=_eager_fuser,
                         reason=f"inductor has no code generator for {device.type}"),
            RebindReferences(name="uncompiled-fusions", scope="megatron", pairs=_compiled_functions,
                             reason="functions decorated with torch.compile before devshim activated"),
        ))
