"""Every change devshim makes to DeepSpeed, declared in one place."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devshim_core.device import Device
from devshim_core.distributions import installed_version
from devshim_core.integrations.deepspeed.one_pass_offload import STAGE_1_AND_2_MODULE, one_pass_step
from devshim_core.integrations.deepspeed.optimizer_errors import naming_the_group
from devshim_core.patching import PatchSet, RebindReferences, Requirement, SetAttribute, SetAttributes, Undo

_UNKNOWN = ("", "0.0.0")  # what an uninstalled checkout's git_version_info says outside its own folder
_VERSION_LITERAL = re.compile(r"""^[ \t]*version\s*=\s*['"]([^'"]*)['"]\s*(?:#.*)?$""", re.MULTILINE)


def _version_in(source: Path) -> str | None:
    """The version a ``git_version_info`` source assigns as a literal (``version = '0.19.8'``), read without running it;
    a computed one (an uninstalled checkout's ``open('version.txt')``) is not read."""
    try:
        text = source.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    found = [v.strip() for v in _VERSION_LITERAL.findall(text) if v.strip() not in _UNKNOWN]
    return found[-1] if found else None


def running_deepspeed_directory() -> Path | None:
    """The directory of the ``deepspeed`` package that runs: the one imported (or being imported), else the one
    ``import deepspeed`` would load. Found without importing it."""
    module = sys.modules.get("deepspeed")
    if module is not None:
        origin = getattr(module, "__file__", None)
    else:
        try:
            spec = importlib.util.find_spec("deepspeed")
        except (ImportError, ValueError):
            spec = None
        origin = spec.origin if spec is not None else None
    return Path(origin).parent if origin else None


def running_deepspeed() -> str | None:
    """The version of the DeepSpeed code that runs (or will run, before ``import deepspeed``), which wins over the
    installed distribution's metadata: a source checkout on ``sys.path`` (DeepSpeed's own unit tests run that way),
    or any other ``deepspeed`` package shadowing the installed one, runs code the metadata does not describe.

    In order: what the imported package says (``deepspeed.__version__``, its ``git_version_info`` module), then, read
    from the package's files without running them (an import hook fires while ``deepspeed`` is still importing,
    before it has read its version), ``git_version_info_installed.py`` (written by DeepSpeed's ``setup.py``),
    ``git_version_info.py`` and a checkout's ``version.txt``. ``None`` when the code says nothing (the metadata then
    counts)."""
    module = sys.modules.get("deepspeed")
    for said in (getattr(module, "__version__", None),
                 getattr(sys.modules.get("deepspeed.git_version_info"), "version", None)):
        if isinstance(said, str) and said.strip() not in _UNKNOWN:
            return said.strip()
    directory = running_deepspeed_directory()
    if directory is None:
        return None
    for source in (directory / "git_version_info_installed.py", directory / "git_version_info.py"):
        version = _version_in(source)
        if version is not None:
            return version
    checkout_version = directory.parent / "version.txt"  # an uninstalled checkout's, at its root
    try:
        return checkout_version.read_text().strip() or None
    except OSError:
        return None


def installed_metadata_version() -> str | None:
    """What the installed ``deepspeed`` distribution's metadata says, whatever code runs."""
    return installed_version("deepspeed")


def deepspeed_versions(spec: str) -> Requirement:
    return Requirement("deepspeed", spec, running=running_deepspeed)


DEEPSPEED = deepspeed_versions(">=0.16,<0.20")
ACCELERATOR_MODULE = "deepspeed.accelerator.real_accelerator"
OPTIMIZERS_MODULE = "deepspeed.ops.adam"  # imported by `import deepspeed`, after the accelerator


def _make_accelerator(original: Any, device: Device) -> Any:
    from devshim_core.integrations.deepspeed.accelerator import accelerator_class

    accelerator = accelerator_class()(device)
    accelerator._devshim_replaced = original  # what import-time bindings may still point at
    return accelerator


def _deepspeed_namespaces() -> Iterator[dict[str, Any]]:
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "deepspeed" or name.startswith("deepspeed.")):
            yield vars(module)


