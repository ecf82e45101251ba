"""transformers' ``TrainingArguments.device`` in a single process: its own ``cuda:0`` as the selected device.

Distributed, ``TrainingArguments`` takes Accelerate's device (see ``accelerate_state``). In one process it checks the
devices it knows (``npu``, a ``tpu`` torch accelerator, ...) and otherwise names ``cuda:0`` when
``torch.cuda.is_available()``: on the host CPU that is the redirect's answer, and the parameters are on the CPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from devshim_core.device import Device
from devshim_core.integrations.huggingface.accelerate_state import selected


def setup_devices(original: functools.cached_property, device: Device) -> functools.cached_property:
    def _setup_devices(self: Any) -> torch.device:
        return selected(device, original.func(self))

    _setup_devices.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark
    replacement = functools.cached_property(_setup_devices)
    # set on a class after its creation, so Python does not call this: the cache needs the attribute's name
    replacement.__set_name__(object, original.attrname or "_setup_devices")
    replacement.__doc__ = original.__doc__
    return replacement
