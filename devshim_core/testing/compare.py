"""How the kit compares a device result with the host reference: tolerances per dtype, forward and backward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypedDict

import torch

Tensor = torch.Tensor


class Tolerance(TypedDict):
    """``torch.testing.assert_close``'s keywords."""

    atol: float
    rtol: float


TOL: dict[torch.dtype, Tolerance] = {torch.float32: {"atol": 2e-5, "rtol": 1e-4},
                                     torch.bfloat16: {"atol": 4e-2, "rtol": 4e-2}}


def close(actual: Tensor, expected: Tensor, device: str, dtype: torch.dtype = torch.float32) -> None:
    """``actual`` lies on ``device`` (a type, or a type and index) and equals the host ``expected`` within
    ``TOL[dtype]``."""
    wanted = torch.device(device)
    where = actual.device if wanted.index is not None else torch.device(actual.device.type)
    assert where == wanted, f"result on {actual.device}, not {device}"
    torch.testing.assert_close(actual.detach().cpu().float(), expected.detach().float(), **TOL[dtype])


def conform(device_fn: Callable[..., Tensor], reference_fn: Callable[..., Tensor], inputs: dict[str, Any],
            grads: tuple[str, ...], dtype: torch.dtype, device: str) -> Tensor:
    """Run ``device_fn`` on device copies and ``reference_fn`` on the host tensors; compare outputs and the
    gradients of ``grads``. Returns the device output."""
    def copies(where: str) -> dict[str, Any]:
        return {k: v.detach().to(where).requires_grad_(k in grads) if isinstance(v, Tensor) else v
                for k, v in inputs.items()}

    host, dev = copies("cpu"), copies(device)
    expected, actual = reference_fn(**host), device_fn(**dev)
    close(actual, expected, device, dtype)
    if grads:
        g = torch.randn(expected.shape, dtype=expected.dtype)
        expected.backward(g)
        actual.backward(g.to(device))
        for name in grads:
            assert dev[name].grad is not None, f"no gradient reached {name}"
            close(dev[name].grad, host[name].grad, device, dtype)
    return actual
