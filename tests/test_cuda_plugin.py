"""Spec: the ``cuda`` plugin (``plugins/cuda``, distribution devshim-cuda).

CI has no GPU, so detection is specified against this CPU-only torch as it is, and against test doubles of
``torch.cuda``/``torch.version``, of NVML (torch's NVML count and :func:`devshim_cuda.nvml.gpus`, or a fake
``libnvidia-ml``) and of the driver's files in ``/proc`` (a tmp directory): what the plugin reports and why, that
detection and every hook initialise nothing in CUDA where NVML answers (each torch call that would is a spy), that
devshim selects it over ``cpu_reference`` and accepts every answer of its hooks. Its kernels are plain torch, so
their numerics are specified here on CPU tensors, against the math written out in fp64 (the references of
``test_attention_kernels``/``test_fused_ops``), ``torch.optim.AdamW``/``Adam`` and the update written out. On a GPU
host the conformance kit (``pytest --devshim-plugin=cuda``, ``release/gpu_check.sh``) checks the same kernels on
the device.
"""

from __future__ import annotations

import ctypes
import math
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import devshim_ascend
import devshim_cpu_reference
import devshim_cuda
import pytest
import torch
from devshim_cuda import allocator, detect, kernels, nvml, traits, versions
from devshim_kernels.layouts import from_bnsd, to_bnsd
from plugin_fixtures import only
from test_attention_kernels import reference as attention_reference
from test_fused_ops import rms_math, rotary_math, swiglu_math

from devshim_core.device import build_device
from devshim_core.errors import ConfigError
from devshim_core.plugins import discover
from devshim_core.records import AllocatorSpec, CollectivesSpec, DeviceReport, DeviceTraits
from devshim_core.selection import select

H100 = "NVIDIA H100 80GB HBM3"
DRIVER_LINE = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024\n"
               "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
CPU_ONLY = torch.version.cuda is None and getattr(torch.version, "hip", None) is None


# -- test doubles ----------------------------------------------------------------------------------------------------

def fake_proc(root: Path, models: list[str] | None = None, driver: str | None = DRIVER_LINE) -> Path:
    """A ``/proc/driver/nvidia`` with the driver's version file and one ``gpus/<bus>/information`` per model."""
    root.mkdir(parents=True, exist_ok=True)
    if driver is not None:
        (root / "version").write_text(driver)
    for index, model in enumerate(models or []):
        gpu = root / "gpus" / f"0000:{index + 0x18:02x}:00.0"
        gpu.mkdir(parents=True)
        (gpu / "information").write_text(f"Model: \t\t {model}\nIRQ:   \t\t 150\nBus Type: \t PCIe\n")
    return root


def gpu(index: int, name: str = H100, capability: tuple[int, int] | None = (9, 0)) -> nvml.GPU:
    return nvml.GPU(index, name, f"GPU-{index:x}{index:x}{index:x}a1b2-0000-{name[-4:]}", capability)


# what initialises CUDA (cuInit through cudaGetDeviceCount, or torch's _lazy_init): none may run where NVML answers
INITIALISING = ("_lazy_init", "init", "is_available", "get_device_name", "get_device_properties",
                "get_device_capability", "is_bf16_supported", "current_device", "set_device", "mem_get_info",
                "synchronize", "get_arch_list")


