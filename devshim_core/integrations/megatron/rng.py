"""Megatron's tensor-parallel RNG state helpers, on the plugin's generators.

``_set_cuda_rng_state`` queues its work with ``torch.cuda._lazy_call``, which on a torch without CUDA never
runs: ``fork()`` would silently never restore the state (the CUDA redirect makes ``_lazy_call`` run at once;
these replacements do not depend on it). The CUDA-graph-safe variants cannot be served.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from devshim_core.device import Device
from devshim_core.errors import ConfigError


def _index(device: Device, spec: Any) -> int:
    if spec is None or spec == -1:
        return device.current_device()
    if isinstance(spec, int):
        return spec
    spec = torch.device(spec)
    return device.current_device() if spec.index is None else spec.index


def _refuse_graph_safe() -> None:
    raise ConfigError("Megatron asked for a CUDA-graph-safe RNG state (use_cudagraphable_rng / CUDA graphs), which "
                      "no devshim device serves: turn off use_cudagraphable_rng and CUDA graphs.")


# the replacements keep Megatron's parameter names (``device``), so the facade is called ``facade`` here
def get_state(original: Callable[..., Any], facade: Device) -> Callable[..., Any]:
    def _get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        if graph_safe:
            _refuse_graph_safe()
        state = facade.get_rng_state(facade.torch_device(_index(facade, device)))
        return state.clone() if clone else state

    _get_cuda_rng_state.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return _get_cuda_rng_state


def set_state(original: Callable[..., Any], facade: Device) -> Callable[..., Any]:
    def _set_cuda_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        if graph_safe:
            _refuse_graph_safe()
        facade.set_rng_state(new_state, facade.torch_device(_index(facade, device)))

    _set_cuda_rng_state.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return _set_cuda_rng_state
