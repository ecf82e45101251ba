"""Every change the HF integration makes, declared in one place: target, version range, reason."""

from __future__ import annotations

from devshim_core.integrations.huggingface import accelerate_state, max_memory, training_args
from devshim_core.patching import PatchSet, RebindReferences, Requirement, SetAttribute, replaced_functions

STATE_MODULE = "accelerate.state"
ACCELERATOR_MODULE = "accelerate.accelerator"
MODELING_MODULE = "accelerate.utils.modeling"
TRAINING_ARGS_MODULE = "transformers.training_args"
ACCELERATE = Requirement("accelerate", ">=1.0,<2")
TRANSFORMERS = Requirement("transformers", ">=4.46,<6")

_STATE = f"{STATE_MODULE}:PartialState"
_ACCELERATOR = f"{ACCELERATOR_MODULE}:Accelerator"

ACCELERATE_DEVICE = PatchSet(
    name="huggingface-accelerate",
    requires=(ACCELERATE,),
    reason="Accelerate takes CUDA for a device it has no path for (the redirect answers torch.cuda): its state then "
           "names cuda:N and nccl while the parameters and the process group are the device's",
    patches=(
        SetAttribute(
            name="backend", target=f"{_STATE}._prepare_backend", make=accelerate_state.prepare_backend,
            reason="where Accelerate picks nccl and MULTI_GPU, the device's backend (one the caller named is kept); "
                   "on the host CPU its MULTI_CPU, whose DDP passes no device_ids (DDP refuses them for a CPU module)"),
        SetAttribute(
            name="device", target=f"{_STATE}.set_device", make=accelerate_state.set_device,
            reason="PartialState.device (and so TrainingArguments.device) names the selected device at the rank's "
                   "index instead of cuda:N"),
        SetAttribute(
            name="default-device", target=f"{_STATE}.default_device", make=accelerate_state.default_device,
            reason="a single process's default device is the selected device instead of cuda"),
        SetAttribute(
            name="mixed-precision-init", target=f"{_ACCELERATOR}.__init__", make=accelerate_state.accelerator_init,
            reason="marks Accelerator.__init__, during which its device reads as cuda (the next patch)"),
        SetAttribute(
            name="mixed-precision-device", target=f"{_ACCELERATOR}.device",
            make=accelerate_state.accelerator_device,
            reason="Accelerator.__init__ sets up fp16 only for device types it lists (it raises for tpu and ignores "
                   "fp16 on cpu): while it runs, the device reads as cuda, whose set-up (GradScaler('cuda')) the "
                   "redirect serves on the device, as before; afterwards it is the selected device"),
    ),
)

_MAX_MEMORY = f"{MODELING_MODULE}:get_max_memory"

ACCELERATE_MEMORY = PatchSet(
    name="huggingface-accelerate-memory",
    requires=(ACCELERATE,),
    reason="device_map='auto' on the host CPU planned modules for the redirect's device 0, the host itself, and "
           "failed ('Cannot access accelerator device when none is available')",
    patches=(
        SetAttribute(
            name="host-budget", target=_MAX_MEMORY, make=max_memory.host_budget,
            reason="on the host CPU the memory budget Accelerate computes is {'cpu': RAM}, as without devshim, "
                   "not RAM twice under device 0 and 'cpu'; a budget the caller passes, and other devices, are "
                   "unchanged"),
        RebindReferences(
            name="host-budget-accelerate-names", scope="accelerate", pairs=replaced_functions(_MAX_MEMORY),
            reason="accelerate.utils re-exports the function; modules imported after the set bind the new one"),
        RebindReferences(
            name="host-budget-transformers-names", scope="transformers", pairs=replaced_functions(_MAX_MEMORY),
            reason="transformers.integrations.accelerate binds it as accelerate_max_memory when it is imported"),
    ),
)

TRANSFORMERS_DEVICE = PatchSet(
    name="huggingface-transformers",
    requires=(TRANSFORMERS,),
    reason="in a single process, TrainingArguments names cuda:0 for a device it has no path for (the host CPU)",
    patches=(
        SetAttribute(
            name="training-arguments-device", target=f"{TRAINING_ARGS_MODULE}:TrainingArguments._setup_devices",
            make=training_args.setup_devices,
            reason="TrainingArguments.device names the selected device where transformers chose cuda:0"),
    ),
)