class FakeCuda:
    """torch.cuda and torch.version as a CUDA (or ROCm) build of torch on a GPU host would answer, NVML (torch's
    count and devshim_cuda.nvml) as that host's driver would, plus a record of every call that would initialise
    CUDA: ``initialising_calls``, and ``runtime_counts`` for ``torch.cuda.device_count()`` (the runtime's count)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        self.monkeypatch, self.tmp_path = monkeypatch, tmp_path
        self.count = 8
        self.nvml_failure: str | None = None  # None: NVML counts; "absent": no library; else torch's warning
        self.gpus: list[nvml.GPU] | None = [gpu(i) for i in range(8)]  # what devshim_cuda.nvml reads; None: no NVML
        self.initialised = False
        self.initialising_calls: list[str] = []
        self.runtime_counts = 0
        for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
                     allocator.CUDA_ENV, allocator.HIP_ENV):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(torch.version, "cuda", "12.4")
        monkeypatch.setattr(torch.version, "hip", None, raising=False)
        monkeypatch.setattr(torch.cuda, "device_count", self._runtime_count)
        monkeypatch.setattr(torch.cuda, "_device_count_nvml", self._management_count)
        monkeypatch.setattr(torch.cuda, "_device_count_amdsmi", self._management_count)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: self.initialised)
        monkeypatch.setattr(torch.cuda, "_HAS_AMDSMI", False)
        monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", self._initialising("_cuda_getDeviceCount"),
                            raising=False)
        for name in INITIALISING:
            monkeypatch.setattr(torch.cuda, name, self._initialising(name))
        monkeypatch.setattr(nvml, "gpus", lambda: None if self.gpus is None else list(self.gpus))
        monkeypatch.setattr(detect, "_runtime_counted", False)
        monkeypatch.setattr(detect, "NVIDIA_PROC", fake_proc(tmp_path / "nvidia", [H100] * 8))
        monkeypatch.setattr(detect, "AMDGPU_MODULE", tmp_path / "amdgpu")
        monkeypatch.setattr(detect, "AMD_KFD", tmp_path / "kfd")

    def _initialising(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.initialising_calls.append(name)
            return {"get_device_name": H100, "is_bf16_supported": True, "current_device": 0,
                    "get_device_capability": (9, 0), "is_available": self.count > 0,
                    "get_device_properties": SimpleNamespace(name=H100, total_memory=80 << 30)}.get(name)
        return call

    def _runtime_count(self) -> int:
        self.runtime_counts += 1
        return self.count

    def _management_count(self) -> int:
        if self.nvml_failure is None:
            return self.count
        if self.nvml_failure != "absent":
            warnings.warn(self.nvml_failure, UserWarning, stacklevel=2)
        return -1

    def rocm(self, hip: str = "6.2.41133-dd7f95766") -> None:
        self.monkeypatch.setattr(torch.version, "cuda", None)
        self.monkeypatch.setattr(torch.version, "hip", hip, raising=False)

    def answer(self, name: str, value: Any) -> None:
        """After detection: let an initialising call answer ``value``."""
        self.monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: value)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeCuda:
    return FakeCuda(monkeypatch, tmp_path)


# -- detection -------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not CPU_ONLY, reason="this torch is a CUDA or ROCm build")
def test_on_this_cpu_only_torch_the_plugin_is_not_available_and_names_the_cpu_only_build():
    report = devshim_cuda.devshim_detect()
    assert (report.available, report.device_type, report.device_count, report.priority) == (False, "cuda", 0, 50)
    assert report.reason.startswith(f"torch {torch.__version__} is a CPU-only build: no CUDA runtime ("), report.reason
    report.validate()


def test_its_priority_lies_between_the_vendor_plugins_and_the_cpu_fallback():
    assert devshim_cuda.PRIORITY == 50
    assert devshim_ascend.PRIORITY > devshim_cuda.PRIORITY > devshim_cpu_reference.PRIORITY


NVML_NOTE = "(counted through NVML, CUDA not initialised)"


def test_with_cuda_devices_it_is_available_and_names_runtime_count_model_and_that_nvml_counted(fake_cuda: FakeCuda):
    report = devshim_cuda.devshim_detect()
    assert report == DeviceReport(available=True, reason=f"CUDA 12.4, 8 x {H100} {NVML_NOTE}", device_type="cuda",
                                  device_count=8, priority=50)


def test_detection_counts_through_nvml_and_never_asks_the_runtime(fake_cuda: FakeCuda):
    devshim_cuda.devshim_detect()
    assert fake_cuda.initialising_calls == [] and fake_cuda.runtime_counts == 0
    assert not detect.runtime_counted()


def test_gpus_of_several_models_are_listed_and_an_unreadable_proc_leaves_the_model_out(fake_cuda: FakeCuda,
                                                                                       monkeypatch, tmp_path):
    fake_cuda.count = 2
    monkeypatch.setattr(detect, "NVIDIA_PROC", fake_proc(tmp_path / "mixed", ["NVIDIA A100-SXM4-80GB", H100]))
    reason = devshim_cuda.devshim_detect().reason
    assert reason == f"CUDA 12.4, 2 devices (NVIDIA A100-SXM4-80GB, {H100} on this machine) {NVML_NOTE}"
    monkeypatch.setattr(detect, "NVIDIA_PROC", tmp_path / "absent")
    fake_cuda.count = 1
    assert devshim_cuda.devshim_detect().reason == f"CUDA 12.4, 1 device {NVML_NOTE}"


def test_an_empty_visible_devices_variable_is_named_as_the_reason_for_no_device(fake_cuda: FakeCuda, monkeypatch):
    fake_cuda.count = 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    report = devshim_cuda.devshim_detect()
    assert (report.available, report.device_count) == (False, 0)
    assert report.reason.startswith("CUDA 12.4 runtime, 0 devices visible (CUDA_VISIBLE_DEVICES='': it hides every "
                                    "device from this process; unset it or list device indices"), report.reason


def test_no_device_without_a_driver_says_to_install_it(fake_cuda: FakeCuda, monkeypatch, tmp_path):
    fake_cuda.count = 0
    monkeypatch.setattr(detect, "NVIDIA_PROC", tmp_path / "no-driver")
    reason = devshim_cuda.devshim_detect().reason
    assert reason.startswith("CUDA 12.4 runtime, 0 devices visible (no NVIDIA driver is loaded"), reason
    assert "nvidia-smi" in reason and "--gpus all" in reason


def test_no_device_with_a_driver_names_the_driver_and_a_visible_devices_list(fake_cuda: FakeCuda, monkeypatch):
    fake_cuda.count = 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    reason = devshim_cuda.devshim_detect().reason
    assert reason.startswith("CUDA 12.4 runtime, 0 devices visible (NVIDIA driver 550.54.14 is loaded but NVML finds "
                             "no GPU"), reason
    assert "CUDA_VISIBLE_DEVICES='4,5' may name devices that do not exist" in reason
    fake_cuda.nvml_failure = "absent"
    reason = devshim_cuda.devshim_detect().reason
    assert "NVIDIA driver 550.54.14 is loaded but the CUDA runtime finds no GPU" in reason, reason


def test_torchs_own_warning_about_the_driver_becomes_the_reason_not_its_nvml_warning(fake_cuda: FakeCuda,
                                                                                      monkeypatch):
    fake_cuda.nvml_failure = "Can't initialize NVML"

    def too_old() -> int:  # torch.cuda.device_count() tries NVML again, then the runtime
        warnings.warn("Can't initialize NVML", UserWarning, stacklevel=1)
        warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old (found version 11040).",
                      UserWarning, stacklevel=1)
        return 0

    monkeypatch.setattr(torch.cuda, "device_count", too_old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing reaches the script's own warnings
        reason = devshim_cuda.devshim_detect().reason
    assert reason == ("CUDA 12.4 runtime, 0 devices visible (torch warned: CUDA initialization: The NVIDIA driver on "
                      "your system is too old (found version 11040).)")


def test_a_runtime_that_raises_while_counting_is_reported_not_raised(fake_cuda: FakeCuda, monkeypatch):
    def broken() -> int:
        raise RuntimeError("CUDA driver initialization failed")

    fake_cuda.nvml_failure = "absent"
    monkeypatch.setattr(torch.cuda, "device_count", broken)
    report = devshim_cuda.devshim_detect()
    assert not report.available
    assert report.reason == ("CUDA 12.4 runtime, but asking it for devices failed: RuntimeError: CUDA driver "
                             "initialization failed; check the driver (nvidia-smi or rocm-smi)")


def test_on_rocm_it_reports_hip_and_uses_hips_names(fake_cuda: FakeCuda, monkeypatch):
    fake_cuda.rocm()
    fake_cuda.count = 4
    report = devshim_cuda.devshim_detect()
    assert (report.available, report.device_type, report.device_count) == (True, "cuda", 4)
    assert report.reason == "ROCm (HIP 6.2.41133-dd7f95766), 4 devices (counted through amdsmi, HIP not initialised)"
    assert fake_cuda.initialising_calls == [] and fake_cuda.runtime_counts == 0
    spec = devshim_cuda.devshim_collectives(report)
    assert spec.backend == "nccl"  # torch's name for RCCL on ROCm
    assert spec.visible_devices_envs[0] == "HIP_VISIBLE_DEVICES" and "CUDA_VISIBLE_DEVICES" in spec.visible_devices_envs
    assert {"HIP", "RCCL", "NCCL"} <= set(spec.export_env_prefixes)
    assert devshim_cuda.devshim_allocator(report).config_env == "PYTORCH_HIP_ALLOC_CONF"
    fake_cuda.count = 0
    assert devshim_cuda.devshim_detect().reason.startswith(
        "ROCm (HIP 6.2.41133-dd7f95766) runtime, 0 devices visible (no AMD GPU driver")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    assert "(HIP_VISIBLE_DEVICES='': it hides every device" in devshim_cuda.devshim_detect().reason


# -- selection and the hooks' answers --------------------------------------------------------------------------------

def test_on_a_gpu_host_devshim_selects_cuda_over_cpu_reference_and_accepts_every_answer(fake_cuda: FakeCuda):
    settings = only("cuda", "cpu_reference")
    registry = discover(settings)
    selection = select(registry, settings)
    assert selection.plugin.name == "cuda" and selection.plugin.distribution == "devshim-cuda"
    device = build_device(registry, selection)  # the core checks each record's field types here
    assert fake_cuda.initialising_calls == [] and fake_cuda.runtime_counts == 0
    assert device.type == "cuda" and device.module is torch.cuda
    assert device.traits == DeviceTraits(supported_dtypes=(torch.float32, torch.float16, torch.bfloat16),
                                         bf16_supported=True, fp16_supported=True, fp64_supported=True,
                                         host_synchronous=False, streams=True, int64_supported=True, pin_memory=True,
                                         name=H100)
    assert device.collectives == CollectivesSpec("nccl", export_env_prefixes=devshim_cuda.CUDA_PREFIXES,
                                                 visible_devices_envs=("CUDA_VISIBLE_DEVICES",))
    assert device.allocator.config_env == "PYTORCH_CUDA_ALLOC_CONF"
    assert device.allocator.memory_allocated is torch.cuda.memory_allocated
    assert device.optimizer.fused_adamw is kernels.fused_adamw
    assert device.attention.attention is kernels.attention and device.attention.wgrad_accumulate is not None


def test_a_gpu_without_native_bf16_still_offers_it_as_torch_does_and_every_flag_is_a_real_bool(fake_cuda: FakeCuda):
    """torch's default is_bf16_supported() (DeepSpeed's CUDA accelerator asks it) answers True on a V100, emulating
    bf16: a bf16 config that runs without devshim runs with DEVSHIM_CUDA_FACADE=1 too."""
    fake_cuda.gpus = [gpu(i, "Tesla V100-SXM2-32GB", (7, 0)) for i in range(8)]
    traits = devshim_cuda.devshim_device_traits(devshim_cuda.devshim_detect())
    assert traits.name == "Tesla V100-SXM2-32GB"
    assert traits.supported_dtypes == (torch.float32, torch.float16, torch.bfloat16)
    assert traits.bf16_supported is True
    assert devshim_cuda.traits.read().bf16 is False  # natively it has none; devshim_cuda.traits still tells
    assert all(type(getattr(traits, f)) is bool for f in ("bf16_supported", "fp16_supported", "fp64_supported",
                                                          "host_synchronous", "streams", "int64_supported",
                                                          "pin_memory"))


def test_a_bad_allocator_setting_stops_activation_naming_the_variable(fake_cuda: FakeCuda, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:true")
    settings = only("cuda")
    registry = discover(settings)
    with pytest.raises(ConfigError, match=r"PYTORCH_CUDA_ALLOC_CONF='expandable_segments:true' is not valid for the "
                                          r"cuda device: expandable_segments:true is invalid"):
        build_device(registry, select(registry, settings))


def test_the_allocator_spec_is_torch_cudas_own_memory_functions():
    spec = devshim_cuda.devshim_allocator(devshim_cuda.devshim_detect())
    assert isinstance(spec, AllocatorSpec)
    assert spec.memory_reserved is torch.cuda.memory_reserved and spec.empty_cache is torch.cuda.empty_cache
    assert spec.validate_config is allocator.validate_config


def test_offload_io_and_host_adam_are_devshims_host_defaults():
    import devshim_kernels

    report = devshim_cuda.devshim_detect()
    optimizer = devshim_cuda.devshim_optimizer_kernels(report)
    assert optimizer.host_adam_step is devshim_kernels.host_adam_step
    assert optimizer.host_adam_rollback is devshim_kernels.host_adam_rollback
    assert not hasattr(devshim_cuda, "devshim_offload_io")  # the facade's default: devshim_core.host_defaults


def test_the_kernels_are_its_own_not_devshim_kernels():
    import devshim_kernels

    ops = devshim_cuda.devshim_attention_kernels(devshim_cuda.devshim_detect())
    for op in ("attention", "rms_norm", "swiglu", "rotary", "masked_softmax", "wgrad_accumulate"):
        assert getattr(ops, op) is getattr(kernels, op) and getattr(ops, op) is not getattr(devshim_kernels, op)


# -- initialising nothing in CUDA ------------------------------------------------------------------------------------

def test_detection_and_every_hook_initialise_nothing_where_nvml_answers(fake_cuda: FakeCuda, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    report = devshim_cuda.devshim_detect()
    for hook in ("devshim_device_module", "devshim_device_traits", "devshim_collectives", "devshim_allocator",
                 "devshim_optimizer_kernels", "devshim_attention_kernels",
                 "devshim_runtime_versions"):
        assert getattr(devshim_cuda, hook)(report) is not None, hook
    assert fake_cuda.initialising_calls == [] and fake_cuda.runtime_counts == 0
    spec = devshim_cuda.devshim_allocator(report)
    assert spec.total_memory() == 80 << 30  # bound functions: they initialise CUDA when called, as torch's do
    assert fake_cuda.initialising_calls == ["current_device", "get_device_properties"]


def test_without_nvml_the_runtime_counts_and_the_reason_says_it_initialised_the_driver(fake_cuda: FakeCuda):
    fake_cuda.nvml_failure = "absent"
    report = devshim_cuda.devshim_detect()
    assert (report.available, report.device_count, fake_cuda.runtime_counts) == (True, 8, 1)
    assert report.reason == (f"CUDA 12.4, 8 x {H100} (counted by the CUDA runtime: this initialised the driver, as "
                             "NVML could not count: libnvidia-ml.so.1 could not be loaded; install NVML (the driver's "
                             "libnvidia-ml) to avoid it)")
    assert detect.runtime_counted()


def test_nvml_that_fails_to_initialise_is_named_and_its_warning_kept_from_the_script(fake_cuda: FakeCuda):
    fake_cuda.nvml_failure = "Can't initialize NVML"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reason = devshim_cuda.devshim_detect().reason
    assert reason.endswith("(counted by the CUDA runtime: this initialised the driver, as NVML could not count: Can't "
                           "initialize NVML; nvidia-smi shows why)"), reason
    assert fake_cuda.runtime_counts == 1


def test_a_torch_without_the_nvml_count_falls_back_to_the_runtime(fake_cuda: FakeCuda, monkeypatch):
    monkeypatch.delattr(torch.cuda, "_device_count_nvml")
    reason = devshim_cuda.devshim_detect().reason
    assert "as NVML could not count: this torch has no torch.cuda._device_count_nvml" in reason, reason
    assert fake_cuda.runtime_counts == 1


def test_mig_devices_are_counted_by_the_runtime_without_advice_to_install_nvml(fake_cuda: FakeCuda, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-4b2c3a1e-0000-0000-0000-000000000000")
    fake_cuda.nvml_failure, fake_cuda.count = "absent", 1
    reason = devshim_cuda.devshim_detect().reason
    assert reason.endswith("NVML could not count: CUDA_VISIBLE_DEVICES names MIG devices, which torch's NVML count "
                           "does not resolve)"), reason


def test_a_process_that_already_initialised_cuda_is_counted_by_the_runtime(fake_cuda: FakeCuda, monkeypatch):
    fake_cuda.initialised = True
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", fake_cuda._initialising("_device_count_nvml"))
    reason = devshim_cuda.devshim_detect().reason
    assert reason == f"CUDA 12.4, 8 x {H100} (counted by the CUDA runtime, which this process had already initialised)"
    assert fake_cuda.runtime_counts == 1 and fake_cuda.initialising_calls == []


def test_torchs_nvml_count_honours_the_visible_devices_and_touches_no_runtime(monkeypatch):
    """What detection relies on in this torch: the NVML count reads CUDA_VISIBLE_DEVICES and libnvidia-ml only."""
    if not hasattr(torch.cuda, "_device_count_nvml"):
        pytest.skip("this torch has no NVML count: detection falls back to the runtime")
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: 4)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: pytest.fail("the runtime was asked"), raising=False)
    for visible, count in ((None, 4), ("1,3", 2), ("2,7", 1), ("", 0), ("-1", 0)):
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert torch.cuda._device_count_nvml() == count, visible


# -- traits without CUDA ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("capability", "bf16"), [((8, 0), True), ((9, 0), True), ((7, 0), False), ((7, 5), False)])
def test_bf16_is_read_from_the_compute_capability_nvml_gives(fake_cuda: FakeCuda, capability, bf16):
    fake_cuda.gpus = [gpu(i, "NVIDIA A100-SXM4-80GB", capability) for i in range(8)]
    found = traits.read()
    assert (found.bf16, found.name) == (bf16, "NVIDIA A100-SXM4-80GB")
    assert found.source == f"NVML: GPU 0, compute capability {capability[0]}.{capability[1]}"
    assert fake_cuda.initialising_calls == []


MIXED = [gpu(0, "Tesla V100-SXM2-32GB", (7, 0)), gpu(1, "NVIDIA A100-SXM4-80GB", (8, 0)), gpu(2, H100, (9, 0))]


@pytest.mark.parametrize(("visible", "order", "name", "bf16"), [
    ("1", "PCI_BUS_ID", "NVIDIA A100-SXM4-80GB", True), ("0,2", "PCI_BUS_ID", "Tesla V100-SXM2-32GB", False),
    (None, "PCI_BUS_ID", "Tesla V100-SXM2-32GB", False), (" 2gpu", "PCI_BUS_ID", H100, True),
    (MIXED[0].uuid, None, "Tesla V100-SXM2-32GB", False), (MIXED[2].uuid[:10] + ",0", None, H100, True),
], ids=["index", "list", "unset", "strtoul", "uuid", "uuid-prefix"])
def test_the_current_device_is_the_first_visible_one_by_index_or_uuid(fake_cuda: FakeCuda, monkeypatch, visible,
                                                                      order, name, bf16):
    fake_cuda.gpus = MIXED
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    if order is not None:
        monkeypatch.setenv("CUDA_DEVICE_ORDER", order)
    assert traits.read()[:2] == (bf16, name)
    assert fake_cuda.initialising_calls == []


def test_mixed_models_in_cudas_own_order_are_not_told_apart_and_nothing_is_initialised(fake_cuda: FakeCuda,
                                                                                       monkeypatch):
    fake_cuda.gpus = MIXED
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # CUDA numbers the fastest first: which GPU is 1 is not known
    found = traits.read()
    assert found.bf16 is True  # one of them has it: torch emulates bf16 on the other
    assert found.name == f"{H100} or NVIDIA A100-SXM4-80GB or Tesla V100-SXM2-32GB"
    assert found.source == "NVML: one of GPUs [0, 1, 2], not told apart"
    assert fake_cuda.initialising_calls == []


def test_without_nvml_and_cuda_untouched_the_traits_initialise_nothing(fake_cuda: FakeCuda):
    fake_cuda.gpus = None
    assert traits.read() == (True, "", "nothing could be read without initialising CUDA")
    assert fake_cuda.initialising_calls == []


def test_where_detection_already_initialised_the_driver_the_traits_ask_torch_exactly(fake_cuda: FakeCuda):
    fake_cuda.nvml_failure, fake_cuda.gpus = "absent", None
    devshim_cuda.devshim_detect()
    fake_cuda.answer("get_device_capability", (7, 0))
    fake_cuda.answer("get_device_name", "Tesla T4")
    assert traits.read() == (False, "Tesla T4", "torch (detection had already initialised the driver)")
    assert fake_cuda.initialising_calls == []  # never is_bf16_supported(), which may create a context


def test_a_process_that_initialised_cuda_gets_torchs_answer_for_its_current_device(fake_cuda: FakeCuda):
    fake_cuda.initialised = True
    fake_cuda.answer("get_device_capability", (8, 6))
    fake_cuda.answer("get_device_name", "NVIDIA RTX A6000")
    assert traits.read() == (True, "NVIDIA RTX A6000", "torch (CUDA already initialised)")


def test_torch_refusing_to_initialise_leaves_the_answer_to_nvml(fake_cuda: FakeCuda, monkeypatch):
    def refuses(*args: Any) -> Any:
        raise RuntimeError("Unrecognized CachingAllocator option: expandable_segment")

    fake_cuda.initialised = True
    monkeypatch.setattr(torch.cuda, "get_device_capability", refuses)
    assert traits.read()[:2] == (True, H100)


class FakeAmdsmi:
    def __init__(self, arch: object, name: str) -> None:
        self.info = {"target_graphics_version": arch, "market_name": name}

    def amdsmi_get_gpu_asic_info(self, handle: Any) -> dict:
        assert handle == "handle-0"
        return self.info


@pytest.mark.parametrize(("arch", "bf16"), [("gfx942", True), (90010, True), ("gfx908", True), ("gfx1100", True),
                                            ("gfx906", False), ("gfx1030", False), ("", True)])
def test_on_rocm_bf16_is_read_from_the_gfx_architecture_amdsmi_gives(fake_cuda: FakeCuda, monkeypatch, arch, bf16):
    fake_cuda.rocm()
    monkeypatch.setattr(torch.cuda, "_HAS_AMDSMI", True)
    monkeypatch.setattr(torch.cuda, "amdsmi", FakeAmdsmi(arch, "AMD Instinct MI300X"), raising=False)
    monkeypatch.setattr(torch.cuda, "_get_amdsmi_handler", lambda device: f"handle-{device}")
    found = traits.read()
    assert (found.bf16, found.name) == (bf16, "AMD Instinct MI300X")
    assert fake_cuda.initialising_calls == []


def test_on_rocm_without_amdsmi_bf16_is_torchs_answer_and_nothing_is_initialised(fake_cuda: FakeCuda):
    fake_cuda.rocm()
    assert traits.read() == (True, "", "nothing could be read without initialising HIP")
    assert traits.gfx_name(90402) == "gfx942" and traits.gfx_name(120001) == "gfx1201"
    assert traits.rocm_native_bf16("gfx90a:sramecc+:xnack-") and not traits.rocm_native_bf16("gfx900")
    assert fake_cuda.initialising_calls == []


# -- the NVML reader -------------------------------------------------------------------------------------------------

class FakeNvmlLibrary:
    """libnvidia-ml.so.1 as ctypes sees it: each function fills what its pointer arguments point to."""

    def __init__(self, devices: list[tuple[str, str, tuple[int, int]]], init_rc: int = 0) -> None:
        self.devices, self.init_rc, self.calls = devices, init_rc, []

    def nvmlInit_v2(self) -> int:
        self.calls.append("init")
        return self.init_rc

    def nvmlShutdown(self) -> int:
        self.calls.append("shutdown")
        return 0

    def nvmlDeviceGetCount_v2(self, count: Any) -> int:
        count._obj.value = len(self.devices)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index: Any, handle: Any) -> int:
        handle._obj.value = 0x1000 + index.value
        return 0

    def _device(self, handle: Any) -> tuple[str, str, tuple[int, int]]:
        return self.devices[handle.value - 0x1000]

    def nvmlDeviceGetName(self, handle: Any, buffer: Any, length: Any) -> int:
        buffer.value = self._device(handle)[0].encode()
        return 0

    def nvmlDeviceGetUUID(self, handle: Any, buffer: Any, length: Any) -> int:
        buffer.value = self._device(handle)[1].encode()
        return 0

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any, major: Any, minor: Any) -> int:
        major._obj.value, minor._obj.value = self._device(handle)[2]
        return 0


def test_the_nvml_reader_reads_each_gpus_name_uuid_and_capability_and_shuts_nvml_down(monkeypatch):
    library = FakeNvmlLibrary([(H100, "GPU-aaaa", (9, 0)), ("Tesla T4", "GPU-bbbb", (7, 5))])
    monkeypatch.setattr(ctypes, "CDLL", lambda name: library if name == "libnvidia-ml.so.1" else pytest.fail(name))
    assert nvml.gpus() == [nvml.GPU(0, H100, "GPU-aaaa", (9, 0)), nvml.GPU(1, "Tesla T4", "GPU-bbbb", (7, 5))]
    assert library.calls == ["init", "shutdown"]
    library.init_rc = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    assert nvml.gpus() is None


def test_without_the_nvml_library_the_reader_answers_none():
    try:
        ctypes.CDLL(nvml.LIBRARY)
    except OSError:
        assert nvml.gpus() is None
    else:
        pytest.skip("this machine has NVML")


@pytest.mark.parametrize("build", ["this torch", "posing as a CUDA build"])
def test_in_a_real_process_detection_and_the_traits_leave_cuda_uninitialised(build):
    """Real torch, real ctypes: posing as a CUDA build, detection runs torch's own NVML count (no NVML here: it falls
    back to torch.cuda.device_count(), which on a CPU build counts 0) and the traits read NVML."""
    pose = "torch.version.cuda = '12.4'; " if build != "this torch" else ""
    code = (f"import torch; {pose}import devshim_cuda; from devshim_cuda import devshim_detect, traits; "
            "report = devshim_detect(); traits.read(); print(report.reason); print(torch.cuda.is_initialized())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False", done.stdout


# -- runtime versions ------------------------------------------------------------------------------------------------

def test_runtime_versions_name_cuda_cudnn_nccl_and_the_driver_read_without_initialising(fake_cuda: FakeCuda,
                                                                                         monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    got = devshim_cuda.devshim_runtime_versions(devshim_cuda.devshim_detect())
    assert got == {"CUDA runtime": "12.4", "cuDNN": "9.1.0", "NCCL": "2.21.5", "driver": "550.54.14"}
    assert fake_cuda.initialising_calls == []


def test_older_packed_version_numbers_and_the_open_kernel_modules_line(fake_cuda: FakeCuda, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 8902)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: 2708)
    monkeypatch.setattr(detect, "NVIDIA_PROC", fake_proc(tmp_path / "open", driver=(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.104.05  Release Build  (dvs-builder@U16)\n")))
    got = versions.runtime_versions()
    assert got == {"CUDA runtime": "12.4", "cuDNN": "8.9.2", "NCCL": "2.7.8", "driver": "535.104.05"}
    assert versions.nccl_version() == "2.7.8" and versions._dotted(21905, new_scheme_from=20900) == "2.19.5"


def test_what_cannot_be_read_is_left_out_and_rocm_names_hip_and_rccl(fake_cuda: FakeCuda, monkeypatch, tmp_path):
    def unreadable() -> Any:
        raise AttributeError("module 'torch._C' has no attribute '_nccl_version'")

    monkeypatch.setattr(torch.cuda.nccl, "version", unreadable)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: None)
    monkeypatch.setattr(detect, "NVIDIA_PROC", tmp_path / "none")
    assert versions.runtime_versions() == {"CUDA runtime": "12.4"}
    fake_cuda.rocm("6.2.41133")
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 20, 5, "-rocm"))
    (tmp_path / "amdgpu").mkdir()
    (tmp_path / "amdgpu" / "version").write_text("6.8.5\n")
    assert versions.runtime_versions() == {"HIP": "6.2.41133", "RCCL": "2.20.5--rocm", "driver": "6.8.5"}


def test_runtime_versions_on_this_torch_are_strings_to_strings_or_none():
    got = devshim_cuda.devshim_runtime_versions(devshim_cuda.devshim_detect())
    assert got is None or (got and all(isinstance(k, str) and isinstance(v, str) and v for k, v in got.items()))


# -- the allocator's settings ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [
    "", "expandable_segments:True", " max_split_size_mb : 128 , garbage_collection_threshold:0.6 ",
    "roundup_power2_divisions:[256:1,512:2,1024:4,>:8],max_non_split_rounding_mb:20", "roundup_power2_divisions:4",
    "backend:cudaMallocAsync", "backend:native,pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
    "release_lock_on_hipmalloc:False,per_process_memory_fraction:0.5,pinned_reserve_segment_size_mb:0",
])
def test_settings_torch_accepts_are_accepted(value):
    allocator.validate_config(value)


def test_a_key_devshim_does_not_know_is_left_to_torch_so_a_newer_torchs_keys_are_never_refused():
    allocator.validate_config("a_key_from_torch_2_20:True,expandable_segments:True")


@pytest.mark.parametrize(("value", "message"), [
    ("expandable_segments:true", "expandable_segments:true is invalid: expandable_segments takes True or False"),
    ("max_split_size_mb:10", "max_split_size_mb takes a size in MB of at least 20"),
    ("garbage_collection_threshold:1.5", "garbage_collection_threshold takes a fraction strictly between 0 and 1"),
    ("roundup_power2_divisions:3", "roundup_power2_divisions:3 is invalid"),
    ("roundup_power2_divisions:[256:3,>:8]", r"roundup_power2_divisions:\[256:3,>:8\] is invalid"),
    ("roundup_power2_divisions:[256:1", r"opens a '\[' it never closes"),
    ("pinned_num_register_threads:256", "a power of 2 up to 128"),
    ("backend:async", "backend takes native or cudaMallocAsync"),
    ("expandable_segments", r"'expandable_segments' is not key:value \(e\.g\. expandable_segments:True\)"),
])
def test_settings_torch_refuses_are_refused_saying_what_the_key_takes(value, message):
    with pytest.raises(ValueError, match=message):
        allocator.validate_config(value)


# -- attention -------------------------------------------------------------------------------------------------------

TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-4}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
B, HQ, D = 2, 4, 8


def leaves(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def assert_forward_and_backward(ours: torch.Tensor, inputs: list[torch.Tensor], expected_fn: Any,
                                dtype: torch.dtype) -> None:
    """``ours`` and the gradients of ``inputs`` agree with ``expected_fn`` run in fp64 on the same inputs."""
    grad_out = torch.randn(ours.shape, generator=torch.Generator().manual_seed(7)).to(ours.dtype)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    expected = expected_fn(*ref_inputs)
    torch.testing.assert_close(ours, expected.to(ours.dtype), **TOL[dtype])
    got = torch.autograd.grad(ours, inputs, grad_out)
    want = torch.autograd.grad(expected, ref_inputs, grad_out.double())
    for g, w in zip(got, want, strict=True):
        atol = TOL[dtype]["atol"] * max(1.0, w.abs().max().item())
        torch.testing.assert_close(g, w.to(g.dtype), atol=atol, rtol=TOL[dtype]["rtol"])


ATTENTION_CASES = ["none", "keep_mask", "masked_mask", "integer_mask", "padding_mask", "additive_mask",
                   "causal_top_left", "causal_bottom_right", "causal_and_mask", "gqa_causal"]


def _case(case: str) -> tuple[dict[str, Any], dict[str, Any], int, int, int]:
    """(options for ``attention``, keyword arguments for the fp64 reference, s_q, s_kv, key/value heads)."""
    s_q, s_kv = (6, 10) if case in ("keep_mask", "masked_mask", "causal_bottom_right", "causal_and_mask") else (6, 6)
    keep = torch.rand(B, 1, s_q, s_kv, generator=torch.Generator().manual_seed(3)) > 0.4
    keep[..., 0] = True
    options: dict[str, Any] = {}
    ref: dict[str, Any] = {}
    if case == "none":
        options["scale"] = ref["scale"] = 0.37
    elif case == "keep_mask":
        options["attn_mask"], ref["keep"] = keep, keep
    elif case == "masked_mask":  # Ascend's polarity, 2-D
        options.update(attn_mask=~keep[0, 0], mask_true_means_masked=True)
        ref["keep"] = keep[0, 0]
    elif case == "integer_mask":
        options.update(attn_mask=(~keep).to(torch.uint8), mask_true_means_masked=True)
        ref["keep"] = keep
    elif case == "padding_mask":
        options["attn_mask"], ref["keep"] = keep[:, :, :1, :], keep[:, :, :1, :]
    elif case == "additive_mask":
        bias = torch.randn(1, 1, s_q, s_kv, generator=torch.Generator().manual_seed(4))
        options["attn_mask"], ref["bias"] = bias, bias
    elif case in ("causal_top_left", "gqa_causal"):
        options["causal"] = ref["causal"] = True
    elif case == "causal_bottom_right":
        options.update(causal=True, causal_alignment="bottom_right")
        ref.update(causal=True, alignment="bottom_right")
    elif case == "causal_and_mask":
        options.update(causal=True, causal_alignment="bottom_right", attn_mask=keep)
        ref.update(causal=True, alignment="bottom_right", keep=keep)
    return options, ref, s_q, s_kv, 2 if case == "gqa_causal" else HQ


@DTYPES
@pytest.mark.parametrize("case", ATTENTION_CASES)
@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
def test_attention_in_every_dense_layout_is_the_math_in_fp64_forward_and_backward(layout, case, dtype):
    options, ref, s_q, s_kv, hkv = _case(case)
    if dtype == torch.bfloat16 and "attn_mask" in options and options["attn_mask"].is_floating_point():
        options["attn_mask"] = options["attn_mask"].bfloat16()
        ref["bias"] = options["attn_mask"]
    q, k, v = (from_bnsd(t.detach(), layout).requires_grad_()
               for t in leaves((B, HQ, s_q, D), (B, hkv, s_kv, D), (B, hkv, s_kv, D), dtype=dtype))
    out = kernels.attention(q, k, v, layout=layout, num_heads=HQ if layout in ("BSH", "SBH") else None, **options)
    assert out.shape == q.shape and out.dtype == dtype

    def expected(q, k, v):
        return from_bnsd(attention_reference(*(to_bnsd(t, layout, D) for t in (q, k, v)), **ref), layout)

    assert_forward_and_backward(out, [q, k, v], expected, dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_query_that_may_attend_to_no_key_gives_zeros_and_zero_gradient(causal):
    q, k, v = leaves(*[(1, 1, 4, 8)] * 3)
    keep = torch.ones(4, 4, dtype=torch.bool)
    keep[2] = False
    keep[0, 0] = False  # with causal, query 0 sees only key 0: nothing left
    out = kernels.attention(q, k, v, attn_mask=keep, causal=causal)
    (dq, dk, dv) = torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
    empty = [0, 2] if causal else [2]
    assert torch.equal(out[0, 0, empty], torch.zeros(len(empty), 8))
    assert torch.equal(dq[0, 0, empty], torch.zeros(len(empty), 8))
    assert bool(torch.isfinite(dk).all() and torch.isfinite(dv).all())
    assert_forward_and_backward(out, [q, k, v], lambda q, k, v: attention_reference(q, k, v, keep=keep, causal=causal),
                                torch.float32)


def test_bottom_right_causal_with_more_queries_than_keys_zeroes_the_queries_before_the_first_key():
    q, k, v = leaves((1, 2, 7, 8), (1, 2, 4, 8), (1, 2, 4, 8))
    out = kernels.attention(q, k, v, causal=True, causal_alignment="bottom_right")
    assert torch.equal(out[:, :, :3], torch.zeros(1, 2, 3, 8))
    assert_forward_and_backward(out, [q, k, v], lambda q, k, v: attention_reference(
        q, k, v, causal=True, alignment="bottom_right"), torch.float32)


def per_sequence(q, k, v, lengths_q, lengths_kv, **ref):
    outs, sq, sk = [], 0, 0
    for lq, lk in zip(lengths_q, lengths_kv, strict=True):
        bnsd = [t.transpose(0, 1)[None] for t in (q[sq:sq + lq], k[sk:sk + lk], v[sk:sk + lk])]
        empty = q.new_zeros(lq, *q.shape[1:])
        outs.append(attention_reference(*bnsd, **ref)[0].transpose(0, 1) if lq and lk else empty)
        sq, sk = sq + lq, sk + lk
    return torch.cat(outs)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("spelling", ["leading_zero", "ascend"])
def test_packed_tnd_sequences_of_different_lengths_attend_within_themselves(spelling, alignment):
    len_q, len_kv = [3, 5, 0, 2, 1], [5, 5, 0, 2, 0]  # an empty sequence, and queries without keys: zeros
    q, k, v = leaves((sum(len_q), 4, 8), (sum(len_kv), 2, 8), (sum(len_kv), 2, 8))

    def cu(lengths):
        ends = torch.tensor(lengths).cumsum(0)
        return ends if spelling == "ascend" else torch.cat((torch.zeros(1, dtype=ends.dtype), ends))

    out = kernels.attention(q, k, v, layout="TND", causal=True, causal_alignment=alignment, cu_seqlens_q=cu(len_q),
                            cu_seqlens_kv=cu(len_kv).tolist())
    assert torch.equal(out[-1], torch.zeros(4, 8))
    assert_forward_and_backward(out, [q, k, v], lambda q, k, v: per_sequence(
        q, k, v, len_q, len_kv, causal=True, alignment=alignment), torch.float32)


def test_packed_tnd_of_equal_lengths_is_the_batched_attention():
    q, k, v = leaves(*[(3, 6, 2, 8)] * 3)  # BSND
    packed = [t.flatten(0, 1) for t in (q, k, v)]
    out = kernels.attention(*packed, layout="TND", causal=True, cu_seqlens_q=torch.tensor([0, 6, 12, 18]))
    torch.testing.assert_close(out, kernels.attention(q, k, v, layout="BSND", causal=True).flatten(0, 1))


def test_dropout_p_is_the_drop_probability_and_a_seed_reproduces_it():
    q, k = leaves((2, 2, 64, 16), (2, 2, 16, 16))
    v = torch.eye(16).expand(2, 2, 16, 16).contiguous()

    def draw(seed):
        torch.manual_seed(seed)
        return kernels.attention(q, k, v, dropout_p=0.8)

    out = draw(1)
    zeros = (out == 0).float().mean().item()
    assert 0.7 < zeros < 0.9, f"{zeros:.0%} dropped with dropout_p=0.8"
    assert torch.equal(out, draw(1)) and not torch.equal(out, draw(2))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"layout": "NSD"}, "unknown layout 'NSD'"),
    ({"layout": "BSH"}, "layout BSH needs num_heads"),
    ({"dropout_p": 1.0}, r"dropout_p must be in \[0, 1\)"),
    ({"causal_alignment": "center"}, "causal_alignment must be"),
    ({"layout": "TND"}, "layout TND needs cu_seqlens_q"),
    ({"layout": "TND", "cu_seqlens_q": [0, 4], "attn_mask": torch.ones(4, 4, dtype=torch.bool)}, "takes no attn_mask"),
    ({"layout": "TND", "cu_seqlens_q": [0, 3]}, "cu_seqlens_q ends at 3 but the tensor holds 4 tokens"),
    ({"num_heads": 3}, "num_heads=3 but q in layout BNSD has"),
])
def test_bad_arguments_are_refused_with_a_reason(kwargs, message):
    q = torch.randn(4, 2, 8) if kwargs.get("layout") in ("TND", "BSH") else torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=message):
        kernels.attention(q, q, q, **kwargs)


# -- rms_norm, swiglu, rotary ----------------------------------------------------------------------------------------

@DTYPES
@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "no_weight"])
def test_rms_norm_is_the_math_in_fp64(weighted, dtype):
    x, w = leaves((3, 5, 64), (64,), dtype=dtype)
    inputs = [x, w] if weighted else [x]
    out = kernels.rms_norm(x, w if weighted else None, 1e-5)
    assert out.dtype == dtype
    assert_forward_and_backward(out, inputs, lambda x, w=None: rms_math(x, w, 1e-5), dtype)


def test_rms_norm_keeps_its_statistics_in_fp32_and_promotes_to_an_fp32_weight():
    x = (torch.randn(4, 256, generator=torch.Generator().manual_seed(0)) * 300).bfloat16()
    xf = x.float()
    assert torch.equal(kernels.rms_norm(x, None, 1e-6), (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))
                       .bfloat16())
    w = torch.randn(256)
    out = kernels.rms_norm(x, w, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, kernels.rms_norm(x, None, 1e-6).float() * w)
    with pytest.raises(ValueError, match="does not match the last dimension"):
        kernels.rms_norm(x, torch.ones(8), 1e-6)


@DTYPES
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "transposed"])
def test_swiglu_is_silu_of_the_first_half_times_the_second(strided, dtype):
    (x,) = leaves((16, 3, 4) if strided else (4, 3, 16), dtype=dtype)

    def view(t):
        return t.transpose(0, 2) if strided else t

    out = kernels.swiglu(view(x))
    assert_forward_and_backward(out, [x], lambda x: swiglu_math(view(x)), dtype)
    with pytest.raises(ValueError, match="even last dimension"):
        kernels.swiglu(torch.randn(2, 5))


ROTARY = {"SBND": ((6, B, HQ, D), (6, 1, 1)), "BSND": ((B, 6, HQ, D), (1, 6, 1)),
          "BNSD-11SD": ((B, HQ, 6, D), (1, 1, 6)), "BNSD-SD": ((B, HQ, 6, D), (6,))}


@DTYPES
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("layout", list(ROTARY))
def test_rotary_is_x_cos_plus_rotated_x_sin_on_the_first_channels(layout, interleaved, partial, dtype):
    shape, lead = ROTARY[layout]
    angles = torch.rand(*lead, D // 2 if partial else D, generator=torch.Generator().manual_seed(5))
    cos, sin = angles.cos(), angles.sin()
    (x,) = leaves(shape, dtype=dtype)
    out = kernels.rotary(x, cos, sin, interleaved=interleaved)
    assert out.dtype == dtype and out.shape == x.shape
    if partial:
        assert torch.equal(out[..., D // 2:], x[..., D // 2:])
    assert_forward_and_backward(out, [x], lambda x: rotary_math(x, cos.double(), sin.double(), interleaved), dtype)


@pytest.mark.parametrize(("cos_shape", "sin_shape", "message"), [
    ((6, 1, 1, 7), (6, 1, 1, 7), "need an even count"), ((6, 1, 1, 10), (6, 1, 1, 10), "need an even count that fits"),
    ((6, 1, 1, 8), (6, 1, 1, 4), "differ in shape"), ((5, 1, 1, 8), (5, 1, 1, 8), "do not broadcast"),
])
def test_rotary_refuses_tables_that_do_not_fit(cos_shape, sin_shape, message):
    with pytest.raises(ValueError, match=message):
        kernels.rotary(torch.randn(6, 2, 4, 8), torch.randn(cos_shape), torch.randn(sin_shape))


# -- masked_softmax, wgrad_accumulate --------------------------------------------------------------------------------

def softmax_math(scores, masked, scale, causal):
    """Megatron's fill (-10000 after scaling), fp64; a row with every key masked is zeros."""
    x = scores.double() * scale
    s_q, s_k = x.shape[-2:]
    full = torch.zeros(x.shape, dtype=torch.bool)
    if masked is not None:
        full = full | masked
    if causal:
        full = full | torch.ones(s_q, s_k, dtype=torch.bool).triu(1)
    probs = x.masked_fill(full, -10000.0).softmax(-1)
    return probs.masked_fill(full.all(-1, keepdim=True), 0.0)


