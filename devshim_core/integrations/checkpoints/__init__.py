"""Checkpoints that never load wrong, and save errors that name the file.

DeepSpeed's checkpoint engine (``deepspeed_engine``) and megatron-core's ``dist_checkpointing``
(``megatron_dist``) record a sha256 of every file they save, in a ``.devshim-checksums`` directory, and check it
before the file is loaded (``integrity``): a flipped byte or a truncated file raises
:class:`devshim_core.errors.CheckpointError` naming the file, instead of loading wrong values. A save that runs out
of room (a full disk, a full ``/dev/shm``, a file size limit) raises one that names the path and the free space. A
checkpoint saved without devshim has no records and loads as before.
"""
