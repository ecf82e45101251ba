"""The world the in-process Megatron specs run in: devshim on cpu_reference (Megatron's integration off: each spec
applies the patches it is about), a one-rank gloo group and Megatron's model-parallel state (TP = PP = EP = 1)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from devshim_core import session
from devshim_core.device import Device
from devshim_core.patching import REGISTRY, PatchSet
from devshim_core.testing.launch import free_port


@contextlib.contextmanager
def one_rank_megatron() -> Iterator[pytest.MonkeyPatch]:
    """Yields a MonkeyPatch undone on exit; afterwards the process's own session (if any) is active again."""
    from megatron.core import parallel_state

    had_session = session.current() is not None
    session.deactivate()
    session.activate({"DEVSHIM_PLUGIN": "cpu_reference", "DEVSHIM_PATCH_MEGATRON": "0"})
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    # Megatron's jit_fuser is torch.compile: compiling its own SwiGLU/RoPE helpers takes longer than a whole module
    # and is not under test (the specs run them eagerly). dynamo's own patch restores the setting; a MonkeyPatch of
    # that config module deleted it when undone, and later modules in the process failed reading it
    with pytest.MonkeyPatch.context() as mp, torch._dynamo.config.patch(disable=True):
        parallel_state.initialize_model_parallel(1, 1)
        try:
            yield mp
        finally:
            parallel_state.destroy_model_parallel()
            if own_group:
                dist.destroy_process_group()
            session.deactivate()
            if had_session:
                session.activate()


@contextlib.contextmanager
def fused_patches_applied(device: Device) -> Iterator[None]:
    """devshim's Megatron fused-path patches for ``device``, applied as its Megatron integration applies them."""
    from devshim_core.integrations.megatron.fused_ops import fused_patches

    name = "megatron-fused-under-test"
    REGISTRY.apply(PatchSet(name=name, requires=(), patches=fused_patches(device),
                            reason="what devshim's Megatron integration applies"), device)
    try:
        yield
    finally:
        REGISTRY.revert(name)