def _replaced_builders() -> dict[int, Any]:
    """The op-builder classes ``import deepspeed`` bound from the accelerator it had before devshim's, by id."""
    op_builders = sys.modules.get("deepspeed.ops.op_builder")
    if op_builders is None:
        return {}
    return {id(value): value for name, value in vars(op_builders).items()
            if name.endswith("Builder") and name not in ("OpBuilder", "CUDAOpBuilder") and value is not None}


def _stale_pairs(device: Device) -> list[tuple[Any, Any]]:
    """(old, new) for what ``import deepspeed`` bound from the accelerator it had before devshim's."""
    new = sys.modules[ACCELERATOR_MODULE].ds_accelerator
    old: Any = getattr(new, "_devshim_replaced", None)
    if old is None:
        return []
    pairs: list[tuple[Any, Any]] = []
    op_builders = sys.modules.get("deepspeed.ops.op_builder")
    if op_builders is not None:
        replacements: dict[int, tuple[Any, set[Any]]] = {}
        for name, value in vars(op_builders).items():
            if name.endswith("Builder") and name not in ("OpBuilder", "CUDAOpBuilder") and value is not None:
                replacements.setdefault(id(value), (value, set()))[1].add(new.get_op_builder(name))
        for value, news in replacements.values():
            # One old class standing for several names (an accelerator's NotImplementedBuilder): a reference bound
            # under a builder's own name was rebound by that name first (_RebindStaleReferences); any other alias
            # gets the generic refusal, never a wrong op.
            pairs.append((value, news.pop() if len(news) == 1 else new.get_op_builder("NotImplementedBuilder")))
    for namespace in _deepspeed_namespaces():
        for value in namespace.values():
            if inspect.ismethod(value) and value.__self__ is old:
                pairs.append((value, getattr(new, value.__name__)))
            elif (isinstance(value, functools.partial) and value.keywords.get("device_type") == old._name
                  and old._name != new._name):
                pairs.append((value, functools.partial(value.func, *value.args,
                                                       **{**value.keywords, "device_type": new._name})))
    return pairs


@dataclass(frozen=True)
class _RebindStaleReferences(RebindReferences):
    """:class:`RebindReferences`, after rebinding each ``XBuilder`` name that holds a builder of the replaced
    accelerator to devshim's answer for that name: DeepSpeed's accelerators answer many names with one
    NotImplementedBuilder class, which identity alone cannot map back to the op each name stands for."""

    def apply(self, device: Device) -> tuple[Undo, str]:
        pairs = list(self.pairs(device))  # read from the namespaces before the names below change them
        new = sys.modules[ACCELERATOR_MODULE].ds_accelerator
        stale = _replaced_builders() if getattr(new, "_devshim_replaced", None) is not None else {}
        done: list[tuple[dict[str, Any], str, Any]] = []
        for namespace in _deepspeed_namespaces() if stale else ():
            for key, value in list(namespace.items()):
                if key.endswith("Builder") and stale.get(id(value)) is value:
                    namespace[key] = new.get_op_builder(key)
                    done.append((namespace, key, value))
        by_identity = RebindReferences(name=self.name, scope=self.scope, pairs=lambda _device: pairs,
                                       reason=self.reason, requires=self.requires, exclude=self.exclude)
        undo_rest, detail = by_identity.apply(device)

        def undo() -> None:
            undo_rest()
            for namespace, key, value in reversed(done):
                namespace[key] = value

        return undo, f"{len(done)} builder names and {detail}"