@DTYPES
@pytest.mark.parametrize("case", ["no_mask", "padding_mask", "integer_mask", "causal", "causal_and_mask",
                                  "fully_masked_row"])
def test_masked_softmax_is_megatrons_softmax_in_fp64(case, dtype):
    gen = torch.Generator().manual_seed(11)
    masked = None
    if case in ("padding_mask", "causal_and_mask", "integer_mask"):
        masked = torch.rand(2, 1, 1, 7, generator=gen) > 0.7
    elif case == "fully_masked_row":
        masked = torch.zeros(2, 1, 5, 7, dtype=torch.bool)
        masked[:, :, 2] = True
    mask = masked.to(torch.uint8) if case == "integer_mask" else masked
    (scores,) = leaves((2, 3, 5, 7), dtype=dtype)
    causal = case.startswith("causal")
    out = kernels.masked_softmax(scores, mask, 0.5, causal=causal)
    assert out.dtype == dtype
    if case == "fully_masked_row":
        assert torch.equal(out[:, :, 2], torch.zeros(2, 3, 7, dtype=dtype))
        (grad,) = torch.autograd.grad((out * torch.randn(out.shape).to(dtype)).sum(), scores, retain_graph=True)
        assert torch.equal(grad[:, :, 2], torch.zeros(2, 3, 7, dtype=dtype))
    assert_forward_and_backward(out, [scores], lambda s: softmax_math(s, masked, 0.5, causal), dtype)
    with pytest.raises(ValueError, match="boolean mask"):
        kernels.masked_softmax(scores, torch.zeros(1, 1, 5, 7), 0.5)


