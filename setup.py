"""Builds devshim-core's two native modules (plain C, no torch headers) when it is installed: the CUDA redirect's
wrappers and the shared-memory collectives' barrier.

Everything else is declared in pyproject.toml. Both are optional: without a C compiler, or if a build fails, the
package still installs, the redirect uses its Python wrappers
(``devshim_core.integrations.cuda_redirect.wrappers.IMPLEMENTATION`` says which) and every CPU collective stays
gloo's (``devshim_core.integrations.torch_distributed.shm_segment.NATIVE``). They are compiled here, ahead of
time, never at run time.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("devshim_core.integrations.cuda_redirect._native",
              sources=["devshim_core/integrations/cuda_redirect/_native.c"], optional=True),
    # the shared-memory collectives' release/acquire barrier; without it every collective stays gloo's
    Extension("devshim_core.integrations.torch_distributed._shm_sync",
              sources=["devshim_core/integrations/torch_distributed/_shm_sync.c"], optional=True),
])
