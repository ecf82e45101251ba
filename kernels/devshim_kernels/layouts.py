"""The dense attention layouts vendors use, as views of PyTorch's [batch, heads, seq, head_dim] (``BNSD``).

``BSND`` = [batch, seq, heads, head_dim]; ``BSH`` = [batch, seq, heads*head_dim]; ``SBH`` = [seq, batch,
heads*head_dim] (Megatron's layout, which Ascend's MindSpeed passes to ``npu_fusion_attention``). ``TND`` is
packed variable-length input; see :mod:`devshim_kernels.varlen`.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor
DENSE_LAYOUTS = ("BNSD", "BSND", "BSH", "SBH")
LAYOUTS = (*DENSE_LAYOUTS, "TND")
"""The layouts ``attention`` and the converters take: the dense ones, then packed variable-length ``TND``."""


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def heads_of(x: Tensor, layout: str, head_dim: int | None = None) -> int:
    """Number of heads ``x`` holds in ``layout`` (``head_dim`` is needed for the hidden layouts)."""
    check_layout(layout)
    if layout in ("BSH", "SBH"):
        if head_dim is None:
            raise ValueError(f"layout {layout} needs head_dim (or num_heads) to split the hidden dimension")
        if x.shape[-1] % head_dim:
            raise ValueError(f"hidden size {x.shape[-1]} is not a multiple of head_dim {head_dim}")
        return x.shape[-1] // head_dim
    return x.shape[1] if layout in ("BNSD", "TND") else x.shape[2]


def to_bnsd(x: Tensor, layout: str, head_dim: int | None = None) -> Tensor:
    """``x`` in a dense ``layout`` as a [batch, heads, seq, head_dim] view (never a copy)."""
    _check_dense(x, layout)
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    n = heads_of(x, layout, head_dim)
    split = x.unflatten(-1, (n, x.shape[-1] // n))
    return split.transpose(1, 2) if layout == "BSH" else split.permute(1, 2, 0, 3)


def from_bnsd(x: Tensor, layout: str) -> Tensor:
    """Inverse of :func:`to_bnsd`: a [batch, heads, seq, head_dim] tensor in ``layout``.

    The result is contiguous in its own layout except for ``BNSD``, which is returned as it is (SDPA's CPU
    kernels produce BSND memory, so BSND and BSH results cost no copy)."""
    _check_dense(x, "BNSD")
    check_layout(layout)
    if layout == "BNSD":
        return x
    if layout == "SBH":
        return x.permute(2, 0, 1, 3).contiguous().flatten(-2)
    bsnd = x.transpose(1, 2).contiguous()
    return bsnd if layout == "BSND" else bsnd.flatten(-2)


def convert_layout(x: Tensor, source: str, target: str, *, num_heads: int | None = None) -> Tensor:
    """``x`` moved from one dense layout to another; ``num_heads`` is needed when ``source`` is BSH/SBH."""
    head_dim = None
    if source in ("BSH", "SBH"):
        if num_heads is None:
            raise ValueError(f"converting from {source} needs num_heads")
        if x.shape[-1] % num_heads:
            raise ValueError(f"hidden size {x.shape[-1]} is not a multiple of num_heads {num_heads}")
        head_dim = x.shape[-1] // num_heads
    return from_bnsd(to_bnsd(x, source, head_dim), target)


def _check_dense(x: Tensor, layout: str) -> None:
    check_layout(layout)
    if layout == "TND":
        raise ValueError("TND is packed variable-length input; use devshim_kernels.varlen to pad or unpad it")
    want = 3 if layout in ("BSH", "SBH") else 4
    if x.dim() != want:
        raise ValueError(f"layout {layout} expects a {want}-D tensor, got shape {tuple(x.shape)}")
