"""Megatron's fused paths on the device's kernels (``device.attention.<op>``), one declared patch per path.

Megatron's local (non-TransformerEngine) spec runs unfused PyTorch code or asks for CUDA extensions; each patch
here routes one path to the selected plugin's kernel instead, with Megatron's conventions converted at the call
(layout [s, b, n, d], mask True = masked, its scales). A path whose op the plugin does not provide is not patched,
and a call the kernel cannot serve as Megatron would runs Megatron's own code: falling back is never wrong.
Nothing is imported from Megatron until a patch is applied.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from devshim_core import log
from devshim_core.integrations.megatron import context_parallel, grouped_gemm_module
from devshim_core.integrations.megatron.flavor import CORE_0_12
from devshim_core.patching import Patch, RebindReferences, Requirement, SetAttribute, SetAttributes

_log = log.logger("kernels")  # DEVSHIM_LOG_LEVEL=debug: which path each call takes

if TYPE_CHECKING:
    from devshim_core.device import Device

Tensor = torch.Tensor
DOT_PRODUCT_ATTENTION = "megatron.core.transformer.dot_product_attention"
TORCH_NORM = "megatron.core.transformer.torch_norm"
SWIGLU = "megatron.core.fusions.fused_bias_swiglu"
ROPE_UTILS = "megatron.core.models.common.embeddings.rope_utils"
FUSED_SOFTMAX = "megatron.core.fusions.fused_softmax"
GROUPED_GEMM_UTIL = "megatron.core.transformer.moe.grouped_gemm_util"
EXPERTS = "megatron.core.transformer.moe.experts"


def fused_patches(device: Device) -> list[Patch]:
    """The patches for the ops ``device`` provides, in the order they must be applied."""
    kernels = device.attention
    patches: list[Patch] = []
    if kernels.attention is not None:
        patches.append(SetAttribute(
            name="context-parallel-attention", target=f"{DOT_PRODUCT_ATTENTION}:DotProductAttention.__init__",
            make=_attention_init,
            reason="context_parallel_size > 1 runs in the local attention (Megatron's asserts it off; on CUDA only "
                   "TE's attention takes it): Ulysses (cp_comm_type a2a), ring attention (p2p, all_gather) or both "
                   "(a2a+p2p) around the device's attention kernels (context_parallel.py)"))
        patches += _replaced_everywhere(
            "context-parallel-positions", f"{ROPE_UTILS}:get_pos_emb_on_this_cp_rank", _positions_on_cp_rank,
            "with context parallelism the rotary embedding's rows for this rank are picked with a pinned host index "
            "(pin_memory=True raises without a CUDA allocator, on the host CPU); the same rows, indexed on the device")
        patches += _replaced_everywhere(
            "context-parallel-batch", "megatron.core.utils:get_batch_on_this_cp_rank", _batch_on_cp_rank,
            "megatron-core 0.12 splits each batch over the context-parallel ranks with a pinned host index (0.16 "
            "indexes on the device); the same split, indexed on the device", requires=(CORE_0_12,))
        patches.append(SetAttribute(
            name="fused-attention", target=f"{DOT_PRODUCT_ATTENTION}:DotProductAttention.forward",
            make=_attention_forward,
            reason="core attention runs the device's attention kernel instead of baddbmm + softmax + bmm; attention "
                   "bias, sliding windows and softmax offsets keep Megatron's forward"))
    if kernels.rms_norm is not None:
        patches.append(SetAttribute(
            name="fused-norm", target=f"{TORCH_NORM}:WrappedTorchNorm.__new__", make=_norm_new,
            reason="the local spec's norm runs RMSNorm on the device's rms_norm kernel and takes sequence "
                   "parallelism, zero-centred gamma and persist_layer_norm as TE's and apex's norms do"))
    if kernels.swiglu is not None:
        patches += _replaced_everywhere(
            "fused-swiglu", f"{SWIGLU}:bias_swiglu_impl", _bias_swiglu_impl,
            "bias_activation_fusion with SwiGLU runs the device's swiglu kernel")
        patches += _replaced_everywhere(
            "fused-weighted-swiglu", f"{SWIGLU}:weighted_bias_swiglu_impl", _weighted_bias_swiglu_impl,
            "MoE experts' bias_activation_fusion with SwiGLU (routing probabilities applied per token) runs the "
            "device's swiglu kernel")
        patches.append(SetAttribute(
            name="grouped-experts-swiglu", target=f"{EXPERTS}:GroupedMLP.__init__", make=_grouped_mlp_init,
            reason="moe_grouped_gemm's GroupedMLP builds its own jit-scripted GLU; with SiLU it runs the device's "
                   "swiglu kernel instead (the routing probabilities applied as Megatron does)"))
    if kernels.grouped_gemm is not None:
        patches.append(SetAttributes(
            name="fused-grouped-gemm", target=GROUPED_GEMM_UTIL, names=("grouped_gemm", "ops"), make=_grouped_gemm,
            reason="moe_grouped_gemm's GroupedMLP runs the device's grouped_gemm kernel through devshim's grouped_gemm "
                   "module (bound here too when Megatron was imported before devshim)"))
    if kernels.rotary is not None:
        patches += _replaced_everywhere(
            "fused-rotary", f"{ROPE_UTILS}:_apply_rotary_pos_emb_bshd", _rotary_bshd,
            "rotary embeddings run the device's rotary kernel (multi-latent attention keeps Megatron's)")
        patches.append(SetAttributes(
            name="fused-rope", target=ROPE_UTILS,
            names=("fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_thd"), make=_fused_rope,
            reason="apply_rope_fusion=True runs the device's rotary kernel (without TE, TransformerConfig refuses it)"))
    if kernels.masked_softmax is not None:
        patches.append(SetAttributes(
            name="fused-masked-softmax", target=f"{FUSED_SOFTMAX}:FusedScaleMaskSoftmax",
            names=("is_kernel_available", "forward_fused_softmax"), make=_softmax_methods,
            reason="masked_softmax_fusion in fp16/bf16 runs the device's masked_softmax kernel instead of the "
                   "scaled_masked_softmax CUDA extensions"))
    return patches


def _replaced_everywhere(name: str, target: str, make: Callable[[Any, Device], Any], reason: str,
                         requires: tuple[Requirement, ...] = ()) -> list[Patch]:
    """Set ``target`` and rebind the ``from module import f`` copies Megatron's modules hold of it."""
    swap: dict[str, Any] = {}

    def made(original: Any, device: Device) -> Any:
        if original is None:
            raise AttributeError(f"{target} does not exist in this Megatron")
        swap["old"], swap["new"] = original, make(original, device)
        return swap["new"]

    return [SetAttribute(name=name, target=target, make=made, reason=reason, requires=requires),
            RebindReferences(name=f"{name}-imported-copies", scope="megatron",
                             pairs=lambda _device: [(swap["old"], swap["new"])], requires=requires,
                             reason=f"modules that imported {target.rpartition(':')[2]} by name call the device's too")]


