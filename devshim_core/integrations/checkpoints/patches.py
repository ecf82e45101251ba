"""Every change the checkpoints integration makes, declared in one place: target, version range, reason."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from devshim_core.device import Device
from devshim_core.integrations.checkpoints import deepspeed_engine, megatron_dist
from devshim_core.integrations.deepspeed.patches import DEEPSPEED
from devshim_core.integrations.megatron.flavor import MEGATRON_CORE
from devshim_core.patching import PatchSet, SetAttribute

ENGINE_MODULE = "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine"
ENGINE = f"{ENGINE_MODULE}:TorchCheckpointEngine"
SERIALIZATION, PACKAGE = megatron_dist.SERIALIZATION, megatron_dist.PACKAGE

DEEPSPEED_CHECKPOINTS = PatchSet(
    name="checkpoints-deepspeed",
    requires=(DEEPSPEED,),  # save(state_dict, path) and load(path, map_location) from 0.16.0 to 0.19.x
    reason="a DeepSpeed checkpoint file whose bytes changed raises naming the file instead of loading wrong values; "
           "a save that runs out of room names the file and the free space",
    patches=(
        SetAttribute(
            name="checksum-on-save", target=f"{ENGINE}.save", make=deepspeed_engine.checked_save,
            reason="records each tag file's size and sha256 in <save_dir>/.devshim-checksums/<tag>/ (atomically) once "
                   "it is written; a failed write with no space left (ENOSPC, EDQUOT, EFBIG, or the filesystem "
                   "found full: torch's zip writer says only 'unexpected pos') names the file and the free space"),
        SetAttribute(
            name="verify-on-load", target=f"{ENGINE}.load", make=deepspeed_engine.checked_load,
            reason="torch.load checks no checksum: a flipped byte in tensor data loads silently wrong. The file is "
                   "checked against its record first; a mismatch or a truncated or unreadable file names the file, "
                   "its size and the other tags to load"),
    ),
)


def _same_as(name: str) -> Callable[[Any, Device], Any]:
    """For the package's re-export: the function just set in ``serialization``."""
    return lambda original, device: getattr(sys.modules[SERIALIZATION], name)


_REEXPORT = "megatron.core.dist_checkpointing re-exports the function; Megatron-LM and scripts call that name"

MEGATRON_CHECKPOINTS = PatchSet(
    name="checkpoints-megatron-core",
    requires=(MEGATRON_CORE,),
    reason="a dist_checkpointing checkpoint whose bytes changed stops every rank naming the file instead of loading "
           "wrong values; a save that runs out of room (the checkpoint disk or /dev/shm) names the path",
    patches=(
        SetAttribute(
            name="manifest-on-save", target=f"{SERIALIZATION}:save", make=megatron_dist.checked_save,
            reason="each rank records the size and sha256 of the files it wrote in <checkpoint>/.devshim-checksums/"
                   "rank{N}.json once the save returns (an async save: once it is finalized); a failure for want of "
                   "room names the checkpoint and the free space, or /dev/shm, where the writer's queue semaphore "
                   "lives"),
        SetAttribute(name="manifest-on-save-reexport", target=f"{PACKAGE}:save", make=_same_as("save"),
                     reason=_REEXPORT),
        SetAttribute(
            name="verify-on-load", target=f"{SERIALIZATION}:load", make=megatron_dist.checked_load,
            reason="neither torch DCP nor dist_checkpointing checks a checksum (a flipped byte in a .distcp loads "
                   "silently wrong): the ranks check the recorded files between them and agree, so that every rank "
                   "raises the same error naming the file, or none does"),
        SetAttribute(name="verify-on-load-reexport", target=f"{PACKAGE}:load", make=_same_as("load"),
                     reason=_REEXPORT),
        SetAttribute(
            name="verify-common-state", target=f"{SERIALIZATION}:load_common_state_dict",
            make=megatron_dist.checked_load_common,
            reason="Megatron-LM reads common.pt this way before load; a corrupt one fails with UnicodeDecodeError"),
        SetAttribute(name="verify-common-state-reexport", target=f"{PACKAGE}:load_common_state_dict",
                     make=_same_as("load_common_state_dict"), reason=_REEXPORT),
        SetAttribute(
            name="forget-manifests-on-rewrite", target=f"{SERIALIZATION}:remove_sharded_tensors",
            make=megatron_dist.forgetting_manifests,
            reason="it rewrites a saved checkpoint in place: its records would then fail a good checkpoint"),
        SetAttribute(name="forget-manifests-on-rewrite-reexport", target=f"{PACKAGE}:remove_sharded_tensors",
                     make=_same_as("remove_sharded_tensors"), reason=_REEXPORT),
    ),
)
