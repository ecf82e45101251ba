"""The checkpoints integration's record: its sets armed for the moment DeepSpeed's checkpoint engine or megatron-core's
``dist_checkpointing`` is imported, each reported on a line of its own."""

from __future__ import annotations

import importlib.util

from devshim_core.integrations import armed
from devshim_core.integrations.armed import ArmedSet
from devshim_core.integrations.checkpoints.patches import (
    DEEPSPEED_CHECKPOINTS,
    ENGINE_MODULE,
    MEGATRON_CHECKPOINTS,
    PACKAGE,
)

APPLIED = "applied (each checkpoint file's sha256 recorded in .devshim-checksums and checked before it is loaded)"


def _deepspeed_present() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def _megatron_present() -> bool:
    from devshim_core.integrations.megatron.install import _megatron_present as present  # never runs the package

    return present()


_ARMED = (
    ArmedSet(DEEPSPEED_CHECKPOINTS, ENGINE_MODULE, "deepspeed", _deepspeed_present, APPLIED),
    ArmedSet(MEGATRON_CHECKPOINTS, PACKAGE, "megatron.core", _megatron_present, APPLIED),
)


INTEGRATION = armed.integration(
    "checkpoints",
    "DeepSpeed and megatron-core checkpoints never load wrong (sha256 checked before a load), and a save that runs out "
    "of room names the path",
    _ARMED,
    on_cuda="the device is CUDA, where devshim stands aside: DeepSpeed and Megatron save and load as they do",
)