# -- attention --------------------------------------------------------------------------------------------------


CP_COMM_TYPE = "devshim_cp_comm_type"  # set on a DotProductAttention built with context_parallel_size > 1


def _attention_init(original: Callable[..., None], device: Device) -> Callable[..., None]:
    signature = inspect.signature(original)

    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        if config.context_parallel_size <= 1:
            original(self, config, *args, **kwargs)
            return
        # Megatron's __init__ asserts context_parallel_size == 1 and reads nothing else of it: build from a copy
        # that says 1, keep the real config, and remember how this layer communicates
        comm_type = signature.bind(self, config, *args, **kwargs).arguments.get("cp_comm_type")
        unsplit = copy.copy(config)
        unsplit.context_parallel_size = 1
        original(self, unsplit, *args, **kwargs)
        self.config = config
        setattr(self, CP_COMM_TYPE, comm_type or "p2p")  # TE's default, and Megatron-LM's --cp-comm-type

    __init__.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return __init__


def _this_ranks_chunks(t: Tensor, seq_dim: int, size: int, rank: int) -> Tensor:
    """Megatron's load-balanced split of ``t`` along ``seq_dim`` (``context_parallel.load_balanced_positions``),
    indexed on ``t``'s device (Megatron pins a host index and copies it, which fails without a CUDA allocator)."""
    positions = context_parallel.load_balanced_positions(t.shape[seq_dim] // size, size, rank, t.device)
    return t.index_select(seq_dim, positions)


def _cp_size_and_rank() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()


def _positions_on_cp_rank(original: Callable[..., Tensor], device: Device) -> Callable[..., Tensor]:
    takes_group = "cp_group" in inspect.signature(original).parameters  # 0.16; 0.12 reads parallel_state

    def get_pos_emb_on_this_cp_rank(pos_emb: Tensor, seq_dim: int, cp_group: Any = None) -> Tensor:
        if takes_group and cp_group is None:
            return original(pos_emb, seq_dim, cp_group)  # Megatron's own error
        size, rank = (cp_group.size(), cp_group.rank()) if takes_group else _cp_size_and_rank()
        return _this_ranks_chunks(pos_emb, seq_dim, size, rank)

    return get_pos_emb_on_this_cp_rank


def _batch_on_cp_rank(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    def get_batch_on_this_cp_rank(batch: dict[str, Any]) -> dict[str, Any]:
        size, rank = _cp_size_and_rank()
        if size > 1:
            for key, val in batch.items():
                if val is not None:
                    batch[key] = _this_ranks_chunks(val, 2 if key == "attention_mask" else 1, size, rank)
        return batch

    return get_batch_on_this_cp_rank


def _context_parallel(self: Any, device: Device, scale: float, dropout_p: float,
                      local: context_parallel.LocalAttention) -> context_parallel.ContextParallelAttention:
    from megatron.core import parallel_state

    group = getattr(getattr(self, "pg_collection", None), "cp", None) or parallel_state.get_context_parallel_group()
    comm_type = getattr(self, CP_COMM_TYPE)
    hierarchical = None
    if comm_type in context_parallel.HYBRID:
        hierarchical = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
        if hierarchical is not None and len(hierarchical) != 2:
            raise ValueError(f"cp_comm_type a2a+p2p takes two levels (hierarchical_context_parallel_sizes "
                             f"[A2A_SIZE, RING_SIZE]), got {len(hierarchical)}")
    return context_parallel.ContextParallelAttention(
        comm_type, group, hierarchical, dist.get_rank(group), dist.get_world_size(group), local,
        device.attention.attention_lse, scale, dropout_p)


def _attention_forward(original: Callable[..., Tensor], device: Device) -> Callable[..., Tensor]:
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType

    kernel = cast("Callable[..., Tensor]", device.attention.attention)  # not None: patched only then

    def forward(self: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: Any = None, attention_bias: Tensor | None = None,
                packed_seq_params: Any = None) -> Tensor:
        # [sq, b, np, hn] query, [sk, b, ng, hn] key/value -> [sq, b, np * hn], as Megatron's forward
        sq, sk = query.shape[0], key.shape[0]
        softmax = self.scale_mask_softmax
        split = hasattr(self, CP_COMM_TYPE)  # context parallel: this rank holds a part of each sequence
        # Megatron's forward ignores attn_mask_type: its softmax masks by the type it was built with
        causal = self.attn_mask_type == AttnMaskType.causal and not (sq == 1 and attention_mask is None)
        unfused = [what for what, present in (
            ("an attention bias", attention_bias is not None), ("packed sequences", packed_seq_params is not None),
            # (megatron-core < 0.15 has neither attribute: no offset, no window)
            ("a softmax offset", getattr(self, "softmax_offset", None) is not None),
            ("a sliding window", getattr(softmax, "window_size", None) is not None),
            ("a float mask", attention_mask is not None and attention_mask.dtype != torch.bool),
            ("a non-square causal mask", causal and sq != sk)) if present]
        if unfused:
            if split:  # Megatron's own forward asserts context parallelism off
                raise ValueError(f"context parallelism (context_parallel_size={self.config.context_parallel_size}) "
                                 f"runs in devshim's attention, which does not take {' or '.join(unfused)}; use "
                                 "context_parallel_size=1 for this model")
            _log.debug("attention [sq %d, sk %d]: Megatron's own (%s)", sq, sk, ", ".join(unfused))
            return original(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        # Megatron scales the scores twice: by softmax_scale (already divided by the layer number under
        # apply_query_key_layer_scaling) in the matmul, then by that layer number again in the softmax
        scale = self.softmax_scale * (softmax.scale if softmax.scale is not None else 1.0)
        dropout_p = self.attention_dropout.p if self.training else 0.0

        def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, *,
                true_means_masked: bool) -> Tensor:
            # [s, b, n, d] in and out. A causal type with a mask masks their union (Megatron's unfused path reads
            # only the mask, its fused kernel only the triangle; they agree when the mask is causal). Masked
            # scores are -inf here, not -10000.0: equal unless every score of a row is below about -9900, and a
            # query with no key left gets zeros, as Megatron's fused softmax gives it.
            return kernel(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), layout="BNSD",
                          attn_mask=mask, mask_true_means_masked=true_means_masked, causal=is_causal,
                          dropout_p=dropout_p, scale=scale).permute(2, 0, 1, 3)

        if split:
            _log.debug("attention [sq %d of each sequence]: context parallel (%s) on the %s plugin's kernels", sq,
                       getattr(self, CP_COMM_TYPE), device.plugin)
            local = functools.partial(run, true_means_masked=False)  # context_parallel passes masks as keep-masks
            keep = None if attention_mask is None else ~attention_mask
            attend = functools.partial(_context_parallel(self, device, scale, dropout_p, local), query, key, value,
                                       keep, causal)
        else:
            _log.debug("attention [sq %d, sk %d]: the %s plugin's kernel, causal=%s", sq, sk, device.plugin, causal)
            # Megatron's mask polarity (True = masked) is passed as it is: Ascend's too, so nothing is inverted
            attend = functools.partial(run, query, key, value, attention_mask, causal, true_means_masked=True)
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            # Dropout where Megatron applies it, inside the RNG tracker's fork (distinct per TP rank, replayed by
            # activation recomputation). It drops the same fraction of probabilities and rescales the survivors
            # as nn.Dropout, but draws its mask differently: same distribution, not the same bits as Megatron.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        # [sq, b, np, hn] -> [sq, b, np * hn]
        return context.reshape(sq, context.shape[1], -1)

    return forward


# -- norm -------------------------------------------------------------------------------------------------------


class DeviceRMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension on the device's ``rms_norm`` kernel; one ``weight`` parameter, as
    ``torch.nn.RMSNorm``'s, so checkpoints move between the two. With ``zero_centered_gamma`` the stored weight
    is ``gamma - 1`` (initialised to 0), as TE's and apex's norms store it."""

    def __init__(self, hidden_size: int, eps: float, kernel: Callable[..., Tensor], *,
                 zero_centered_gamma: bool = False) -> None:
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.kernel = kernel
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size) if zero_centered_gamma else torch.ones(hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        return self.kernel(x, self.weight + 1 if self.zero_centered_gamma else self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` whose stored weight is ``gamma - 1`` (Megatron's ``layernorm_zero_centered_gamma``)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps=eps)
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


def _norm_new(original: Any, device: Device) -> staticmethod:
    original_new = original.__func__ if isinstance(original, staticmethod) else original
    kernel = cast("Callable[..., Tensor]", device.attention.rms_norm)  # not None: patched only then

    def __new__(cls: type, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> torch.nn.Module:
        # like Megatron's, this reads config.normalization and config.layernorm_zero_centered_gamma, not the
        # arguments of the same names; persist_layer_norm and memory_efficient_layer_norm only pick apex's CUDA
        # kernels, so they are accepted and change nothing here
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            return original_new(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                                normalization)
        centred = bool(config.layernorm_zero_centered_gamma)
        if config.normalization == "RMSNorm":
            norm: torch.nn.Module = DeviceRMSNorm(hidden_size, eps, kernel, zero_centered_gamma=centred)
        else:
            norm = ZeroCenteredLayerNorm(hidden_size, eps) if centred else torch.nn.LayerNorm(hidden_size, eps=eps)
        for param in norm.parameters():  # Megatron all-reduces these grads across TP ranks, as for TE/apex norms
            param.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]  # Megatron's marker on params
        return norm

    return staticmethod(__new__)


# -- swiglu -----------------------------------------------------------------------------------------------------


def _bias_swiglu_impl(original: Callable[..., Tensor], device: Device) -> Callable[..., Tensor]:
    kernel = cast("Callable[..., Tensor]", device.attention.swiglu)  # not None: patched only then

    def bias_swiglu_impl(input: Tensor, bias: Tensor | None, fp8_input_store: bool = False,
                         cpu_offload_input: bool = False) -> Tensor:
        if fp8_input_store or cpu_offload_input:  # how Megatron's own Functions store their input for backward
            _log.debug("swiglu: Megatron's own (fp8 input store or CPU offload of its input)")
            return original(input, bias, fp8_input_store, cpu_offload_input)
        return kernel(input if bias is None else input + bias)

    return bias_swiglu_impl


def _weighted_bias_swiglu_impl(original: Callable[..., Tensor], device: Device) -> Callable[..., Tensor]:
    kernel = cast("Callable[..., Tensor]", device.attention.swiglu)  # not None: patched only then

    def weighted_bias_swiglu_impl(input: Tensor, bias: Tensor | None, weights: Tensor,
                                  fp8_input_store: bool = False) -> Tensor:
        if bias is not None or fp8_input_store:  # Megatron refuses a bias here; fp8 storage is its Function's
            _log.debug("weighted swiglu: Megatron's own (a bias, or fp8 input store)")
            return original(input, bias, weights, fp8_input_store)
        # as Megatron's weighted_swiglu: swiglu in the input's dtype, times the per-token weights (often fp32
        # probabilities, so the product is promoted) and cast back; autograd gives its two gradients
        shape = input.shape
        flat = input.reshape(-1, shape[-1])
        out = (kernel(flat) * weights).to(input.dtype)
        return out if len(shape) == 2 else out.view(*shape[:-1], -1)

    return weighted_bias_swiglu_impl


def _grouped_mlp_init(original: Callable[..., None], device: Device) -> Callable[..., None]:
    kernel = cast("Callable[..., Tensor]", device.attention.swiglu)  # not None: patched only then

    def __init__(self: Any, num_local_experts: int, config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, num_local_experts, config, *args, **kwargs)
        if not (config.gated_linear_unit and config.activation_func is F.silu):
            return  # GeLU's GLU, or no GLU: Megatron's own

        def activation_func_with_probs(x: Tensor, probs: Tensor) -> Tensor:
            # as Megatron's: the activation in x's dtype, times the (often fp32) probabilities, cast back
            return (kernel(x) * probs).to(x.dtype)

        self.activation_func = kernel
        self.activation_func_with_probs = activation_func_with_probs

    __init__.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return __init__


# -- grouped GEMM -----------------------------------------------------------------------------------------------


def _grouped_gemm(originals: dict[str, Any], device: Device) -> dict[str, Any]:
    # the module devshim provided at import time when there is one (so both names are the same object), else a
    # new one: a real grouped_gemm is a CUDA build, which cannot run on this device
    provided = sys.modules.get(grouped_gemm_module.MODULE_NAME)
    module = provided if provided is not None and grouped_gemm_module.is_standin(provided) else (
        grouped_gemm_module.make_module(device))
    return {"grouped_gemm": module, "ops": module.ops}


# -- rotary -----------------------------------------------------------------------------------------------------


def _rotary_bshd(original: Callable[..., Tensor], device: Device) -> Callable[..., Tensor]:
    kernel = cast("Callable[..., Tensor]", device.attention.rotary)  # not None: patched only then

    def _apply_rotary_pos_emb_bshd(t: Tensor, freqs: Tensor, rotary_interleaved: bool = False,
                                   multi_latent_attention: bool = False, mscale: float = 1.0) -> Tensor:
        if multi_latent_attention or not _rotates(t, freqs):  # MLA de-interleaves t first: Megatron's own
            _log.debug("rotary %s: Megatron's own (multi-latent attention, or freqs that do not broadcast)",
                       tuple(t.shape))
            return original(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        cos, sin = torch.cos(freqs), torch.sin(freqs)
        if mscale != 1.0:
            cos, sin = cos * mscale, sin * mscale  # in freqs' dtype, cast to t's by the kernel, as Megatron
        return kernel(t, cos, sin, interleaved=rotary_interleaved)

    return _apply_rotary_pos_emb_bshd


def _rotates(t: Tensor, freqs: Tensor) -> bool:
    """Whether ``freqs`` rotates the leading channels of ``t`` broadcasting without enlarging it."""
    rot = freqs.shape[-1]
    if freqs.dim() > t.dim() or rot % 2 or rot > t.shape[-1]:
        return False
    try:
        return torch.broadcast_shapes(t.shape[:-1], freqs.shape[:-1]) == t.shape[:-1]
    except RuntimeError:
        return False


class _ContextParallelRank:
    """The size and rank of a context-parallel group, which is all Megatron's THD rotary reads from it."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _fused_rope(originals: dict[str, Any], device: Device) -> dict[str, Any]:
    # TE's fused RoPE computes what Megatron's unfused functions compute; those run the device's kernel once
    # "fused-rotary" is applied (looked up at call time, so a fallback inside them still holds)
    from megatron.core.models.common.embeddings import rope_utils

    def fused_apply_rotary_pos_emb(t: Tensor, freqs: Tensor, transpose_output_memory: bool = False,
                                   interleaved: bool = False) -> Tensor:
        return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)

    def fused_apply_rotary_pos_emb_thd(t: Tensor, cu_seqlens: Tensor, freqs: Tensor, cp_size: int = 1,
                                       cp_rank: int = 0) -> Tensor:
        return rope_utils._apply_rotary_pos_emb_thd(t, cu_seqlens, freqs,
                                                    cp_group=_ContextParallelRank(cp_size, cp_rank))

    return {"fused_apply_rotary_pos_emb": fused_apply_rotary_pos_emb,
            "fused_apply_rotary_pos_emb_thd": fused_apply_rotary_pos_emb_thd}


# -- masked softmax ---------------------------------------------------------------------------------------------


def _softmax_methods(originals: dict[str, Any], device: Device) -> dict[str, Any]:
    from megatron.core.transformer.enums import AttnMaskType

    kernel = cast("Callable[..., Tensor]", device.attention.masked_softmax)  # not None: patched only then

    def is_kernel_available(self: Any, mask: Tensor | None, b: int, np: int, sq: int, sk: int) -> bool:
        # the CUDA kernels' shape limits (sk <= 4096, multiples of 4) do not apply; sliding windows do not fuse
        causal = self.attn_mask_type == AttnMaskType.causal
        return bool(self.scaled_masked_softmax_fusion and self.input_in_float16
                    and getattr(self, "window_size", None) is None
                    and (mask is None or not mask.is_floating_point()) and (not causal or sq == sk))

    def forward_fused_softmax(self: Any, input: Tensor, mask: Tensor | None) -> Tensor:
        # a causal type with a mask masks their union, as the attention patch does
        return kernel(input, mask, self.scale if self.scale is not None else 1.0,
                      causal=self.attn_mask_type == AttnMaskType.causal)

    return {"is_kernel_available": is_kernel_available, "forward_fused_softmax": forward_fused_softmax}
