"""Megatron through the selected plugin: megatron-core 0.16 (installed, or Megatron-LM's checkout of it),
Megatron-LM's ``megatron.training``, and Megatron-DeepSpeed's fork, each recognised and patched on its own.

Order of work: before Megatron is imported, CUDA-only extension modules are provided or blocked
(``extension_modules``); the moment ``megatron.core`` has executed, its flavour is recognised (``flavor``) and
the matching declared set from ``patches`` is applied, all or nothing; ``megatron.training`` gets its own set
when it is imported (``training``). The CUDA redirect must be on: Megatron calls ``torch.cuda`` ~500 times.
"""
