"""DeepSpeed op builders for devshim's accelerator (``op_builder_dir()``).

Imported lazily by the accelerator, never at DeepSpeed import time's first step: the builders subclass
``deepspeed.ops.op_builder.builder.OpBuilder``, which must already be loaded.
"""

from devshim_core.integrations.deepspeed.op_builders.adam import CPUAdamBuilder, FusedAdamBuilder
from devshim_core.integrations.deepspeed.op_builders.async_io import AsyncIOBuilder
from devshim_core.integrations.deepspeed.op_builders.not_implemented import NotImplementedBuilder, refusal_for
from devshim_core.integrations.deepspeed.op_builders.packbits import PackbitsBuilder

__all__ = ["AsyncIOBuilder", "CPUAdamBuilder", "FusedAdamBuilder", "NotImplementedBuilder", "PackbitsBuilder",
           "refusal_for"]