@pytest.mark.parametrize(("operands", "main"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
                         ids=["fp32", "bf16_into_fp32", "bf16_into_bf16", "fp16_into_fp16"])
def test_wgrad_accumulate_adds_the_fp32_sum_of_products_rounded_once(operands, main):
    gen = torch.Generator().manual_seed(2)
    x, dy = torch.randn(3, 5, 16, generator=gen).to(operands), torch.randn(3, 5, 8, generator=gen).to(operands)
    start = torch.randn(8, 16, generator=gen).to(main)
    expected = (start.double() + dy.reshape(-1, 8).double().t() @ x.reshape(-1, 16).double()).to(main)
    got = start.clone()
    assert kernels.wgrad_accumulate(x, dy, got) is None
    if main == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:  # one rounding of the exact sum: at most one unit in the last place away
        ulp = torch.finfo(main).eps * expected.abs().float().clamp_min(torch.finfo(main).tiny)
        assert ((got.float() - expected.float()).abs() <= ulp).all()
    with pytest.raises(ValueError, match="is not \\[out, in\\]"):
        kernels.wgrad_accumulate(x, dy, torch.zeros(16, 8, dtype=main))


# -- fused Adam ------------------------------------------------------------------------------------------------------

HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}
SHAPES = [(7, 5), (33,), (4, 3, 2)]


