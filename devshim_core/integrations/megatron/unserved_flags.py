"""Megatron flags no devshim device can serve: refused when the config is built, naming the flag.

Each needs TransformerEngine, CUDA graphs or a CUDA-only library. Megatron would otherwise fail later with an
error about a missing module, or (for some) silently take a path that computes something else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devshim_core.errors import ConfigError

_TE = "it needs TransformerEngine, which is CUDA-only"
_GRAPHS = "CUDA graphs have no equivalent on other devices"

# field -> (is it set?, why it cannot be served)
UNSERVED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "fp8": (lambda v: v is not None, _TE),
    "fp8_param": (bool, _TE),
    "fp4": (lambda v: v is not None, _TE),
    "use_te_rng_tracker": (bool, _TE),
    "use_te_activation_func": (bool, _TE),
    "tp_comm_overlap": (bool, "it overlaps TP communication with GEMMs through TransformerEngine's userbuffers"),
    "moe_grouped_gemm": (bool, "the grouped GEMM kernels are CUDA-only (TransformerEngine or grouped_gemm)"),
    "moe_permute_fusion": (bool, _TE),
    "fused_single_qkv_rope": (bool, _TE),
    "cross_entropy_fusion_impl": (lambda v: v == "te", _TE),
    "enable_cuda_graph": (bool, _GRAPHS),
    "external_cuda_graph": (bool, _GRAPHS),
    "cuda_graph_impl": (lambda v: v not in (None, "none"), _GRAPHS),
}


def refuse_unserved(config: Any, device_type: str) -> None:
    """Raise a ConfigError naming every flag of ``config`` that is set but cannot run on ``device_type``."""
    problems = [f"{name}={getattr(config, name)!r} ({why})" for name, (is_set, why) in UNSERVED.items()
                if hasattr(config, name) and is_set(getattr(config, name))]
    if problems:
        raise ConfigError(f"Megatron flags the {device_type} device cannot serve: {'; '.join(problems)}. "
                          "Turn them off (devshim does not fall back silently to something else).")


def checked_post_init(original: Callable[..., Any], device_type: str) -> Callable[..., Any]:
    def __post_init__(self: Any) -> None:
        refuse_unserved(self, device_type)
        original(self)

    __post_init__.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return __post_init__
