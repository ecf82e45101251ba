"""Spec: devshim's stand-ins for apex's ``amp_C`` multi-tensor ops return what Megatron's own local fallbacks return
(``megatron.core.utils.local_multi_tensor_l2_norm`` / ``local_multi_tensor_scale``), called as Megatron calls
them through ``multi_tensor_applier``, and scale in place when sources and targets are the same tensors."""

from __future__ import annotations

import pytest
import torch

from devshim_core.integrations.megatron.multi_tensor import multi_tensor_l2norm, multi_tensor_scale

utils = pytest.importorskip("megatron.core.utils", reason="the fallbacks compared with are Megatron's")
SHAPES = ((7, 13), (129,), (3, 5, 11), (1,))


def grads(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(dtype) for shape in SHAPES]


@pytest.fixture
def flag() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int)


@pytest.fixture(autouse=True)
def megatron_makes_cuda_tensors_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's local l2 norm returns a device='cuda' tensor; here the host stands for the device."""
    real = torch.tensor

    def tensor(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)


def test_the_l2_norm_is_megatrons_over_all_tensors(flag):
    tensors = grads()
    ours, per_tensor = utils.local_multi_tensor_applier(multi_tensor_l2norm, flag, [tensors], False)
    theirs, _ = utils.local_multi_tensor_applier(utils.local_multi_tensor_l2_norm, flag, [tensors], False)
    assert ours.shape == theirs.shape == (1,) and ours.dtype == torch.float32 and per_tensor is None
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    _, norms = multi_tensor_l2norm(0, flag, [tensors], True)
    torch.testing.assert_close(norms, torch.stack([t.norm() for t in tensors]))


def test_scaling_a_list_into_itself_is_in_place_and_megatrons(flag):
    ours, theirs = grads(), grads()
    storage = [t.data_ptr() for t in ours]
    utils.local_multi_tensor_applier(multi_tensor_scale, flag, [ours, ours], 0.37)
    utils.local_multi_tensor_applier(utils.local_multi_tensor_scale, flag, [theirs, theirs], 0.37)
    assert [t.data_ptr() for t in ours] == storage
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_scaling_into_other_tensors_casts_to_their_dtype_as_megatron_does(flag, scale):
    sources = grads()
    ours, theirs = grads(1, torch.bfloat16), grads(1, torch.bfloat16)
    utils.local_multi_tensor_applier(multi_tensor_scale, flag, [sources, ours], scale)
    utils.local_multi_tensor_applier(utils.local_multi_tensor_scale, flag, [sources, theirs], scale)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    assert all(torch.equal(s, g) for s, g in zip(sources, grads(), strict=True))  # sources untouched
