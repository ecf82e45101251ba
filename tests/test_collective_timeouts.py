"""Spec: a collective that times out is re-raised naming itself; everything else passes through untouched.

The end-to-end proof, a real rank hanging under both launchers, is ``e2e/test_hung_collective.py``; these pin
down the wrapper's contract on the exceptions themselves.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from devshim_core.integrations.torch_distributed import timeouts
from devshim_core.integrations.torch_distributed.timeouts import COLLECTIVES, named
from devshim_core.patching import PatchRegistry

GLOO_TIMEOUT = "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete"
DEVICE: Any = object()  # the patch set does not use the device facade


def raising(exc: BaseException):
    def collective(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return collective


def test_a_timeout_keeps_its_type_names_the_collective_and_chains_the_backends_error():
    backend_error = dist.DistBackendError(GLOO_TIMEOUT)
    with pytest.raises(dist.DistBackendError) as raised:
        named(raising(backend_error), "all_reduce")(object())
    message = str(raised.value)
    assert message.startswith("torch.distributed.all_reduce timed out on rank ")
    assert "a rank did not reach this all_reduce" in message
    assert "deepspeed.init_distributed(timeout=datetime.timedelta(minutes=N))" in message
    assert message.endswith(f"The backend said: {GLOO_TIMEOUT}")
    assert raised.value.__cause__ is backend_error


def test_a_collective_built_on_another_is_named_by_the_one_the_caller_made():
    inner = named(raising(RuntimeError(GLOO_TIMEOUT)), "all_gather")
    outer = named(lambda *a, **k: inner(*a, **k), "all_gather_object")
    with pytest.raises(RuntimeError) as raised:
        outer([None], {"x": 1})
    assert str(raised.value).startswith("torch.distributed.all_gather_object timed out")
    assert str(raised.value).count("The backend said:") == 1
    assert str(raised.value.__cause__) == GLOO_TIMEOUT


@pytest.mark.parametrize("error", [RuntimeError("connection reset by peer"), ValueError("timed out, but a ValueError")])
def test_an_error_that_is_no_runtime_timeout_passes_through_as_it_was(error):
    with pytest.raises(type(error)) as raised:
        named(raising(error), "broadcast")()
    assert raised.value is error


def test_a_collective_that_succeeds_returns_what_the_original_returned():
    result = object()
    wrapped = named(lambda *args, **kwargs: (result, args, kwargs), "barrier")
    assert wrapped(1, group="g") == (result, (1,), {"group": "g"})
    assert wrapped.__name__ == "<lambda>" and wrapped.__devshim_original__ is not None


def test_the_patch_set_wraps_torch_distributed_and_its_c10d_module_and_reverts_both():
    modules = (dist, dist.distributed_c10d)
    before = {(module.__name__, name): getattr(module, name) for module in modules for name in COLLECTIVES}
    registry = PatchRegistry()
    registry.apply(timeouts.patch_set(DEVICE), DEVICE)
    try:
        for (module_name, name), function in before.items():
            module = dist if module_name == dist.__name__ else dist.distributed_c10d
            assert getattr(module, name).__devshim_original__ is function, (module_name, name)
    finally:
        registry.revert_all()
    assert all(getattr(dist if m == dist.__name__ else dist.distributed_c10d, n) is f for (m, n), f in before.items())
