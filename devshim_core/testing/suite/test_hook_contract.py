"""Kit: what the plugin under test answered to each hook, against the contracts in ``devshim_core.hookspecs``.

devshim already refuses an answer of the wrong type when it builds the device facade; these checks go further:
the answers must describe a device that really works as declared.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from devshim_core.patching import REGISTRY, Patch
from devshim_core.records import DEVICE_MODULE_API, STREAM_API, DeviceReport

MiB = 1 << 20


def _report(device: Any) -> DeviceReport:
    return device.info.report


def test_the_plugin_is_found_through_an_installed_distributions_entry_point(devshim_session: Any) -> None:
    record = devshim_session.selection.plugin
    assert record.distribution and record.version, (
        f"plugin {record.name!r} was not found through the 'devshim' entry point of an installed distribution "
        f"(entry point {record.entry_point!r}); declare [project.entry-points.devshim] in its pyproject.toml")
    assert record.error is None and record.skipped is None, record.reason


def test_the_plugin_was_selected_because_it_was_asked_for(devshim_session: Any, devshim_plugin_name: str) -> None:
    assert devshim_session.selection.reason == f"forced by DEVSHIM_PLUGIN={devshim_plugin_name}"


def test_detect_reports_an_available_device_with_a_reason(devshim_device: Any) -> None:
    report = _report(devshim_device)
    assert report.available and report.device_count >= 1, report
    assert report.reason.strip(), "devshim_detect must say why (devshim info shows it)"
    torch.device(report.device_type)  # a device type torch knows


def test_the_device_module_offers_torch_cudas_api_and_counts_what_detect_counted(devshim_device: Any) -> None:
    module = devshim_device.module
    wanted = DEVICE_MODULE_API + (STREAM_API if devshim_device.traits.streams else ())
    missing = [name for name in wanted if not callable(getattr(module, name, None))]
    assert missing == [], f"the device module lacks {missing}"
    assert module.is_available() is True
    assert module.device_count() == _report(devshim_device).device_count
    index = module.current_device()
    assert isinstance(index, int) and 0 <= index < module.device_count()


def test_every_supported_dtype_computes_on_the_device(devshim_device: Any) -> None:
    traits = devshim_device.traits
    assert torch.float32 in traits.supported_dtypes
    assert traits.bf16_supported == (torch.bfloat16 in traits.supported_dtypes)
    assert traits.fp16_supported == (torch.float16 in traits.supported_dtypes)
    for dtype in traits.supported_dtypes:
        x = torch.arange(4, dtype=dtype, device=devshim_device.torch_device(0))
        assert x.device.type == devshim_device.type and x.dtype == dtype
        assert (x * 2).cpu().tolist() == [0, 2, 4, 6], dtype


def test_each_device_index_is_a_torch_device_of_that_index(devshim_device: Any) -> None:
    for index in range(devshim_device.device_count()):
        x = torch.ones(2, device=devshim_device.torch_device(index))
        assert x.device == devshim_device.torch_device(index)
        assert str(x.device) == devshim_device.device_name(index)


def test_the_collectives_backend_reduces_device_tensors(devshim_device: Any) -> None:
    """A one-rank process group on the plugin's backend, as DeepSpeed would create it, sums device tensors."""
    spec = devshim_device.collectives
    assert spec.backend, "devshim_collectives must name a torch.distributed backend"
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group(spec.backend, store=dist.HashStore(), rank=0, world_size=1, **dict(spec.init_kwargs))
    try:
        x = torch.arange(3.0, device=devshim_device.torch_device(devshim_device.current_device()))
        dist.all_reduce(x)
        assert x.cpu().tolist() == [0.0, 1.0, 2.0]
        assert dist.get_backend() == spec.backend
    finally:
        dist.destroy_process_group()


def test_the_allocator_counts_a_64_mib_device_allocation(devshim_device: Any) -> None:
    allocator, index = devshim_device.allocator, devshim_device.current_device()
    for read in (allocator.memory_allocated, allocator.memory_reserved, allocator.max_memory_allocated,
                 allocator.max_memory_reserved, allocator.total_memory, allocator.available_memory):
        assert isinstance(read(index), int) and read(index) >= 0, read
    allocator.reset_peak_memory_stats(index)
    before = allocator.memory_allocated(index)
    block = torch.ones(64 * MiB // 4, device=devshim_device.torch_device(index))
    grown = allocator.memory_allocated(index)
    assert grown - before >= 32 * MiB, f"64 MiB on the device moved memory_allocated by {grown - before} bytes"
    del block
    assert allocator.max_memory_allocated(index) >= grown
    assert allocator.total_memory(index) >= allocator.available_memory(index) > 0


def test_a_host_adam_kernel_steps_as_torch_adamw(devshim_device: Any) -> None:
    step = devshim_device.optimizer.host_adam_step
    if step is None:
        pytest.skip(f"plugin {devshim_device.plugin!r} provides no host Adam (ZeRO-Offload then refuses)")
    param = torch.nn.Parameter(torch.randn(1000))
    reference = torch.optim.AdamW([param], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    p, m, v = param.detach().clone(), torch.zeros(1000), torch.zeros(1000)
    for n in range(1, 6):
        param.grad = torch.randn(1000)
        step(p, param.grad.clone(), m, v, step=n, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
             adamw_mode=True, bias_correction=True)
        reference.step()
    torch.testing.assert_close(p, param.detach(), atol=1e-6, rtol=1e-5)


def test_runtime_versions_are_names_to_version_strings(devshim_session: Any) -> None:
    """``devshim_runtime_versions`` (for ``devshim info`` and bug reports): string names to non-empty version strings,
    what cannot be read left out rather than guessed; ``None`` when the plugin reads none."""
    record = devshim_session.selection.plugin
    versions = devshim_session.registry.call(record, "devshim_runtime_versions", report=record.report)
    if versions is None:  # allowed: the plugin reads none
        return
    assert isinstance(versions, dict), f"devshim_runtime_versions returned {type(versions).__name__}, not a dict"
    wrong = {k: v for k, v in versions.items() if not (isinstance(k, str) and k and isinstance(v, str) and v.strip())}
    assert wrong == {}, f"every name and version must be a non-empty string: {wrong}"


def test_the_plugins_patches_were_applied_whole_as_one_set(devshim_device: Any) -> None:
    patches = devshim_device.patches
    assert all(isinstance(patch, Patch) for patch in patches)
    if not patches:
        pytest.skip(f"plugin {devshim_device.plugin!r} declares no patches")
    name = f"plugin-{devshim_device.plugin}"
    applied = {row["name"] for row in REGISTRY.report() if row["set"] == name}
    assert applied == {patch.name for patch in patches}
