"""Spec: what the hook specs promise about a selected plugin's answers holds once devshim activates on it.

Each spec activates devshim in this pytest process on an in-process plugin (``session.activate(environ,
extra_plugins=...)``), then restores the suite's own session. Covered here: a plugin without optimizer kernels
makes DeepSpeed's FusedAdam/CPUAdam refuse instead of compiling them; a plugin's ``devshim_patches`` list is
applied as one version-gated set, all or nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import sys
import types
from collections.abc import Iterator

# isort: off
import devshim_core.auto  # noqa: F401  (activates devshim in this pytest process, before deepspeed)
import deepspeed

# isort: on
import jit_watch
import pytest
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from plugin_fixtures import FakePlugin, only

from devshim_core import CollectivesSpec, DeviceReport, OffloadIO, OptimizerKernels, hookimpl, session
from devshim_core.device import build_device
from devshim_core.errors import PatchError, PluginError
from devshim_core.patching import REGISTRY, Patch, Requirement, SetAttribute
from devshim_core.plugins import discover
from devshim_core.selection import select

PLUGIN = "under_test"
PYTEST = pytest.__version__
_modules = itertools.count()

# -- no JIT compilation while this module runs ---------------------------------------------------------------------

jit_compilations = jit_watch.fixture()


@contextlib.contextmanager
def activated_on(plugin: object) -> Iterator[session.Session]:
    """devshim activated with ``plugin`` forced (as ``under_test``); afterwards an equivalent of the suite's session
    is back (a new Session object: ``devshim_core.auto.session`` still names the first one)."""
    had_session = session.current() is not None
    session.deactivate()
    try:
        yield session.activate({"DEVSHIM_PLUGIN": PLUGIN}, extra_plugins=[(PLUGIN, plugin)])
    finally:
        session.deactivate()
        if had_session:
            session.activate()  # as `import devshim_core.auto` made it (same environment)


@pytest.fixture
def target_module(monkeypatch) -> types.ModuleType:
    """A throwaway module for vendor patches to change, with ``f`` set to ``"original"``."""
    module = types.ModuleType(f"devshim_hook_contract_target_{next(_modules)}")
    module.f = "original"
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


# -- optimizer kernels ---------------------------------------------------------------------------------------------


class AnswersNoOptimizerKernels(FakePlugin):
    @hookimpl
    def devshim_optimizer_kernels(self, report: DeviceReport) -> None:
        return None


class AnswersEmptyOptimizerKernels(FakePlugin):
    @hookimpl
    def devshim_optimizer_kernels(self, report: DeviceReport) -> OptimizerKernels:
        return OptimizerKernels()


def refusal(op: str, kernel: str) -> str:
    return (f"DeepSpeed op {op!r} is not available through devshim plugin {PLUGIN!r}: the plugin provides no "
            f"{kernel} kernel. devshim never JIT-compiles DeepSpeed ops.")


@pytest.mark.parametrize("plugin_class", [AnswersNoOptimizerKernels, AnswersEmptyOptimizerKernels],
                         ids=["answers-None", "answers-all-None"])
def test_without_optimizer_kernels_deepspeeds_adam_builders_refuse_naming_the_plugin(plugin_class):
    with activated_on(plugin_class(priority=1)) as active:
        # the installed cpu_reference plugin has every kernel, but a forced plugin is the only one loaded: another
        # plugin's answers cannot fill in
        assert active.registry.records["cpu_reference"].plugin is None
        assert active.device.optimizer == OptimizerKernels()
        for builder_name, op, kernel in (("FusedAdamBuilder", "fused_adam", "fused AdamW"),
                                         ("CPUAdamBuilder", "cpu_adam", "host Adam")):
            imported = getattr(deepspeed.ops.op_builder, builder_name)()
            created = get_accelerator().create_op_builder(builder_name)
            for builder in (imported, created):
                assert builder.is_compatible() is False
                for load in (builder.load, builder.jit_load):
                    with pytest.raises(RuntimeError) as excinfo:
                        load()
                    assert str(excinfo.value) == refusal(op, kernel)


def test_without_optimizer_kernels_fused_adam_and_cpu_adam_cannot_be_created(monkeypatch):
    import cpuinfo

    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: {})  # DeepSpeedCPUAdam asks it first; it takes seconds
    params = [torch.nn.Parameter(torch.zeros(3))]
    with activated_on(AnswersNoOptimizerKernels(priority=1)):
        with pytest.raises(RuntimeError) as fused:
            FusedAdam(params)
        assert str(fused.value) == refusal("fused_adam", "fused AdamW")
        with pytest.raises(RuntimeError) as host:
            DeepSpeedCPUAdam(params)
        assert str(host.value) == "DeepSpeedCPUAdam requires the cpu_adam op, which failed to build/load."
        assert str(host.value.__cause__) == refusal("cpu_adam", "host Adam")


class AnswersNoOffloadIO(FakePlugin):
    @hookimpl
    def devshim_optimizer_kernels(self, report: DeviceReport) -> OptimizerKernels:
        import devshim_kernels

        return OptimizerKernels(host_adam_step=devshim_kernels.host_adam_step)

    @hookimpl
    def devshim_offload_io(self, report: DeviceReport) -> OffloadIO:
        return OffloadIO(file_io=None, source="unavailable: built without a C compiler")


def test_without_offload_file_io_zero_infinity_to_nvme_refuses_at_engine_creation_naming_the_plugin(tmp_path,
                                                                                                    monkeypatch):
    for name, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}.items():  # as a launcher sets them
        monkeypatch.setenv(name, value)
    with activated_on(AnswersNoOffloadIO(priority=1)):
        builder = deepspeed.ops.op_builder.AsyncIOBuilder()
        assert builder.is_compatible() is False
        with pytest.raises(RuntimeError) as excinfo:
            builder.load()
        assert str(excinfo.value) == (
            f"DeepSpeed op 'async_io' is not available through devshim plugin {PLUGIN!r}: the plugin provides no "
            "asynchronous file I/O (unavailable: built without a C compiler). devshim never JIT-compiles "
            "DeepSpeed ops.")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                                                              "nvme_path": str(tmp_path)}}}
            with pytest.raises(RuntimeError, match="'async_io' is not available through devshim plugin"):
                deepspeed.initialize(model=torch.nn.Linear(4, 4), config=config)
        finally:
            dist.destroy_process_group()


def test_the_suites_session_is_back_and_serves_the_adam_ops_again():
    """Guards the specs above: they leave the process as ``import devshim_core.auto`` made it."""
    active = session.current()
    assert active is not None and active.device.plugin == "cpu_reference"
    assert get_accelerator()._devshim_device is active.device
    assert deepspeed.ops.op_builder.FusedAdamBuilder().is_compatible() is True


# -- vendor patches ------------------------------------------------------------------------------------------------


class DeclaresPatches(FakePlugin):
    def __init__(self, patches: list[Patch] | None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.patches = patches

    @hookimpl
    def devshim_patches(self, report: DeviceReport) -> list[Patch] | None:
        return self.patches


def narrowing(module: types.ModuleType, *requires: Requirement) -> SetAttribute:
    return SetAttribute(name="narrow-f", target=f"{module.__name__}:f", make=lambda original, device: "narrowed",
                        reason="the device has no wide f", requires=requires)


def test_a_plugins_patches_are_applied_as_one_set_and_reported_with_their_version_range(target_module):
    patch = narrowing(target_module, Requirement("pytest", f">={PYTEST}"))
    with activated_on(DeclaresPatches([patch], priority=1)) as active:
        assert active.device.patches == (patch,)
        assert target_module.f == "narrowed"
        assert f"plugin-{PLUGIN}" in active.integrations
        [row] = [row for row in REGISTRY.report() if row["set"] == f"plugin-{PLUGIN}"]
        assert (row["name"], row["requires"], row["versions"]) == ("narrow-f", {"pytest": f">={PYTEST}"},
                                                                   {"pytest": PYTEST})
    assert target_module.f == "original"  # deactivation reverted it


@pytest.mark.parametrize(("requires", "unmet"), [
    ((Requirement("pytest", f"<{PYTEST}"),), f"supports pytest <{PYTEST}, but pytest {PYTEST} is installed"),
    ((Requirement("devshim-no-such-distribution", ">=1"),),
     "supports devshim-no-such-distribution >=1, but devshim-no-such-distribution is not installed"),
], ids=["other-version", "not-installed"])
def test_a_plugin_patch_whose_range_is_not_met_stops_activation_and_leaves_nothing_applied(target_module, requires,
                                                                                           unmet):
    other = SetAttribute(name="in-range", target=f"{target_module.__name__}:g", make=lambda original, device: 1,
                         reason="applies anywhere")
    plugin = DeclaresPatches([other, narrowing(target_module, *requires)], priority=1)
    with pytest.raises(PatchError) as excinfo, activated_on(plugin):
        pass
    assert str(excinfo.value) == (f"cannot apply devshim's 'plugin-{PLUGIN}' patches: patch 'narrow-f' "
                                  f"({target_module.__name__}:f) {unmet}.")
    assert target_module.f == "original" and not hasattr(target_module, "g")
    assert not REGISTRY.is_applied(f"plugin-{PLUGIN}")


@pytest.mark.parametrize("answer", [None, []], ids=["None", "empty-list"])
def test_a_plugin_without_patches_gets_no_plugin_patch_set(answer):
    with activated_on(DeclaresPatches(answer, priority=1)) as active:
        assert active.device.patches == ()
        assert f"plugin-{PLUGIN}" not in active.integrations
        assert not REGISTRY.is_applied(f"plugin-{PLUGIN}")


def test_a_plugin_patches_answer_with_an_item_that_is_not_a_patch_is_a_plugin_error(target_module):
    registry = discover(only(PLUGIN), extra=[(PLUGIN, DeclaresPatches([narrowing(target_module), "argmax"]))])
    with pytest.raises(PluginError, match=r"^plugin 'under_test': devshim_patches returned non-Patch items "
                                          r"\['argmax'\]\.$"):
        build_device(registry, select(registry, only(PLUGIN)))


def test_a_plugin_patches_answer_that_is_a_single_patch_not_a_list_is_a_plugin_error(target_module):
    registry = discover(only(PLUGIN), extra=[(PLUGIN, DeclaresPatches(narrowing(target_module)))])
    with pytest.raises(PluginError, match=r"^plugin 'under_test': devshim_patches must return a list of Patch "
                                          r"objects, got \['SetAttribute'\]\.$"):
        build_device(registry, select(registry, only(PLUGIN)))


class PassesInitArguments(FakePlugin):
    """A plugin whose backend needs an ``init_process_group`` argument frameworks never pass."""

    def __init__(self, init_kwargs: dict, **kwargs) -> None:
        super().__init__(**kwargs)
        self.init_kwargs = init_kwargs

    @hookimpl
    def devshim_collectives(self, report: DeviceReport) -> CollectivesSpec:
        return CollectivesSpec("gloo", init_kwargs=self.init_kwargs)


def _default_group_timeout() -> datetime.timedelta:
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout


@pytest.mark.parametrize(("call_kwargs", "expected_s"), [
    pytest.param({}, 77, id="framework-passes-nothing"),
    pytest.param({"timeout": datetime.timedelta(seconds=55)}, 55, id="caller-argument-wins"),
])
def test_collectives_init_kwargs_reach_init_process_group_as_defaults(call_kwargs, expected_s):
    plugin = PassesInitArguments({"timeout": datetime.timedelta(seconds=77)})
    with activated_on(plugin) as active:
        assert active.integrations["torch.distributed"] == "applied (timeout)"
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, **call_kwargs)
        try:
            assert _default_group_timeout() == datetime.timedelta(seconds=expected_s)
        finally:
            dist.destroy_process_group()
    assert not REGISTRY.is_applied("torch.distributed")  # reverted with the session


def test_collectives_init_kwargs_go_only_to_calls_that_choose_the_plugins_backend_or_none():
    from devshim_core.integrations.torch_distributed.plugin_kwargs import _with_plugin_kwargs

    calls: list[tuple[tuple, dict]] = []
    with activated_on(PassesInitArguments({"timeout": 77})) as active:
        wrapped = _with_plugin_kwargs(lambda *args, **kwargs: calls.append((args, kwargs)), active.device)
        wrapped("GLOO")  # the plugin's backend, any spelling
        wrapped()  # none: torch picks the device's
        wrapped(backend="gloo", rank=0)
        wrapped("nccl")  # another backend: untouched
        wrapped(backend="mpi")
    assert calls == [(("GLOO",), {"timeout": 77}), ((None,), {"timeout": 77}),
                     (("gloo",), {"rank": 0, "timeout": 77}), (("nccl",), {}), (("mpi",), {})]


def test_a_plugin_without_init_kwargs_leaves_init_process_group_alone():
    with activated_on(FakePlugin(priority=1)) as active:
        assert "torch.distributed" not in active.integrations
        assert not REGISTRY.is_applied("torch.distributed")
        # the CUDA redirect maps backend='nccl' and every job checks its ranks agree on the plugin (sets of their
        # own); no other devshim wrapper is around torch's function
        wrappers = {row["set"] for row in REGISTRY.report() if "init_process_group" in row["target"]}
        assert wrappers == {"cuda-redirect", "torch.distributed-agreement"}
        for function in (dist.init_process_group, dist.distributed_c10d.init_process_group):
            assert not hasattr(function.__devshim_original__.__devshim_original__, "__devshim_original__")


# -- last: nothing above compiled anything -------------------------------------------------------------------------

def test_nothing_was_jit_compiled_while_this_module_ran(jit_compilations):
    jit_watch.assert_nothing_compiled(jit_compilations)
