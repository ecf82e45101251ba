"""Spec: the redirected ``torch.cuda`` is complete on the emulated vendor device (``npu`` for Ascend, ``tpu`` for
Sophgo), as ``tests/test_cuda_facade_completeness.py`` specifies it on the CPU: every public name of torch's
``torch.cuda``, ``torch.cuda.amp``, ``torch.cuda.random`` and ``torch.backends.cuda`` is decided, a served one accepts
torch's parameters and stays a class where torch's is one, and a refused one raises one devshim error naming the call
and the vendor's device. Nothing is injected: the vendor's own device module answers what it serves.

Run once per vendor (``DEVSHIM_EMULATE=ascend pytest tests/emulated``, then sophgo). Each spec activates devshim and
deactivates it after, leaving the process as it found it.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from test_cuda_facade_completeness import MISSING, cases, devshim_off, signature_problem, snapshot

from devshim_core import session
from devshim_core.integrations.cuda_redirect import coverage
from devshim_core.integrations.cuda_redirect.cuda_module import CudaCallRefused
from emulated.conftest import DEVICE_TYPE, VENDOR


@pytest.fixture(scope="module")
def real(emulated_device: Any) -> dict[str, dict[str, Any]]:
    with devshim_off():
        return snapshot()


@pytest.fixture
def redirected(real: dict[str, dict[str, Any]]) -> Iterator[dict[str, dict[str, Any]]]:
    with devshim_off():
        active = session.activate()
        assert active.device.type == DEVICE_TYPE
        yield {module: {n: getattr(sys.modules[module], n, MISSING) for n in names} for module, names in real.items()}


def test_every_public_name_is_decided_and_answered_as_decided(real, redirected):
    problems = []
    for module, name, theirs, kind in cases(real):
        where, ours = f"{module}.{name}", redirected[module][name]
        if kind == "unclassified":
            problems.append(f"{where} is in no table of coverage.py")
        elif ours is MISSING:
            problems.append(f"{where} is missing")
        elif isinstance(theirs, type) and not isinstance(ours, type):
            problems.append(f"{where} is no longer a class")
        elif kind == "as torch" and ours is not theirs:
            problems.append(f"{where} is classified 'as torch' but replaced")
        elif callable(theirs) and (problem := signature_problem(theirs, ours)) is not None:
            problems.append(f"{where} {problem}")
    assert not problems, "\n".join(problems)


def test_refused_names_raise_one_devshim_error_naming_the_call_and_the_device(real, redirected):
    refused = [(m, n) for m, n, _, kind in cases(real) if kind == "refused"]
    assert refused
    for module, name in refused:
        with pytest.raises(CudaCallRefused) as raised:
            redirected[module][name](*[0] * _required(real[module][name]))
        assert str(raised.value).startswith(f"torch.cuda.{name}() cannot run on {DEVICE_TYPE} (devshim plugin {VENDOR}")
        assert coverage.refused_names()[name] in str(raised.value)


def _required(original: Any) -> int:
    try:
        parameters = inspect.signature(original).parameters.values()
    except (TypeError, ValueError):
        return 0
    return sum(1 for p in parameters if p.default is p.empty and p.name != "self"
               and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
