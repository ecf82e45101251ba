"""devshim's reference Adam kernels (``devshim_kernels``) against PyTorch's optimizers.

``fused_adamw`` is what the ``fused_adam`` op runs, ``host_adam_step``/``host_adam_rollback`` what the
``cpu_adam`` op runs. ``step`` is the number of the update being made (1 for the first), as in
``torch.optim.AdamW``; amsgrad is not part of DeepSpeed's API and not offered.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# isort: off
import devshim_core.auto  # noqa: F401  (activates devshim in this pytest process, before deepspeed)
import deepspeed  # noqa: F401

# isort: on
import devshim_kernels
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.optim.adam import adam as torch_adam_function
from torch.optim.adamw import adamw as torch_adamw_function

FP32 = {"rtol": 1e-6, "atol": 1e-6}
STEPS = 50
SHAPES = [(5,), (3, 7), (2, 2, 9), (257,)]


def _random(shapes: Sequence[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def hyper(lr: float = 1e-2, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 0.1) -> dict[str, float]:
    return {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}


def torch_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: int, adamw_mode: bool,
                 lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One step of the function ``torch.optim.AdamW``/``Adam.step()`` runs, in place, on fp32 tensors."""
    function = torch_adamw_function if adamw_mode else torch_adam_function
    function([p], [g], [m], [v], [], [torch.tensor(float(step - 1))], foreach=False, amsgrad=False, beta1=beta1,
             beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)


