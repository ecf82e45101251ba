"""A CUDA job script's environment in Ascend's variables (the ``devshim_environment_map`` answer).

The names are Huawei's: ``ASCEND_RT_VISIBLE_DEVICES`` (CANN's runtime), ``PYTORCH_NPU_ALLOC_CONF`` (torch_npu's
caching allocator), ``HCCL_SOCKET_IFNAME`` (same syntax as NCCL's: prefixes, ``=`` exact names, ``^`` exclusions),
``HCCL_ASYNC_ERROR_HANDLING`` and ``HCCL_BLOCKING_WAIT`` (torch_npu's ProcessGroupHCCL, as ``TORCH_NCCL_*`` for
ProcessGroupNCCL) and ``ASCEND_GLOBAL_LOG_LEVEL``. Any other ``NCCL_*`` setting (InfiniBand, protocols, buffer
sizes) has no documented HCCL equivalent and is named in devshim's warning.
"""

from __future__ import annotations

from devshim_ascend import allocator
from devshim_core.env_migration import allocator_config, visible_devices
from devshim_core.records import EnvironmentMap

# NCCL_DEBUG -> ASCEND_GLOBAL_LOG_LEVEL (0 debug, 1 info, 2 warning, 3 error); NCCL's VERSION level has no equivalent
_LOG_LEVELS = {"TRACE": "0", "INFO": "1", "WARN": "2"}


def log_level(value: str) -> tuple[str | None, str]:
    level = _LOG_LEVELS.get(value.strip().upper())
    if level is None:
        return None, f"ASCEND_GLOBAL_LOG_LEVEL has no level for NCCL_DEBUG={value} (it takes {', '.join(_LOG_LEVELS)})"
    return level, "ASCEND_GLOBAL_LOG_LEVEL sets the level of all CANN logs, not only HCCL's"


def environment_map() -> EnvironmentMap:
    return EnvironmentMap(
        variables={
            "CUDA_VISIBLE_DEVICES": "ASCEND_RT_VISIBLE_DEVICES",
            "PYTORCH_CUDA_ALLOC_CONF": allocator.CONFIG_ENV,
            "NCCL_SOCKET_IFNAME": "HCCL_SOCKET_IFNAME",
            "NCCL_DEBUG": "ASCEND_GLOBAL_LOG_LEVEL",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "HCCL_ASYNC_ERROR_HANDLING",
            "TORCH_NCCL_BLOCKING_WAIT": "HCCL_BLOCKING_WAIT",
        },
        convert={
            "CUDA_VISIBLE_DEVICES": visible_devices,
            "PYTORCH_CUDA_ALLOC_CONF": allocator_config(allocator.KEYS, allocator.validate_config),
            "NCCL_DEBUG": log_level,
        },
    )
