"""rms_norm, swiglu and rotary embedding with the conventions Megatron and the vendors use.

Each lives in its own module with its custom autograd Function (:mod:`.norm`, :mod:`.glu`, :mod:`.rope`);
this module keeps the original import path.
"""

from __future__ import annotations

from devshim_kernels.glu import swiglu
from devshim_kernels.norm import rms_norm
from devshim_kernels.rope import rotary

__all__ = ["rms_norm", "rotary", "swiglu"]
