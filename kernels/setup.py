"""Builds the optional native libraries (plain C, loaded with ctypes) when the distribution is installed: the host
Adam kernel, the row-wise fp32 RMSNorm/SwiGLU kernels and the asynchronous file I/O pool.

Everything else is declared in pyproject.toml. If there is no C compiler, or a build fails, the package still
installs: ``devshim_kernels.adam``, ``.norm`` and ``.glu`` run on PyTorch (``devshim_kernels.adam.implementation()``
says which), and ``devshim_kernels.file_io`` says why it is unavailable. All are compiled here, ahead of time, never
at run time.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# -ffp-contract=off: the kernel's results must not depend on which loop (vector, scalar tail, portable) runs an
# element, and a contracted a*b+c rounds differently. No -march: the AVX2 variant is chosen at run time.
_UNIX_FLAGS = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden", "-pthread"]
_MSVC_FLAGS = ["/O2", "/fp:precise"]


class OptionalNativeBuildExt(build_ext):
    """build_ext for a ctypes library: compiler-specific flags, no ``PyInit_`` export, failures only warn."""

    def build_extension(self, ext: Extension) -> None:
        if self.compiler.compiler_type == "msvc":
            ext.extra_compile_args = list(_MSVC_FLAGS)
        else:
            ext.extra_compile_args = list(_UNIX_FLAGS)
            ext.extra_link_args = ["-pthread"]
            ext.libraries = ["m"]
        try:
            super().build_extension(ext)
        except Exception as error:  # any compiler or linker failure: install without the native kernel
            print(f"warning: devshim_kernels: building {ext.name} failed ({error}); "
                  "installing without it", file=sys.stderr)

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return list(ext.export_symbols or [])  # not a Python module: there is no PyInit_ function to export


setup(
    ext_modules=[
        Extension("devshim_kernels._native._adam", sources=["devshim_kernels/_native/adam.c"], optional=True,
                  export_symbols=["devshim_adam_abi_version", "devshim_adam_best_isa", "devshim_adam_has_threads",
                                  "devshim_adam_step"]),
        Extension("devshim_kernels._native._rowwise", sources=["devshim_kernels/_native/rowwise.c"], optional=True,
                  export_symbols=["devshim_rowwise_abi_version", "devshim_rms_norm_forward",
                                  "devshim_rms_norm_backward", "devshim_swiglu_forward", "devshim_swiglu_backward"]),
        Extension("devshim_kernels._native._aio", sources=["devshim_kernels/_native/aio.c"], optional=True,
                  export_symbols=["devshim_aio_abi_version", "devshim_aio_create", "devshim_aio_threads",
                                  "devshim_aio_submit", "devshim_aio_wait", "devshim_aio_destroy"]),
    ],
    cmdclass={"build_ext": OptionalNativeBuildExt},
)
