"""The errors devshim raises at a user. Each message says what is wrong and what to do about it."""

from __future__ import annotations


class DevshimError(RuntimeError):
    """Base class: bad configuration, no usable plugin, unsupported framework version."""


class ConfigError(DevshimError):
    """An environment variable has a value devshim cannot use."""


class SelectionError(DevshimError):
    """No plugin can be selected (unknown or unavailable name, nothing available)."""


class PluginError(DevshimError):
    """The selected plugin broke its contract while the device facade was built."""


class PatchError(DevshimError):
    """A patch set could not be applied (unsupported version, missing target); nothing was left applied."""


class KernelCallError(DevshimError):
    """A devshim kernel refused or failed a call. ``tensor`` is one of the tensors it was given, so that the
    caller that knows more (the optimizer that owns it) can say which parameter group it came from."""

    def __init__(self, message: str, tensor: object = None, *, located: bool = False) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.located = located


class DeviceSetupError(DevshimError):
    """The vendor runtime failed to set up the device a process asked for; the message names the process's rank,
    the device, the plugin and the visible-devices variable, with the runtime's own error chained."""


class CollectiveError(DevshimError):
    """A collective devshim's shared memory serves could not complete: a rank died, or did not reach it within the
    process group's timeout. The message names the collective, its call number on the group and the ranks."""


class CollectiveMismatchError(CollectiveError):
    """The ranks of one collective made different calls (size, dtype, op or collective): raised on every rank at
    that call, listing each rank's call, where gloo would fail ("doesn't match expected size"), hang or return a
    wrong sum. No rank's tensor was changed."""


class CheckpointError(DevshimError):
    """A checkpoint could not be saved (its disk or ``/dev/shm`` is full, a file size limit was reached), or would load
    wrong values (a file's bytes differ from the checksum devshim recorded when it was saved, or it is truncated or
    unreadable). The message names the file, the rank and what to do; the framework's own error, if any, is chained."""
