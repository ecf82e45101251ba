"""HF Accelerate and transformers on the selected device: what they pick when ``torch.cuda`` answers for it.

The CUDA redirect answers ``torch.cuda.is_available()`` and ``device_count()`` for the selected device, to every
caller: a script gates ``model.cuda()`` on it, and a library told otherwise would place tensors where the script does
not. A library with its own path for the device checks that path before CUDA and takes it (Accelerate and transformers
for ``npu``); one without it takes CUDA, which the redirect serves on the device. What Accelerate and transformers then
report and decide from the device's *name* is corrected here: Accelerate's device is the selected device and its
backend the device's; on the host CPU its distributed type is its own CPU one (DDP without ``device_ids``); and
transformers' single-process device is the selected device. The policy is documented in ``docs/cuda-scripts.md``.
"""
