"""Checkpoints from GPU clusters: storages saved as ``cuda``/``cuda:N`` load onto the selected device, and storages on
the selected device are saved as ``cuda:N``, as a CUDA run of the same script would have saved them.

``torch.save`` records each storage's location with the first tagger of ``torch.serialization``'s package registry
that claims it, and ``torch.load`` restores it with the first deserializer that accepts the location (after
``map_location`` has rewritten it). torch's own CUDA pair (priority 20) refuses every ``cuda`` location without a
CUDA build; under the redirect it would reach the device only through ``torch.cuda``'s internals, and would refuse an
index the process lacks with CUDA's device count and no file name. devshim registers its own pair ahead of it, and
takes it out again on revert.

Semantics (docs/cuda-scripts.md, "Checkpoints from GPU clusters"):

- ``cuda:N`` -> the selected device's index N; ``cuda`` -> its current device. An index this process does not have
  is refused, naming the file, the location and the count, as torch refuses it on a CUDA machine with fewer GPUs.
  The CPU has one device whatever N: every ``cuda`` location loads there.
- A storage on the selected device (not the CPU) is saved as ``cuda:N``: a CUDA machine loads the file as it loads
  one its own GPUs wrote, with or without ``map_location``. The vendor's tag (``npu:N``) would need a
  ``map_location`` there. ``DEVSHIM_DISABLE=cuda-redirect:checkpoint-save-as-cuda`` keeps the vendor's tags.
"""

from __future__ import annotations

import os
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.serialization

from devshim_core.errors import DevshimError
from devshim_core.patching import Patch, Requirement, Undo

if TYPE_CHECKING:
    from devshim_core.device import Device

# torch's registry is sorted by priority: below 20 (torch's CUDA pair) and 23 (PrivateUse1's: npu, tpu) wins both
LOAD_PRIORITY = 18
SAVE_PRIORITY = 19

_CUDA_LOCATION = re.compile(r"cuda(?::(\d+))?")

Tagger = Callable[[Any], str | None]
Deserializer = Callable[[Any, str], Any]


def _never_tags(storage: Any) -> None:
    return None


def _never_restores(storage: Any, location: str) -> None:
    return None


def _file_being_loaded() -> str:
    """' from <file>' for the ``torch.load`` call on this thread's stack, or '' (a buffer, or not found). Read from
    torch's own ``load`` frame, found by file and name: a wrapper around ``torch.load`` may hold the file otherwise."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "load"
                                     and frame.f_code.co_filename == torch.serialization.__file__):
        frame = frame.f_back
    if frame is None:
        return ""
    f = frame.f_locals.get("f")
    name = os.fspath(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
    return f" from {name}" if isinstance(name, str) else ""


def cuda_restorer(device: Device) -> Deserializer:
    """The deserializer for ``cuda``/``cuda:N`` locations: the storage (read into host memory) moved to the selected
    device; any other location is left to torch's deserializers (``None``)."""

    def restore(storage: Any, location: str) -> Any:
        match = _CUDA_LOCATION.fullmatch(location)
        if match is None:
            return None
        if device.type == "cpu":  # torch.load hands deserializers the storage read into host memory
            return storage
        index = device.current_device() if match.group(1) is None else int(match.group(1))
        count = device.device_count()
        if index >= count:
            rank = os.environ.get("RANK")
            where = f" on rank {rank}" if rank is not None else ""
            raise DevshimError(
                f"torch.load{_file_being_loaded()}{where}: a storage saved on {location!r} cannot be restored on "
                f"{device.type}:{index}: this process sees {count} {device.type} device(s) (devshim plugin "
                f"{device.plugin}), and a CUDA machine with {count} GPU(s) refuses it the same way. Pass map_location "
                f"to place it on a device this process has: map_location='cuda' (the current device), "
                f"map_location={{{location!r}: 'cuda:0'}} or map_location='cpu'.")
        return storage.to(device=device.torch_device(index))

    return restore


def cuda_tagger(device: Device) -> Tagger:
    """The tagger that saves a storage on the selected device as ``cuda:N``; others (the CPU's included) are left to
    torch's taggers. On the CPU device nothing is claimed: its tensors are the host's, and ``cpu`` loads anywhere."""
    device_type = device.type

    def tag(storage: Any) -> str | None:
        where = storage.device
        if device_type == "cpu" or where.type != device_type:
            return None
        return "cuda" if where.index is None else f"cuda:{where.index}"

    return tag


@dataclass(frozen=True)
class RegisterLocation(Patch):
    """Register a (tagger, deserializer) pair in ``torch.serialization``'s package registry at ``priority``;
    revert takes that entry out again (torch has no unregister)."""

    name: str
    priority: int
    make: Callable[[Device], tuple[Tagger, Deserializer]]
    reason: str
    requires: tuple[Requirement, ...] = ()

    def target_description(self) -> str:
        return f"torch.serialization.register_package (priority {self.priority})"

    def apply(self, device: Device) -> tuple[Undo, str]:
        tagger, deserializer = self.make(device)
        torch.serialization.register_package(self.priority, tagger, deserializer)
        entry = (self.priority, tagger, deserializer)

        def undo() -> None:
            registry = torch.serialization._package_registry
            if entry in registry:
                registry.remove(entry)

        return undo, f"registered at priority {self.priority}"


def patches() -> tuple[Patch, ...]:
    """The two registrations, load and save: each can be turned off alone (``DEVSHIM_DISABLE=cuda-redirect:NAME``)."""
    return (
        RegisterLocation(
            name="checkpoint-load-cuda", priority=LOAD_PRIORITY,
            make=lambda device: (_never_tags, cuda_restorer(device)),
            reason="torch.load of storages saved on 'cuda'/'cuda:N' (every checkpoint from a GPU cluster), and "
                   "map_location='cuda'/'cuda:N'/{...: 'cuda:N'}, restore onto the selected device: torch's CUDA "
                   "deserializer refuses them without a CUDA build"),
        RegisterLocation(
            name="checkpoint-save-as-cuda", priority=SAVE_PRIORITY,
            make=lambda device: (cuda_tagger(device), _never_restores),
            reason="torch.save tags storages on the selected device 'cuda:N', as the CUDA script would on a GPU: a "
                   "CUDA machine loads the file with or without map_location (a vendor tag such as 'npu:0' needs one)"),
    )
