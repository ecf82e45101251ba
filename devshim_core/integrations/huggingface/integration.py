"""The HF integration's record: its sets armed for the moment Accelerate and transformers import the modules they
patch, each reported on a line of its own."""

from __future__ import annotations

import importlib.util

from devshim_core.integrations import armed
from devshim_core.integrations.armed import ArmedSet
from devshim_core.integrations.huggingface.patches import (
    ACCELERATE_DEVICE,
    ACCELERATE_MEMORY,
    ACCELERATOR_MODULE,
    MODELING_MODULE,
    TRAINING_ARGS_MODULE,
    TRANSFORMERS_DEVICE,
)


def _installed(distribution: str) -> bool:
    return importlib.util.find_spec(distribution) is not None


# The memory set fires as soon as its module has run, before accelerate.utils and transformers copy the function's
# name. The device set patches two modules: the later one (accelerate.accelerator imports accelerate.state) fires it.
_ARMED = (
    ArmedSet(ACCELERATE_MEMORY, MODELING_MODULE, MODELING_MODULE, lambda: _installed("accelerate"),
             "applied (device_map='auto' budgets the host's RAM once on the host CPU)"),
    ArmedSet(ACCELERATE_DEVICE, ACCELERATOR_MODULE, ACCELERATOR_MODULE, lambda: _installed("accelerate"),
             "applied (Accelerate names the selected device and its backend where it took CUDA)"),
    ArmedSet(TRANSFORMERS_DEVICE, TRAINING_ARGS_MODULE, TRAINING_ARGS_MODULE, lambda: _installed("transformers"),
             "applied (TrainingArguments.device names the selected device where it took cuda:0)"),
)


INTEGRATION = armed.integration(
    "huggingface",
    "HF Accelerate and transformers name the selected device and its backend where they took CUDA for it",
    _ARMED,
    on_cuda="the device is CUDA, where Accelerate and transformers choose it themselves",
    needs=("cuda-redirect",),  # without the redirect torch.cuda answers False and they never take CUDA
)