def _state(dtype=torch.float32, state_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    return params, [torch.zeros(p.shape, dtype=state_dtype or dtype) for p in params], \
        [torch.zeros(p.shape, dtype=state_dtype or dtype) for p in params]


def _grads(step, dtype=torch.float32):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
def test_fused_adamw_follows_torch_optim_over_several_steps(adamw_mode, amsgrad, monkeypatch):
    calls = []
    kernel = "_fused_adamw_" if adamw_mode else "_fused_adam_"
    original = getattr(torch, kernel)
    monkeypatch.setattr(torch, kernel, lambda *a, **k: calls.append(kernel) or original(*a, **k))
    params, avgs, sqs = _state()
    maxima = [torch.zeros_like(p) for p in params] if amsgrad else None
    reference = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)(
        reference, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"], amsgrad=amsgrad)
    for step in range(1, 7):
        grads = _grads(step)
        for p, g in zip(reference, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
        kernels.fused_adamw(params, grads, avgs, sqs, step=step, adamw_mode=adamw_mode, bias_correction=True,
                            max_exp_avg_sqs=maxima, **HYPER)
    for ours, theirs in zip(params, reference, strict=True):
        torch.testing.assert_close(ours, theirs.detach(), atol=1e-6, rtol=1e-5)
    assert calls == [kernel] * 6  # one multi-tensor call per step


def written_out(p, g, m, v, *, step, adamw_mode, bias_correction, lr, beta1, beta2, eps, weight_decay):
    """The update in fp64 from the formula (bias corrections 1 when off)."""
    p, g, m, v = p.double(), g.double(), m.double(), v.double()
    if not adamw_mode:
        g = g + weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = (1 - beta1 ** step, 1 - beta2 ** step) if bias_correction else (1.0, 1.0)
    if adamw_mode:
        p = p * (1 - lr * weight_decay)
    return p - lr / bc1 * m / (v.sqrt() / math.sqrt(bc2) + eps), m, v


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
def test_without_bias_correction_the_update_is_the_formula_with_corrections_of_one(adamw_mode):
    params, avgs, sqs = _state()
    expected = [(p.double(), m.double(), v.double()) for p, m, v in zip(params, avgs, sqs, strict=True)]
    for step in range(1, 6):
        grads = _grads(step)
        kernels.fused_adamw(params, grads, avgs, sqs, step=step, adamw_mode=adamw_mode, bias_correction=False, **HYPER)
        expected = [written_out(p, g, m, v, step=step, adamw_mode=adamw_mode, bias_correction=False, **HYPER)
                    for (p, m, v), g in zip(expected, grads, strict=True)]
    for ours, (p, m, v) in zip(zip(params, avgs, sqs, strict=True), expected, strict=True):
        for got, want in zip(ours, (p, m, v), strict=True):
            torch.testing.assert_close(got, want.float(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_param_copies_receive_the_updated_params_as_copy_converts_them_and_none_entries_are_skipped(dtype):
    params, avgs, sqs = _state()
    copies = [torch.zeros(p.shape, dtype=dtype) for p in params]
    copies[1] = None
    kernels.fused_adamw(params, _grads(1), avgs, sqs, step=1, adamw_mode=True, bias_correction=True,
                        param_copies=copies, **HYPER)
    for p, c in zip(params, copies, strict=True):
        if c is not None:
            assert torch.equal(c, p.to(dtype))


def test_mixed_dtypes_and_strided_tensors_take_the_written_out_update_in_fp32_rounded_once():
    params, avgs, sqs = _state(dtype=torch.bfloat16, state_dtype=torch.float32)
    wide = torch.randn(10, 6)
    strided = wide[:, ::2]  # a non-contiguous fp32 param among them
    params.append(strided)
    avgs.append(torch.zeros(10, 3))
    sqs.append(torch.zeros(10, 3))
    expected = [(p.double(), m.double(), v.double()) for p, m, v in zip(params, avgs, sqs, strict=True)]
    for step in (1, 2, 3):
        grads = [*_grads(step, torch.float32), torch.randn(10, 3)]
        kernels.fused_adamw(params, grads, avgs, sqs, step=step, adamw_mode=True, bias_correction=True, **HYPER)
        expected = [written_out(p.to(q.dtype).double(), g, m, v, step=step, adamw_mode=True, bias_correction=True,
                                **HYPER) for (p, m, v), g, q in zip(expected, grads, params, strict=True)]
    for param, (p, _, _) in zip(params, expected, strict=True):
        torch.testing.assert_close(param, p.to(param.dtype), **TOL[param.dtype])
    assert torch.equal(wide[:, ::2], params[-1])  # written back through the view


def test_fused_adamw_refuses_step_zero_and_lists_of_different_lengths():
    params, avgs, sqs = _state()
    with pytest.raises(ValueError, match="step must be >= 1"):
        kernels.fused_adamw(params, _grads(1), avgs, sqs, step=0, adamw_mode=True, bias_correction=True, **HYPER)
    with pytest.raises(ValueError, match="2 grads for 3 params"):
        kernels.fused_adamw(params, _grads(1)[:2], avgs, sqs, step=1, adamw_mode=True, bias_correction=True, **HYPER)