# -- fused_adamw ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam-l2"])
def test_fused_adamw_matches_torch_optimizers_on_lists_of_fp32_tensors_with_a_changing_lr(adamw_mode):
    init = _random(SHAPES, seed=0)
    grads = [_random(SHAPES, seed=100 + step) for step in range(STEPS)]
    ours = [t.clone() for t in init]
    exp_avgs, exp_avg_sqs = [torch.zeros_like(t) for t in init], [torch.zeros_like(t) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    reference = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)(theirs, lr=1e-2, weight_decay=0.1)

    for step, step_grads in enumerate(grads, start=1):
        lr = 1e-2 * (0.5 + 0.5 * math.cos(math.pi * step / STEPS))  # cosine schedule
        reference.param_groups[0]["lr"] = lr
        for q, g in zip(theirs, step_grads, strict=True):
            q.grad = g.clone()
        reference.step()
        devshim_kernels.fused_adamw(ours, step_grads, exp_avgs, exp_avg_sqs, step=step, adamw_mode=adamw_mode,
                                    **hyper(lr=lr))

    for p, m, v, q, start in zip(ours, exp_avgs, exp_avg_sqs, theirs, init, strict=True):
        assert (p - start).abs().max() > 1e-2  # not a vacuous comparison
        torch.testing.assert_close(p, q.detach(), **FP32)
        torch.testing.assert_close(m, reference.state[q]["exp_avg"], **FP32)
        torch.testing.assert_close(v, reference.state[q]["exp_avg_sq"], **FP32)


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam-l2"])
def test_fused_adamw_without_bias_correction_follows_the_update_written_out(adamw_mode):
    init = _random(SHAPES, seed=1)
    p, m, v = [t.clone() for t in init], [torch.zeros_like(t) for t in init], [torch.zeros_like(t) for t in init]
    expected = [(t.clone(), torch.zeros_like(t), torch.zeros_like(t)) for t in init]
    lr, beta1, beta2, eps, wd = 5e-3, 0.85, 0.99, 1e-7, 0.2
    for step in range(1, STEPS + 1):
        grads = _random(SHAPES, seed=200 + step)
        devshim_kernels.fused_adamw(p, grads, m, v, step=step, adamw_mode=adamw_mode, bias_correction=False,
                                    **hyper(lr, beta1, beta2, eps, wd))
        updated = []
        for (pe, me, ve), g in zip(expected, grads, strict=True):
            if not adamw_mode:
                g = g + wd * pe
            me = beta1 * me + (1 - beta1) * g
            ve = beta2 * ve + (1 - beta2) * g * g
            if adamw_mode:
                pe = pe * (1 - lr * wd)
            updated.append((pe - lr * me / (ve.sqrt() + eps), me, ve))
        expected = updated
    for ours, reference in zip(zip(p, m, v, strict=True), expected, strict=True):
        torch.testing.assert_close(ours, reference, **FP32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("state_dtype", ["fp32", "param"])
def test_low_precision_params_get_fp32_math_rounded_once_into_their_storage(dtype, state_dtype):
    """bf16/fp16 params, states fp32 (mixed precision, devshim's fp32 path) or the param dtype (PyTorch's fused
    kernel): each step equals the fp32 update of the stored values, rounded once to each tensor's dtype — to one
    ulp of that dtype, since PyTorch orders the fp32 operations differently and a result within an fp32 ulp of
    a rounding boundary may round either way. ``atol``: fp32 error of a sum that cancels to nearly zero."""
    state = torch.float32 if state_dtype == "fp32" else dtype
    (init,) = _random([(4099,)], seed=2)
    p = init.to(dtype)
    m, v = torch.zeros(4099, dtype=state), torch.zeros(4099, dtype=state)
    tolerance = {"rtol": torch.finfo(dtype).eps, "atol": 1e-6}
    for step in range(1, STEPS + 1):
        (g,) = _random([(4099,)], seed=300 + step)
        g = (g.sign() * (g.abs() + 0.5)).to(dtype)  # |g| >= 0.5: fp16 states never go subnormal
        p32, m32, v32 = (t.float().clone() for t in (p, m, v))
        torch_update(p32, g.float(), m32, v32, step=step, adamw_mode=True, **hyper(lr=2e-2))
        devshim_kernels.fused_adamw([p], [g], [m], [v], step=step, **hyper(lr=2e-2))
        assert p.dtype == dtype and m.dtype == v.dtype == state
        torch.testing.assert_close(p, p32.to(dtype), **tolerance)
        torch.testing.assert_close((m, v), (m32.to(state), v32.to(state)),
                                   **(FP32 if state == torch.float32 else tolerance))
    assert (p.float() - init).abs().max() > 0.1


def test_fused_adamw_updates_leaf_parameters_that_require_grad():
    """FusedAdam hands bf16 params to the op as ``nn.Parameter``s outside ``no_grad``; the update is no autograd
    operation (as in the compiled kernel), whichever path computes it."""
    for dtype, bias_correction in [(torch.float32, True), (torch.float32, False), (torch.bfloat16, False)]:
        p = torch.nn.Parameter(torch.ones(6, dtype=dtype))
        m, v = torch.zeros(6, dtype=dtype), torch.zeros(6, dtype=dtype)
        devshim_kernels.fused_adamw([p], [torch.ones(6, dtype=dtype)], [m], [v], step=1,
                                    bias_correction=bias_correction, **hyper(weight_decay=0.0))
        assert (p.detach() < 1).all() and p.grad_fn is None and p.requires_grad


def test_fused_adamw_counts_steps_from_one():
    p, g, m, v = torch.ones(3), torch.ones(3), torch.zeros(3), torch.zeros(3)
    with pytest.raises(ValueError, match="step must be >= 1"):
        devshim_kernels.fused_adamw([p], [g], [m], [v], step=0, **hyper())
    assert torch.equal(p, torch.ones(3))


def test_fused_adamw_rejects_lists_of_different_lengths():
    p, g, m, v = torch.ones(3), torch.ones(3), torch.zeros(3), torch.zeros(3)
    with pytest.raises(ValueError):
        devshim_kernels.fused_adamw([p, p.clone()], [g], [m], [v], step=1, **hyper())


@settings(max_examples=60, deadline=None)
@given(lr=st.floats(1e-5, 0.1), beta1=st.floats(0.5, 0.99), beta2=st.floats(0.9, 0.9999),
       eps=st.floats(1e-10, 1e-6), weight_decay=st.sampled_from([0.0, 0.01, 0.3]), adamw_mode=st.booleans(),
       step=st.integers(1, 100_000), seed=st.integers(0, 2**16))
def test_any_single_fused_step_from_any_state_matches_torch(lr, beta1, beta2, eps, weight_decay, adamw_mode, step,
                                                           seed):
    """Over the hyperparameter space, and from any step number (bias corrections from strong to vanishing)."""
    g = torch.Generator().manual_seed(seed)
    p, grad = torch.randn(37, generator=g), torch.randn(37, generator=g)
    m, v = 0.1 * torch.randn(37, generator=g), 0.01 * torch.rand(37, generator=g)
    expected = [t.clone() for t in (p, m, v)]
    torch_update(expected[0], grad, expected[1], expected[2], step=step, adamw_mode=adamw_mode,
                 **hyper(lr, beta1, beta2, eps, weight_decay))
    devshim_kernels.fused_adamw([p], [grad], [m], [v], step=step, adamw_mode=adamw_mode,
                                **hyper(lr, beta1, beta2, eps, weight_decay))
    torch.testing.assert_close((p, m, v), tuple(expected), rtol=1e-5, atol=1e-6)


# -- host_adam_step / host_adam_rollback ---------------------------------------------------------------------------

@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam-l2"])
def test_host_adam_step_matches_torch_on_multi_dimensional_tensors(adamw_mode):
    (init,) = _random([(6, 5, 7)], seed=3)
    p, m, v = init.clone(), torch.zeros_like(init), torch.zeros_like(init)
    q = torch.nn.Parameter(init.clone())
    reference = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)([q], lr=1e-2, weight_decay=0.1)
    for step in range(1, STEPS + 1):
        (grad,) = _random([(6, 5, 7)], seed=400 + step)
        q.grad = grad.clone()
        reference.step()
        devshim_kernels.host_adam_step(p, grad, m, v, step=step, adamw_mode=adamw_mode, **hyper())
    assert p.shape == (6, 5, 7)
    torch.testing.assert_close((p, m, v), (q.detach(), reference.state[q]["exp_avg"],
                                           reference.state[q]["exp_avg_sq"]), **FP32)


