"""Builds the CUDA redirect's native wrappers (plain C, no torch headers) when devshim-core is installed.

Everything else is declared in pyproject.toml. The module is an optimisation: without a C compiler, or if the
build fails, the package still installs and the redirect uses its Python wrappers
(``devshim_core.integrations.cuda_redirect.wrappers.IMPLEMENTATION`` says which). It is compiled here, ahead of
time, never at run time.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("devshim_core.integrations.cuda_redirect._native",
              sources=["devshim_core/integrations/cuda_redirect/_native.c"], optional=True),
])