DEEPSPEED_PATCHES = PatchSet(
    name="deepspeed",
    requires=(DEEPSPEED,),
    reason="run DeepSpeed on the device of the selected devshim plugin",
    patches=(
        SetAttribute(
            name="accelerator",
            target=f"{ACCELERATOR_MODULE}:ds_accelerator",
            make=_make_accelerator,
            reason="get_accelerator() returns devshim's accelerator (DS_ACCELERATOR only knows in-tree devices)",
        ),
        _RebindStaleReferences(
            name="stale-accelerator-references",
            scope="deepspeed",
            pairs=_stale_pairs,
            reason="import deepspeed binds op-builder classes, accelerator methods and autocast partials from the "
                   "accelerator it auto-detected; without this FusedAdam/CPUAdam would JIT-compile the CPU ops",
        ),
    ),
)


OP_BUILDER_MODULE = "deepspeed.ops.op_builder.builder"  # imported by `import deepspeed`, after the accelerator


def _through_devshims_builders(original: Any, device: Device) -> Any:
    def jit_load(self: Any, verbose: bool = True) -> Any:
        # a DeepSpeed builder class bound without the accelerator (``from deepspeed.ops.op_builder.dc import
        # DeepCompileBuilder``) gets the op devshim serves under its class name, or that name's refusal
        from deepspeed.accelerator import get_accelerator

        from devshim_core.integrations.deepspeed.op_builders import refusal_for

        builder = get_accelerator().create_op_builder(type(self).__name__)
        return (builder if builder is not None else refusal_for(type(self).__name__)()).load(verbose)

    jit_load.__devshim_original__ = original  # type: ignore[attr-defined]  # read by replaced_functions
    return jit_load


NO_JIT_PATCHES = PatchSet(
    name="deepspeed-no-jit",
    requires=(DEEPSPEED,),
    reason="a DeepSpeed op builder reached without devshim's accelerator loads devshim's op or is refused by name, "
           "never compiled",
    patches=(
        SetAttribute(
            name="jit_load", target=f"{OP_BUILDER_MODULE}:OpBuilder.jit_load", make=_through_devshims_builders,
            reason="modules that import a builder class from its own module (deepspeed.compile.util's "
                   "DeepCompileBuilder) bypass get_accelerator().create_op_builder, and OpBuilder.load JIT-compiles "
                   "it (minutes, or a compiler error) on any device"),
    ),
)


def _naming_the_group(originals: dict[str, Any], _device: Device) -> dict[str, Any]:
    return {name: naming_the_group(method) for name, method in originals.items() if method is not None}


OPTIMIZER_PATCHES = PatchSet(
    name="deepspeed-optimizers",
    requires=(DEEPSPEED,),
    reason="a failed Adam kernel call raises, naming its parameter group",
    patches=(
        SetAttributes(
            name="DeepSpeedCPUAdam", target="deepspeed.ops.adam.cpu_adam:DeepSpeedCPUAdam",
            names=("step", "step_subgroup", "rollback_subgroup"), make=_naming_the_group,
            reason="step() discards cpu_adam's return code: devshim's op raises instead, and this names the group "
                   "(ZeRO-Offload steps through here)"),
        SetAttributes(
            name="FusedAdam", target="deepspeed.ops.adam.fused_adam:FusedAdam", names=("step",),
            make=_naming_the_group,
            reason="the fused_adam op's errors name the parameter group the kernel failed on"),
    ),
)


COMPRESSED_BACKEND_MODULE = "deepspeed.runtime.comm.compressed"  # 1-bit Adam/0/1 Adam/1-bit LAMB, until 0.19.6