@settings(max_examples=60, deadline=None)
@given(lr=st.floats(1e-5, 0.1), beta1=st.floats(0.5, 0.99), beta2=st.floats(0.9, 0.9999),
       eps=st.floats(1e-10, 1e-6), weight_decay=st.sampled_from([0.0, 0.01, 0.3]), adamw_mode=st.booleans(),
       bias_correction=st.booleans(), step=st.integers(1, 100_000), seed=st.integers(0, 2**16))
def test_host_adam_rollback_undoes_host_adam_step(lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction,
                                                 step, seed):
    """Given the same gradient and hyperparameters, rollback restores params and both states, in every mode
    (DeepSpeed's compiled rollback assumes AdamW with bias correction; devshim's is the exact inverse)."""
    g = torch.Generator().manual_seed(seed)
    p, grad = torch.randn(37, generator=g), torch.randn(37, generator=g)
    m, v = 0.1 * torch.randn(37, generator=g), 0.01 * torch.rand(37, generator=g)
    before = [t.clone() for t in (p, m, v)]
    kwargs = dict(step=step, adamw_mode=adamw_mode, bias_correction=bias_correction,
                  **hyper(lr, beta1, beta2, eps, weight_decay))
    devshim_kernels.host_adam_step(p, grad, m, v, **kwargs)
    assert not torch.equal(m, before[1])
    devshim_kernels.host_adam_rollback(p, grad, m, v, **kwargs)
    # v is restored by subtracting (1 - beta2) * grad**2 from the updated v: its error scales with that sum
    torch.testing.assert_close((p, m), tuple(before[:2]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v, before[2], rtol=1e-5, atol=1e-6 * max(1.0, float(grad.square().max())))


def test_host_adam_rollback_of_bf16_params_with_fp32_states_restores_them_to_bf16_resolution():
    """A bf16 param is rounded once at the step and once at the rollback, each by at most half a bf16 ulp of the
    larger of the values before and after the step; the fp32 states come back to fp32 precision."""
    (init,) = _random([(4099,)], seed=4)
    p = init.to(torch.bfloat16)
    m, v = 0.1 * init.clone(), 0.01 * init.square()
    (grad,) = _random([(4099,)], seed=5)
    grad = grad.to(torch.bfloat16)
    before = [t.clone() for t in (p, m, v)]
    devshim_kernels.host_adam_step(p, grad, m, v, step=3, **hyper(lr=1e-2))
    after = p.clone()
    devshim_kernels.host_adam_rollback(p, grad, m, v, step=3, **hyper(lr=1e-2))

    bound = torch.finfo(torch.bfloat16).eps * torch.maximum(before[0].float().abs(), after.float().abs())
    assert ((p.float() - before[0].float()).abs() <= bound).all()
    assert (after != before[0]).any()
    torch.testing.assert_close((m, v), tuple(before[1:]), **FP32)
