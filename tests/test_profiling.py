"""``devshim_core.profiling.StepProfiler``: steps N..M on chosen ranks, a Chrome trace per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from devshim_core.profiling import StepProfiler, activities


def _train(profiler: StepProfiler, steps: int) -> None:
    weight = torch.randn(64, 64, requires_grad=True)
    for _ in range(steps):
        (torch.randn(8, 64) @ weight).sum().backward()
        profiler.step()


def _events(path: Path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def test_only_the_requested_steps_are_recorded(tmp_path: Path) -> None:
    profiler = StepProfiler(start=2, end=4, ranks=(0,), output_dir=str(tmp_path), device_type="cpu")
    _train(profiler, steps=6)
    events = _events(tmp_path / "rank0.json")
    steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]
    assert any(e.get("name") == "aten::mm" for e in events)  # the work inside the steps is there
    assert not any(e.get("name") == "[memory]" for e in events)


def test_memory_events_are_recorded_when_asked(tmp_path: Path) -> None:
    profiler = StepProfiler(start=0, end=1, with_memory=True, output_dir=str(tmp_path), device_type="cpu")
    _train(profiler, steps=2)
    assert any(e.get("name") == "[memory]" for e in _events(tmp_path / "rank0.json"))


def test_a_rank_not_chosen_records_nothing(tmp_path: Path) -> None:
    profiler = StepProfiler(start=0, end=2, ranks=(1, 3), output_dir=str(tmp_path), device_type="cpu")
    _train(profiler, steps=3)
    assert not profiler.enabled
    assert not list(tmp_path.iterdir())


def test_bad_step_ranges_are_refused() -> None:
    with pytest.raises(ValueError, match="need 0 <= start < end"):
        StepProfiler(start=3, end=3, device_type="cpu")


def test_the_host_is_always_profiled_and_cuda_only_on_cuda() -> None:
    assert activities("cpu") == [torch.profiler.ProfilerActivity.CPU]
    assert activities("cuda") == [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
