"""The CUDA redirect, declared in one place: what a CUDA-written script names, answered on the selected device.

Built from the tables in ``coverage.py`` (which ``devshim check`` reads too), applied as one set, reverted
by the registry. Functions that take no device are never wrapped: they cost exactly what they cost.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from devshim_core.device import Device
from devshim_core.integrations.cuda_redirect import coverage, serialization, wrappers
from devshim_core.integrations.cuda_redirect.cuda_module import nvtx_replacements, refusers, replacements
from devshim_core.integrations.cuda_redirect.device_map import DeviceMap
from devshim_core.integrations.cuda_redirect.tensor_types import tensor_type, typed_tensor_classes
from devshim_core.patching import Patch, PatchSet, RebindReferences, Requirement, SetAttributes, Undo

TORCH = Requirement("torch", ">=2.4,<3")
SET_NAME = "cuda-redirect"

# backend position in each torch.distributed function's signature (None: keyword only)
_BACKEND_POSITION = {"init_process_group": 0, "new_group": 2, "new_subgroups": 3, "new_subgroups_by_enumeration": 2}


def _factories_present() -> tuple[str, ...]:
    return tuple(sorted(n for n in coverage.FACTORIES if n != "set_default_device" and hasattr(torch, n)))


class _Swaps:
    """Every (original, replacement) the set installs, for rebinding copies made by ``from x import f``."""

    def __init__(self) -> None:
        self.pairs: list[tuple[Any, Any]] = []

    def record(self, originals: dict[str, Any], made: dict[str, Any]) -> dict[str, Any]:
        for n, new in made.items():
            old = originals.get(n)
            # down the chain of devshim wrappers too: an alias made before devshim activated holds torch's own
            # object (Megatron's `dist_all_gather_func = torch.distributed.all_gather_into_tensor`), which another
            # set (the collective timeouts) wrapped before this one did
            while old is not None and old is not new:
                self.pairs.append((old, new))
                old = getattr(old, "__devshim_original__", None)
        return made

    def take(self, device: Device) -> list[tuple[Any, Any]]:
        pairs, self.pairs = self.pairs, []
        return pairs


@dataclass(frozen=True)
class RebindWithClassAttributes(RebindReferences):
    """:class:`RebindReferences`, and the attributes of the classes each scanned module defines (one level):
    DeepSpeed's ``OnDevice`` keeps ``_orig_torch_empty = torch.empty`` as a class attribute and puts it back into
    ``torch`` when its block exits, which would undo the redirect of ``torch.empty`` for the rest of the job."""

    def apply(self, device: Device) -> tuple[Undo, str]:
        pairs = list(self.pairs(device))
        undo_modules, detail = RebindReferences(name=self.name, scope=self.scope, pairs=lambda _device: pairs,
                                                reason=self.reason, exclude=self.exclude).apply(device)
        mapping = {id(old): (old, new) for old, new in pairs if old is not new and callable(old)}
        done: list[tuple[type, str, Any]] = []
        for module_name, namespace in self.namespaces():
            for cls in [v for v in list(namespace.values()) if isinstance(v, type) and v.__module__ == module_name]:
                for key, value in list(vars(cls).items()):
                    hit = mapping.get(id(value))
                    if hit is None or hit[0] is not value:
                        continue
                    new = hit[1]
                    # a builtin does not bind as a class attribute; a Python (or descriptor) wrapper would
                    if not hasattr(type(value), "__get__") and hasattr(type(new), "__get__"):
                        new = staticmethod(new)
                    setattr(cls, key, new)
                    done.append((cls, key, value))

        def undo() -> None:
            for cls, key, value in reversed(done):
                setattr(cls, key, value)
            undo_modules()

        return undo, f"{detail}; {len(done)} class attributes rebound"


def patch_set(device: Device) -> PatchSet:
    devices = DeviceMap(device)
    swaps = _Swaps()
    classes = typed_tensor_classes(devices)
    distributed = tuple(_BACKEND_POSITION)

    def each(make: Callable[[str, Any], Any]) -> Any:
        return lambda originals, _device: swaps.record(
            originals, {n: make(n, o) for n, o in originals.items() if o is not None})

    patches: list[Patch] = [
        SetAttributes(
            name="torch.cuda", target="torch.cuda",
            names=tuple(sorted(coverage.DEVICE_FUNCTIONS | coverage.INTERNALS | set(coverage.TENSOR_TYPES))),
            make=lambda originals, _device: swaps.record(
                originals, {**replacements(device, devices), **classes}),
            reason=f"torch.cuda's device, RNG, stream, memory and typed-tensor API answered on {device.type}; its "
                   "lazy seeding runs at once (queued CUDA seeds would silently never reach the device)"),
        SetAttributes(
            name="torch.cuda-refused", target="torch.cuda", names=tuple(sorted(coverage.refused_names())),
            make=lambda originals, _device: swaps.record(originals, refusers(device, originals)),
            reason=f"torch.cuda calls that cannot run on {device.type} (CUDA graphs, the CUDA allocator, NVML, the "
                   "CUDA runtime) raise one error naming the call and what to do, instead of torch's missing-CUDA "
                   "errors"),
        SetAttributes(
            name="torch.cuda.random", target="torch.cuda.random",
            names=("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all", "seed", "seed_all",
                   "initial_seed", "get_rng_state_all", "set_rng_state_all"),
            make=lambda originals, _device: swaps.record(
                originals, {n: replacements(device, devices)[n] for n in originals}),
            reason="Megatron calls torch.cuda.random.get_rng_state directly"),
        SetAttributes(
            name="torch.cuda.nvtx", target="torch.cuda.nvtx", names=tuple(sorted(coverage.NVTX_FUNCTIONS)),
            make=lambda originals, _device: swaps.record(originals, nvtx_replacements()),
            reason="NVTX ranges become profiler ranges (torch.cuda.nvtx raises without CUDA)"),
        SetAttributes(
            name="factories", target="torch", names=_factories_present(),
            make=each(lambda n, o: wrappers.factory(o, devices)),
            reason="tensor factories given device='cuda', 'cuda:N' or N create on the selected device"),
        SetAttributes(
            name="set_default_device", target="torch", names=("set_default_device",),
            make=each(lambda n, o: wrappers.first_argument_device(o, devices)),
            reason="torch.set_default_device('cuda') selects the selected device"),
        SetAttributes(
            name="Tensor", target="torch:Tensor", names=("to", "cuda", "type", "new_empty", "new_zeros", "new_ones",
                                                           "new_full", "new_tensor"),
            make=lambda originals, _device: {
                "to": wrappers.method_to(originals["to"], devices),
                "cuda": wrappers.tensor_cuda(originals["cuda"], devices),
                "type": tensor_type(originals["type"], devices, classes),
                **{n: wrappers.device_keyword(originals[n], devices)
                   for n in ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")}},
            reason="Tensor.to('cuda'/N), .cuda() and .new_*(device='cuda') reach the selected device; .type() "
                   "names its tensors as CUDA does (Megatron's distributed optimizer checks those names)"),
        SetAttributes(
            name="Module", target="torch.nn:Module", names=tuple(sorted(coverage.MODULE_METHODS)),
            # Python wrappers, which torch.compile inlines into a compiled module's code: a native one would
            # break the graph there, and a module move costs far more than either
            make=lambda originals, _device: {
                "to": wrappers.method_to(originals["to"], devices, native=False),
                "cuda": wrappers.module_cuda(originals["cuda"], devices),
                "to_empty": wrappers.device_keyword(originals["to_empty"], devices, native=False)},
            reason="model.cuda() and model.to('cuda'/N) move the model to the selected device"),
        SetAttributes(
            name="Generator", target="torch", names=("Generator",),
            make=each(lambda n, o: wrappers.generator_class(o, devices)),
            reason="torch.Generator(device='cuda') makes the selected device's generator; still a class, and every "
                   "generator (torch.default_generator too) is an instance of it"),
        SetAttributes(
            name="UntypedStorage", target="torch:UntypedStorage", names=("__new__",),
            make=lambda originals, _device: {
                "__new__": staticmethod(wrappers.device_keyword(originals["__new__"], devices, native=False))},
            reason="torch.UntypedStorage(n, device='cuda') allocates on the selected device (TypedStorage's "
                   "constructor calls it)"),
        SetAttributes(
            name="storage.to", target="torch.storage:_StorageBase", names=tuple(sorted(coverage.STORAGE_METHODS)),
            make=lambda originals, _device: {
                n: wrappers.device_keyword(originals[n], devices, native=False) for n in originals},
            reason="storage.to(device='cuda') and storage.cuda(N) (a map_location function's "
                   "`lambda s, loc: s.cuda(1)`) reach the selected device"),
        *serialization.patches(),
        SetAttributes(
            name="autocast", target="torch.amp.autocast_mode:autocast", names=("__init__",),
            make=lambda originals, _device: {"__init__": wrappers.autocast_init(originals["__init__"], devices)},
            reason="torch.autocast('cuda') and torch.cuda.amp.autocast() autocast on the selected device"),
        SetAttributes(
            name="GradScaler", target="torch.amp.grad_scaler:GradScaler", names=("__init__",),
            make=lambda originals, _device: {"__init__": wrappers.grad_scaler_init(originals["__init__"], devices)},
            reason="GradScaler() defaults to 'cuda'; torch.cuda.amp.GradScaler() passes it: scale on the device"),
        SetAttributes(
            name="custom_fwd/bwd", target="torch.amp.autocast_mode", names=("custom_fwd", "custom_bwd"),
            make=each(lambda n, o: wrappers.custom_amp(o, devices)),
            reason="torch.cuda.amp.custom_fwd reads the 'cuda' autocast state, which is never on"),
        SetAttributes(
            name="custom_fwd/bwd-reexport", target="torch.amp", names=("custom_fwd", "custom_bwd"),
            make=each(lambda n, o: wrappers.custom_amp(getattr(o, "__devshim_original__", o), devices)),
            reason="torch.amp re-exports them; torch.cuda.amp calls them through torch.amp"),
    ]
    for module in ("torch.distributed.distributed_c10d", "torch.distributed"):
        patches.append(SetAttributes(
            name=f"nccl-backend ({module})", target=module, names=distributed,
            make=each(lambda n, o: wrappers.backend_keyword(o, devices, _BACKEND_POSITION[n])),
            reason=f"backend='nccl' becomes the {device.plugin} plugin's {device.collectives.backend!r}"))
        patches.append(SetAttributes(
            name=f"nccl-flat-buffers ({module})", target=module,
            names=tuple(sorted(coverage.FLAT_BUFFER_COLLECTIVES)),
            make=each(lambda n, o: wrappers.flat_buffers(o)),
            reason="NCCL reads the two buffers of all_gather_into_tensor/reduce_scatter_tensor flat; gloo wants the "
                   "output chunked like the input (Megatron's gather_split_1d_tensor: 'invalid tensor size')"))
    patches.append(RebindWithClassAttributes(
        name="stale-cuda-references", scope="*", pairs=swaps.take, exclude=("devshim_core", "torch"),
        reason="`from torch.cuda import _lazy_call` (Megatron), `dist_all_gather_func = "
               "torch.distributed.all_gather_into_tensor` (Megatron), DeepSpeed's OnDevice._orig_torch_empty and "
               "similar copies made before devshim activated keep the originals otherwise (torch's own modules are "
               "left alone: they call through torch.cuda)"))
    return PatchSet(name=SET_NAME, requires=(TORCH,), patches=tuple(patches),
                    reason=f"run CUDA-written scripts on {device.type} ({device.plugin}), {wrappers.IMPLEMENTATION} "
                           "wrappers; DEVSHIM_REDIRECT_CUDA=0 turns it off")