class _GatherIntoMatchingShapes:
    """``deepspeed.comm`` as the compressed backend sees it: ``all_gather`` reshapes the tensor it sends to the
    receive buffers' shape when only the shape differs."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def all_gather(self, tensor_list: list[Any], tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if tensor_list and tensor.shape != tensor_list[0].shape and tensor.numel() == tensor_list[0].numel():
            tensor = tensor.reshape(tensor_list[0].shape)
        return self._comm.all_gather(tensor_list, tensor, *args, **kwargs)


COMPRESSED_BACKEND_PATCHES = PatchSet(
    name="deepspeed-compressed-backend",
    requires=(deepspeed_versions(">=0.16,<0.19.7"),),
    reason="the 1-bit optimizers' compressed all-reduce runs on any backend",
    patches=(
        SetAttribute(
            name="comm", target=f"{COMPRESSED_BACKEND_MODULE}:dist",
            make=lambda original, device: _GatherIntoMatchingShapes(original),
            reason="compressed_allreduce all-gathers each rank's 0-dim scale into 1-element buffers: NCCL accepts "
                   "that, gloo refuses it ('invalid tensor size')"),
    ),
)


PARAMETERS_MODULE = "deepspeed.runtime.zero.partition_parameters"  # imported by `import deepspeed`


class _OrderedGather:
    """An asynchronous all-gather's handle whose ``wait`` first waits for every all-gather launched before it
    (through the same :class:`_GathersInLaunchOrder`) that nobody has waited for yet."""

    def __init__(self, work: Any, previous: _OrderedGather | None) -> None:
        self._work = work
        self._previous = previous
        self._waited = False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        chain: list[_OrderedGather] = []
        node: _OrderedGather | None = self
        while node is not None and not node._waited:
            chain.append(node)
            node = node._previous
        result = True  # torch's Work.wait() answer, for a gather an earlier wait has already finished
        for node in reversed(chain):  # oldest first
            result = node._work.wait(*args, **kwargs)
            node._waited, node._previous = True, None  # releases the chain's buffers as it goes
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _GathersInLaunchOrder:
    """``deepspeed.comm`` as ZeRO-3's ``partition_parameters`` sees it: waiting for an asynchronous ``all_gather``
    or ``all_gather_into_tensor`` also waits for those launched before it, the order one CUDA stream gives them."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self._last: _OrderedGather | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def _ordered(self, work: Any) -> Any:
        if work is None:  # synchronous: already complete
            return None
        previous = self._last if self._last is not None and not self._last._waited else None
        self._last = _OrderedGather(work, previous)
        return self._last

    def all_gather(self, *args: Any, **kwargs: Any) -> Any:
        return self._ordered(self._comm.all_gather(*args, **kwargs))

    def all_gather_into_tensor(self, *args: Any, **kwargs: Any) -> Any:
        return self._ordered(self._comm.all_gather_into_tensor(*args, **kwargs))


GATHER_ORDER_PATCHES = PatchSet(
    name="deepspeed-zero3-gather-order",
    requires=(deepspeed_versions(">=0.16,<0.19.8"),),
    reason="ZeRO-3's blocking parameter gather (GatheredParameters, save_16bit_model, zero.Init) waits for all of its "
           "all-gathers on a backend that runs them out of order",
    patches=(
        SetAttribute(
            name="comm", target=f"{PARAMETERS_MODULE}:dist",
            make=lambda original, device: _GathersInLaunchOrder(original),
            reason="Init._allgather_params_coalesced launches one async all-gather per parameter and waits for the "
                   "last only, then hands out the torch.empty buffers: on CUDA one stream orders them, gloo runs them "
                   "on independent threads, so a parameter could be read before its gather had filled it (garbage "
                   "weights; DeepSpeed 0.19.8 waits for every handle, deepspeedai/DeepSpeed#8539)"),
    ),
)


ONE_PASS_OFFLOAD_PATCHES = PatchSet(
    name="deepspeed-zero-offload-one-pass",
    requires=(deepspeed_versions(">=0.17,<0.20"),),
    reason="ZeRO-1/2 offload with bf16/fp16 weights reads the fp32 master weights once per step, not twice",
    patches=(
        SetAttribute(
            name="step", target=f"{STAGE_1_AND_2_MODULE}:DeepSpeedZeroOptimizer.step", make=one_pass_step,
            reason="after the host Adam, step() converts each fp32 partition into its pinned bf16/fp16 buffer in a "
                   "second pass; devshim's host Adam writes the buffer in the update's pass (bit for bit the same "
                   "conversion) and the repeated copy is skipped. 0.16 converts on the device instead"),
    ),
)
