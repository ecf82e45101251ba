"""A module-scoped watcher for JIT compilation, shared by the modules that exercise DeepSpeed's op builders.

Use it with ``jit_compilations = jit_watch.fixture()`` at module level, and end the module with a test
that calls :func:`assert_nothing_compiled`. It only observes: the wrapped functions still run.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch.utils.cpp_extension


def _listing(directory: pathlib.Path) -> set[pathlib.Path]:
    return set(directory.rglob("*")) if directory.exists() else set()


def fixture() -> Callable:
    @pytest.fixture(scope="module", autouse=True)
    def jit_compilations():
        """Records every call that would JIT-compile an extension while the module runs."""
        from deepspeed.ops.op_builder.builder import OpBuilder

        calls: list[str] = []

        def counting(name: str, original: Callable) -> Callable:
            def wrapper(*args, **kwargs):
                calls.append(name)
                return original(*args, **kwargs)

            return wrapper

        directory = pathlib.Path(os.environ["TORCH_EXTENSIONS_DIR"])
        before = _listing(directory)
        with pytest.MonkeyPatch.context() as mp:
            for name in ("load", "load_inline"):
                mp.setattr(torch.utils.cpp_extension, name, counting(f"torch.utils.cpp_extension.{name}",
                                                                   getattr(torch.utils.cpp_extension, name)))
            mp.setattr(OpBuilder, "jit_load", counting("OpBuilder.jit_load", OpBuilder.jit_load))
            yield SimpleNamespace(calls=calls, directory=directory, before=before)

    return jit_compilations


def assert_nothing_compiled(watch: SimpleNamespace) -> None:
    from deepspeed.ops.op_builder.builder import OpBuilder

    assert watch.calls == []
    assert _listing(watch.directory) == watch.before
    assert OpBuilder._loaded_ops == {}  # DeepSpeed's own loader (prebuilt or JIT modules) never ran
