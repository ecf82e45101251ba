"""``torch_tpu.tpu`` (simulated): the device module, plus SCCL's process-group options on SG2260 builds."""

from __future__ import annotations

import os
from typing import Any

import torch

from torch_tpu import CHIP_ARCH


def __getattr__(name: str) -> Any:  # the device functions are torch.tpu's
    return getattr(torch.tpu, name)


if CHIP_ARCH == "sg2260":  # BM1684X builds have no SCCL options, as Sophgo's

    class ProcessGroupSCCLOptions:
        """What ``init_process_group(backend="sccl", pg_options=...)`` takes: the chip of each local rank."""

        def __init__(self) -> None:
            self.chip_map: list[int] = []

    def set_chip_map(options: ProcessGroupSCCLOptions, use_rank_table: bool = False) -> None:
        """Fill ``options.chip_map`` from ``CHIP_MAP`` (comma-separated chips per local rank), else 0..n-1."""
        raw = os.environ.get("CHIP_MAP", "").strip()
        if raw:
            options.chip_map = [int(part) for part in raw.split(",") if part.strip()]
        else:
            options.chip_map = list(range(torch.tpu.device_count()))
