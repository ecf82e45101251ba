"""DeepSpeed's CPU Adam and Fused Adam, served through devshim: the same optimizers, no compiled op.

Every optimizer here is DeepSpeed's own Python class (``deepspeed.ops.adam``); devshim only supplies the
op that its ``CPUAdamBuilder``/``FusedAdamBuilder`` load. The references are PyTorch's optimizers, or the
update written out where PyTorch has no equivalent (no bias correction).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from types import SimpleNamespace

# isort: off
import devshim_core.auto  # noqa: F401  (activates devshim in this pytest process, before deepspeed)
import deepspeed

# isort: on
import jit_watch
import pytest
import torch
import torch.utils.cpp_extension
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from torch.optim.adam import adam as torch_adam_function
from torch.optim.adamw import adamw as torch_adamw_function

from devshim_core.errors import KernelCallError
from devshim_core.integrations.deepspeed import op_builders as devshim_builders
from devshim_core.integrations.deepspeed.ops import FusedAdamOp, HostAdamOp

STEPS = 60
SHAPES = [(7,), (4, 5), (2, 3, 4), (129,)]  # odd sizes: none is a multiple of a SIMD width
FP32 = {"rtol": 1e-6, "atol": 1e-6}
LOW_PRECISION = (torch.bfloat16, torch.float16)


# -- no JIT compilation while this module runs ---------------------------------------------------------------------

jit_compilations = jit_watch.fixture()


@pytest.fixture(scope="module", autouse=True)
def cpu_info_asked_once():
    """``DeepSpeedCPUAdam()`` asks ``cpuinfo.get_cpu_info()`` for the CPU vendor, which spawns subprocesses and
    takes seconds each time; the answer cannot change while the tests run, so it is computed once."""
    import cpuinfo

    info = cpuinfo.get_cpu_info()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpuinfo, "get_cpu_info", lambda: info)
        yield


# -- problems and references ---------------------------------------------------------------------------------------

def make_problem(seed: int, shapes: Sequence[tuple[int, ...]] = SHAPES, steps: int = STEPS, *,
                 away_from_zero: bool = False) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Initial values and one gradient per tensor per step. ``away_from_zero`` keeps |grad| in [0.5, 2] so that
    fp16 states never go subnormal (where any comparison would measure underflow, not the optimizer)."""
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g) for s in shapes]

    def grad(shape: tuple[int, ...]) -> torch.Tensor:
        if not away_from_zero:
            return torch.randn(shape, generator=g)
        return torch.randn(shape, generator=g).sign() * torch.empty(shape).uniform_(0.5, 2.0, generator=g)

    return init, [[grad(s) for s in shapes] for _ in range(steps)]


def as_params(init: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(t.clone().to(dtype)) for t in init]


def train(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], grads: Sequence[Sequence[torch.Tensor]],
          after_step: Callable[[int], None] = lambda step: None) -> None:
    for step, step_grads in enumerate(grads, start=1):
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone().to(p.dtype)
        optimizer.step()
        after_step(step)


def adam_without_bias_correction(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *, lr: float,
                                 beta1: float, beta2: float, eps: float, weight_decay: float,
                                 adamw: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of Adam(W) with bias correction off, written out (DeepSpeed's ``bias_correction=False``)."""
    if not adamw:
        g = g + weight_decay * p  # L2: the decay joins the gradient
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    if adamw:
        p = p * (1 - lr * weight_decay)  # decoupled decay
    p = p - lr * m / (v.sqrt() + eps)
    return p, m, v


def reference_step(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *, step: int, lr: float,
                   betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, adamw: bool = True,
                   bias_correction: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What DeepSpeed's compiled kernels compute for one step: read the stored values, do the arithmetic in fp32,
    store the results back in the tensors' own dtypes. The fp32 arithmetic is PyTorch's own (the function
    ``torch.optim.AdamW``/``Adam.step()`` runs) with bias correction, else :func:`adam_without_bias_correction`."""
    g = g.to(p.dtype).float()
    if bias_correction:
        new = (p.float().clone(), m.float().clone(), v.float().clone())
        adam_function = torch_adamw_function if adamw else torch_adam_function
        # torch counts the step before using it: resume from step - 1
        adam_function([new[0]], [g], [new[1]], [new[2]], [], [torch.tensor(float(step - 1))], foreach=False,
                      amsgrad=False, beta1=betas[0], beta2=betas[1], lr=lr, weight_decay=weight_decay, eps=eps,
                      maximize=False)
    else:
        new = adam_without_bias_correction(p.float(), m.float(), v.float(), g, lr=lr, beta1=betas[0],
                                           beta2=betas[1], eps=eps, weight_decay=weight_decay, adamw=adamw)
    return new[0].to(p.dtype), new[1].to(m.dtype), new[2].to(v.dtype)


def reference_trajectory(init: Sequence[torch.Tensor], grads: Sequence[Sequence[torch.Tensor]],
                         **hyperparameters) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """:func:`reference_step` over all steps, for fp32 tensors."""
    results = []
    for index, start in enumerate(init):
        p, m, v = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
        for step, step_grads in enumerate(grads, start=1):
            p, m, v = reference_step(p, m, v, step_grads[index], step=step, **hyperparameters)
        results.append((p, m, v))
    return results


def one_rounding(dtype: torch.dtype) -> dict[str, float]:
    """One unit in the last place of ``dtype``. PyTorch and devshim order the fp32 operations of a step
    differently, so a result within an fp32 ulp of a rounding boundary of ``dtype`` may round to either
    neighbour; anything further apart is a real difference in the update. ``atol`` is the fp32 error of a sum
    that cancels to nearly zero (e.g. ``beta1 * m + (1 - beta1) * g``), where any relative bound is meaningless.
    (Comparing whole trajectories instead would let one-ulp differences in low-precision states compound.)"""
    if dtype == torch.float32:
        return FP32
    return {"rtol": torch.finfo(dtype).eps, "atol": 1e-6}


def train_checking_every_step(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                              grads: Sequence[Sequence[torch.Tensor]], *, state_dtype: torch.dtype,
                              **hyperparameters) -> None:
    """Step ``optimizer`` through ``grads``; after every step each param and state must be
    :func:`reference_step` of the values stored before it, to :func:`one_rounding` of its dtype."""
    for step, step_grads in enumerate(grads, start=1):
        before = []
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone().to(p.dtype)
            state = optimizer.state.get(p) or {"exp_avg": torch.zeros(p.shape, dtype=state_dtype),
                                               "exp_avg_sq": torch.zeros(p.shape, dtype=state_dtype)}
            before.append((p.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone(), g))
        optimizer.step()
        expected = [reference_step(*b, step=step, **hyperparameters) for b in before]
        actual = [(p.detach(), *state_of(optimizer, p)) for p in params]
        for i, name in enumerate(("param", "exp_avg", "exp_avg_sq")):
            ours = torch.cat([a[i].flatten() for a in actual])
            reference = torch.cat([e[i].flatten() for e in expected])
            assert ours.dtype == reference.dtype, name
            torch.testing.assert_close(ours, reference, **one_rounding(ours.dtype),
                                       msg=lambda m, name=name, step=step: f"{name} at step {step}: {m}")


def state_of(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    state = optimizer.state[p]
    return state["exp_avg"], state["exp_avg_sq"]


def assert_same_trajectory(ours: torch.optim.Optimizer, our_params: Sequence[torch.Tensor],
                           theirs: torch.optim.Optimizer, their_params: Sequence[torch.Tensor]) -> None:
    for p, q in zip(our_params, their_params, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), **FP32)
        for ours_state, theirs_state in zip(state_of(ours, p), state_of(theirs, q), strict=True):
            torch.testing.assert_close(ours_state, theirs_state, **FP32)


def assert_moved(params: Sequence[torch.Tensor], init: Sequence[torch.Tensor], at_least: float) -> None:
    """Guards against vacuous comparisons: the optimizer really changed every tensor."""
    for p, start in zip(params, init, strict=True):
        assert (p.detach().float() - start).abs().max() > at_least


# -- DeepSpeedCPUAdam ----------------------------------------------------------------------------------------------

def test_cpu_adam_runs_on_devshims_host_adam_op():
    optimizer = DeepSpeedCPUAdam(as_params([torch.zeros(3)]))
    assert isinstance(optimizer.ds_opt_adam, HostAdamOp)


def test_cpu_adam_in_adamw_mode_matches_torch_adamw_over_many_steps_with_param_groups():
    init, grads = make_problem(0)

    def groups(params):
        return [{"params": params[:2], "lr": 3e-3, "weight_decay": 0.05},
                {"params": params[2:], "lr": 1e-2, "weight_decay": 0.2, "betas": (0.8, 0.99), "eps": 1e-6}]

    ours, theirs = as_params(init), as_params(init)
    optimizer = DeepSpeedCPUAdam(groups(ours), lr=1e-3, weight_decay=0.0, adamw_mode=True)
    reference = torch.optim.AdamW(groups(theirs), lr=1e-3, weight_decay=0.0)
    train(optimizer, ours, grads)
    train(reference, theirs, grads)

    assert_moved(ours, init, at_least=0.05)
    assert_same_trajectory(optimizer, ours, reference, theirs)
    assert all(optimizer.state[p]["step"] == STEPS for p in ours)


def test_cpu_adam_in_adam_mode_applies_weight_decay_as_l2_like_torch_adam():
    init, grads = make_problem(1)
    ours, theirs = as_params(init), as_params(init)
    optimizer = DeepSpeedCPUAdam(ours, lr=1e-2, weight_decay=0.3, adamw_mode=False)
    reference = torch.optim.Adam(theirs, lr=1e-2, weight_decay=0.3)
    train(optimizer, ours, grads)
    train(reference, theirs, grads)

    assert_moved(ours, init, at_least=0.05)
    assert_same_trajectory(optimizer, ours, reference, theirs)


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam-l2"])
def test_cpu_adam_without_bias_correction_follows_the_update_written_out(adamw):
    init, grads = make_problem(2)
    ours = as_params(init)
    optimizer = DeepSpeedCPUAdam(ours, lr=5e-3, betas=(0.85, 0.995), eps=1e-7, weight_decay=0.1,
                                 bias_correction=False, adamw_mode=adamw)
    train(optimizer, ours, grads)
    expected = reference_trajectory(init, grads, lr=5e-3, betas=(0.85, 0.995), eps=1e-7, weight_decay=0.1,
                                    adamw=adamw, bias_correction=False)

    assert_moved(ours, init, at_least=0.05)
    for p, (p_ref, m_ref, v_ref) in zip(ours, expected, strict=True):
        torch.testing.assert_close(p.detach(), p_ref, **FP32)
        torch.testing.assert_close(state_of(optimizer, p), (m_ref, v_ref), **FP32)


def test_cpu_adam_follows_a_learning_rate_changed_between_steps():
    """A scheduler (warm-up then decay) and a manual change mid-run: each step uses the group's current lr."""
    init, grads = make_problem(3)
    ours, theirs = as_params(init), as_params(init)
    optimizer = DeepSpeedCPUAdam(ours, lr=2e-2, weight_decay=0.01)
    reference = torch.optim.AdamW(theirs, lr=2e-2, weight_decay=0.01)

    def schedule(step: int) -> float:
        return min(1.0, (step + 1) / 10) * 0.97**step

    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in (optimizer, reference)]
    lrs = []
    for step, step_grads in enumerate(grads, start=1):
        for p, q, g in zip(ours, theirs, step_grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        optimizer.step()
        reference.step()
        lrs.append(optimizer.param_groups[0]["lr"])
        for scheduler in schedulers:
            scheduler.step()
        if step == STEPS // 2:
            for o in (optimizer, reference):
                o.param_groups[0]["lr"] *= 3.0

    assert len(set(lrs)) == STEPS  # the lr really changed at every step
    assert_same_trajectory(optimizer, ours, reference, theirs)


@pytest.mark.parametrize("fp32_optimizer_states", [True, False], ids=["fp32-states", "param-dtype-states"])
@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION], ids=str)
def test_cpu_adam_params_of_each_dtype_get_fp32_math_stored_in_their_dtypes(dtype, fp32_optimizer_states):
    """fp32/bf16/fp16 params: states are fp32 or the param dtype as asked; every step equals fp32 Adam(W)
    arithmetic on the stored values, rounded back to the storage dtypes (the compiled kernel's semantics)."""
    init, grads = make_problem(4, away_from_zero=True)
    ours = as_params(init, dtype)
    optimizer = DeepSpeedCPUAdam(ours, lr=2e-2, weight_decay=0.1, fp32_optimizer_states=fp32_optimizer_states)
    state_dtype = torch.float32 if fp32_optimizer_states else dtype
    train_checking_every_step(optimizer, ours, grads, state_dtype=state_dtype, lr=2e-2, weight_decay=0.1)

    assert_moved(ours, init, at_least=0.1)


# -- DeepSpeedCPUAdam rollback -------------------------------------------------------------------------------------

def _step_then_rollback(optimizer: DeepSpeedCPUAdam, param: torch.nn.Parameter,
                        grads: Sequence[torch.Tensor]) -> SimpleNamespace:
    """``step_subgroup`` for every gradient, then ``rollback_subgroup`` of the last step (same gradient)."""
    for g in grads[:-1]:
        param.grad = g.to(param.dtype)
        optimizer.step_subgroup(0)
    state = optimizer.state[0]
    before = (param.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone())
    param.grad = grads[-1].to(param.dtype)
    optimizer.step_subgroup(0)
    after = (param.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone())
    optimizer.rollback_subgroup(0)
    restored = (param.detach(), state["exp_avg"], state["exp_avg_sq"])
    return SimpleNamespace(before=before, after=after, restored=restored, step=state["step"])


@pytest.mark.parametrize("options", [
    {"adamw_mode": True, "weight_decay": 0.1},
    {"adamw_mode": False, "weight_decay": 0.1},
    {"adamw_mode": True, "weight_decay": 0.1, "bias_correction": False},
], ids=["adamw", "adam-l2", "adamw-no-bias-correction"])
def test_cpu_adam_rollback_subgroup_restores_fp32_params_and_states(options):
    (init,), grads = make_problem(5, shapes=[(4099,)], steps=6)
    param = torch.nn.Parameter(init.clone())
    optimizer = DeepSpeedCPUAdam([param], lr=1e-2, **options)
    result = _step_then_rollback(optimizer, param, [g for (g,) in grads])

    assert (result.after[0] - result.before[0]).abs().max() > 5e-3  # the step did change the params
    assert result.step == len(grads) - 1
    torch.testing.assert_close(result.restored, result.before, **FP32)


@pytest.mark.parametrize("fp32_optimizer_states", [True, False], ids=["fp32-states", "bf16-states"])
def test_cpu_adam_rollback_of_bf16_params_restores_them_to_bf16_resolution(fp32_optimizer_states):
    """DeepSpeed's compiled rollback refuses anything but fp32 (returns -1); devshim's computes in fp32 and
    stores back. A bf16 value is rounded at the step and again at the rollback, by at most half a bf16 ulp each
    (an ulp is at most ``eps * |value|``); undoing the momentum update divides by beta1 = 0.9, which may stretch
    the first rounding by 1/0.9. fp32 states come back to fp32 precision."""
    (init,), grads = make_problem(6, shapes=[(4099,)], steps=6)
    param = torch.nn.Parameter(init.clone().to(torch.bfloat16))
    optimizer = DeepSpeedCPUAdam([param], lr=1e-2, weight_decay=0.1, fp32_optimizer_states=fp32_optimizer_states)
    result = _step_then_rollback(optimizer, param, [g for (g,) in grads])

    state_dtype = torch.float32 if fp32_optimizer_states else torch.bfloat16
    names = ("param", "exp_avg", "exp_avg_sq")
    for name, dtype, before, after, restored in zip(names, (torch.bfloat16, state_dtype, state_dtype),
                                                    result.before, result.after, result.restored, strict=True):
        assert restored.dtype == dtype, name
        if dtype == torch.float32:
            torch.testing.assert_close(restored, before, **FP32)
        else:
            bound = torch.finfo(dtype).eps / 0.9 * torch.maximum(before.float().abs(), after.float().abs())
            assert ((restored.float() - before.float()).abs() <= bound).all(), name
    assert (result.restored[0] != result.after[0]).any()  # the rollback did undo the step


def test_cpu_adam_rollback_refuses_a_subgroup_that_never_stepped():
    param = torch.nn.Parameter(torch.ones(8))
    optimizer = DeepSpeedCPUAdam([param])
    param.grad = torch.ones(8)
    with pytest.raises(RuntimeError, match="has not been initialized"):
        optimizer.rollback_subgroup(0)


# -- the cpu_adam op API -------------------------------------------------------------------------------------------

@pytest.fixture
def cpu_adam_op() -> HostAdamOp:
    return deepspeed.ops.op_builder.CPUAdamBuilder().load()


OPTIMIZER_ID = 7_000  # clear of the ids DeepSpeedCPUAdam hands out


def _update_args(p, g, m, v, *, step=1, lr=1e-2, weight_decay=0.1, bias_correction=True):
    # adam_update(optimizer_id, step, lr, beta1, beta2, eps, weight_decay, bias_correction, params, grads, m, v)
    return (step, lr, 0.9, 0.999, 1e-8, weight_decay, bias_correction, p, g, m, v)


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam-l2"])
def test_cpu_adam_op_create_update_destroy_return_0_and_update_in_place_in_the_mode_fixed_at_create(
        cpu_adam_op, adamw_mode):
    (init,), ((grad,),) = make_problem(7, shapes=[(33,)], steps=1)
    p, m, v = init.clone(), torch.zeros(33), torch.zeros(33)
    ref = torch.nn.Parameter(init.clone())
    reference = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)([ref], lr=1e-2, weight_decay=0.1)
    ref.grad = grad.clone()
    reference.step()

    assert cpu_adam_op.create_adam(OPTIMIZER_ID, 1e-3, 0.9, 0.999, 1e-8, 0.0, adamw_mode, False) == 0
    try:
        assert cpu_adam_op.adam_update(OPTIMIZER_ID, *_update_args(p, grad, m, v)) == 0
    finally:
        assert cpu_adam_op.destroy_adam(OPTIMIZER_ID) == 0
    torch.testing.assert_close(p, ref.detach(), **FP32)
    torch.testing.assert_close((m, v), state_of(reference, ref), **FP32)


def test_cpu_adam_op_rollback_returns_0_and_undoes_adam_update(cpu_adam_op):
    (init,), ((grad,),) = make_problem(8, shapes=[(33,)], steps=1)
    p, m, v = init.clone(), torch.full((33,), 0.05), torch.full((33,), 0.01)
    before = (p.clone(), m.clone(), v.clone())
    assert cpu_adam_op.create_adam(OPTIMIZER_ID) == 0
    try:
        assert cpu_adam_op.adam_update(OPTIMIZER_ID, *_update_args(p, grad, m, v, step=4)) == 0
        assert not torch.equal(p, before[0])
        assert cpu_adam_op.adam_rollback(OPTIMIZER_ID, *_update_args(p, grad, m, v, step=4)) == 0
    finally:
        cpu_adam_op.destroy_adam(OPTIMIZER_ID)
    torch.testing.assert_close((p, m, v), before, **FP32)


def _update_registering(cpu_adam_op, copy: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One ``adam_update`` of 1031 fp32 params with ``copy`` registered for them, as ZeRO-Offload's one-pass step
    registers a partition's buffer: (params before, params after, copies the op made)."""
    (init,), ((grad,),) = make_problem(seed, shapes=[(1031,)], steps=1)
    p, m, v = init.clone(), torch.zeros(1031), torch.zeros(1031)
    cpu_adam_op.param_copies = {p.data_ptr(): copy}
    assert cpu_adam_op.create_adam(OPTIMIZER_ID) == 0
    made = cpu_adam_op.copies_made
    try:
        cpu_adam_op.adam_update(OPTIMIZER_ID, *_update_args(p, grad, m, v))
    finally:
        cpu_adam_op.destroy_adam(OPTIMIZER_ID)
        cpu_adam_op.param_copies = {}
    return init, p, cpu_adam_op.copies_made - made


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=["bf16", "fp16"])
def test_cpu_adam_op_writes_a_registered_param_copy_in_the_update_as_tensor_to_would(cpu_adam_op, dtype):
    copy = torch.zeros(1031, dtype=dtype)
    _, p, made = _update_registering(cpu_adam_op, copy, seed=9)
    assert torch.equal(copy, p.to(dtype)) and made == 1
    assert (copy.data_ptr(), p.data_ptr()) in cpu_adam_op.copies_written
    cpu_adam_op.copies_written.clear()


@pytest.mark.parametrize("copy", [torch.zeros(100, dtype=torch.bfloat16), torch.zeros(1031)],
                         ids=["other-size", "fp32"])
def test_cpu_adam_op_leaves_a_registered_copy_that_does_not_fit_untouched(cpu_adam_op, copy):
    init, p, made = _update_registering(cpu_adam_op, copy, seed=10)
    assert not copy.any() and made == 0
    assert not torch.equal(p, init)  # the update itself ran


def test_cpu_adam_op_logs_its_creation_only_when_asked(cpu_adam_op, capsys):
    cpu_adam_op.create_adam(OPTIMIZER_ID, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, False)
    assert capsys.readouterr().out == ""
    cpu_adam_op.create_adam(OPTIMIZER_ID + 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
    assert f"Adam Optimizer #{OPTIMIZER_ID + 1} is created" in capsys.readouterr().out
    cpu_adam_op.destroy_adam(OPTIMIZER_ID)
    cpu_adam_op.destroy_adam(OPTIMIZER_ID + 1)


def test_optimizers_created_through_one_load_are_usable_through_another(cpu_adam_op):
    """The compiled module is loaded once per process, with one registry of optimizer ids."""
    other = deepspeed.ops.op_builder.CPUAdamBuilder().load()
    p, g, m, v = torch.ones(5), torch.ones(5), torch.zeros(5), torch.zeros(5)
    assert cpu_adam_op.create_adam(OPTIMIZER_ID) == 0
    try:
        assert other.adam_update(OPTIMIZER_ID, *_update_args(p, g, m, v)) == 0
    finally:
        other.destroy_adam(OPTIMIZER_ID)


BAD_INPUTS = {
    "grads-shorter-than-params": lambda: (OPTIMIZER_ID, torch.ones(8), torch.ones(7), torch.zeros(8), torch.zeros(8)),
    "exp-avg-of-another-size": lambda: (OPTIMIZER_ID, torch.ones(8), torch.ones(8), torch.zeros(9), torch.zeros(8)),
    "exp-avg-sq-of-another-size": lambda: (OPTIMIZER_ID, torch.ones(8), torch.ones(8), torch.zeros(8),
                                           torch.zeros(3)),
    "grads-in-another-dtype": lambda: (OPTIMIZER_ID, torch.ones(8), torch.ones(8, dtype=torch.bfloat16),
                                       torch.zeros(8), torch.zeros(8)),
    "fp64-params": lambda: (OPTIMIZER_ID, torch.ones(8, dtype=torch.float64), torch.ones(8, dtype=torch.float64),
                            torch.zeros(8), torch.zeros(8)),
    "states-of-two-dtypes": lambda: (OPTIMIZER_ID, torch.ones(8), torch.ones(8), torch.zeros(8),
                                     torch.zeros(8, dtype=torch.bfloat16)),
    "unknown-optimizer-id": lambda: (OPTIMIZER_ID + 99, torch.ones(8), torch.ones(8), torch.zeros(8),
                                     torch.zeros(8)),
}


@pytest.mark.parametrize("what", ["update", "rollback"])
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_cpu_adam_op_raises_on_bad_input_naming_the_optimizer_and_touches_nothing(cpu_adam_op, case, what):
    # the compiled op prints and returns -1, which DeepSpeedCPUAdam.step discards: devshim's raises instead
    optimizer_id, p, g, m, v = BAD_INPUTS[case]()
    originals = [t.clone() for t in (p, g, m, v)]
    cpu_adam_op.create_adam(OPTIMIZER_ID)
    try:
        call = cpu_adam_op.adam_update if what == "update" else cpu_adam_op.adam_rollback
        with pytest.raises(KernelCallError, match=f"host Adam {what} for optimizer #{optimizer_id}") as raised:
            call(optimizer_id, *_update_args(p, g, m, v))
    finally:
        cpu_adam_op.destroy_adam(OPTIMIZER_ID)
    assert raised.value.tensor is p
    for tensor, original in zip((p, g, m, v), originals, strict=True):
        assert torch.equal(tensor, original)


def test_cpu_adam_op_forgets_a_destroyed_optimizer(cpu_adam_op):
    p, g, m, v = torch.ones(4), torch.ones(4), torch.zeros(4), torch.zeros(4)
    cpu_adam_op.create_adam(OPTIMIZER_ID)
    assert cpu_adam_op.destroy_adam(OPTIMIZER_ID) == 0
    with pytest.raises(KernelCallError, match="was not created"):
        cpu_adam_op.adam_update(OPTIMIZER_ID, *_update_args(p, g, m, v))
    assert cpu_adam_op.destroy_adam(OPTIMIZER_ID) == 0  # destroying twice is harmless, as in the compiled op


def _two_groups(second_dtype: torch.dtype = torch.float32) -> tuple[list[dict], torch.nn.Parameter]:
    first = torch.nn.Parameter(torch.ones(4))
    second = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 5, dtype=second_dtype))]
    (first.sum() + sum(p.sum() for p in second)).backward()
    return [{"params": [first]}, {"params": second}], second[1]


def test_deepspeed_cpu_adam_raises_naming_the_parameter_group_it_could_not_update():
    # before: "Error in Adam update" on stderr, -1 discarded by step(), and group 1 silently frozen
    groups, fp64 = _two_groups(torch.float64)
    optimizer = DeepSpeedCPUAdam(groups, lr=0.1)
    with pytest.raises(KernelCallError, match=r"DeepSpeedCPUAdam\.step: param group 1, parameter 1 "
                                              r"\(shape \(2, 5\), torch\.float64\): host Adam update .*float64"):
        optimizer.step()
    assert torch.equal(fp64.detach(), torch.ones(2, 5, dtype=torch.float64))


def test_fused_adam_raises_naming_the_parameter_group_whose_state_does_not_fit():
    groups, _ = _two_groups()
    optimizer = FusedAdam(groups, lr=0.1)
    optimizer.step()
    broken = optimizer.param_groups[1]["params"][0]
    optimizer.state[broken]["exp_avg"] = torch.zeros(7)  # e.g. a state loaded from another model's checkpoint
    with pytest.raises(KernelCallError, match=r"FusedAdam\.step: param group 1, parameter 0 \(shape \(3,\), "
                                              r"torch\.float32\): fused Adam: .*exp_avg \(7\)"):
        optimizer.step()


# -- FusedAdam -----------------------------------------------------------------------------------------------------

def test_fused_adam_runs_on_devshims_fused_adam_op():
    optimizer = FusedAdam(as_params([torch.zeros(3)]))
    assert isinstance(optimizer.multi_tensor_adam.__self__, FusedAdamOp)


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam-l2"])
def test_fused_adam_matches_torch_over_many_steps_with_param_groups_and_a_schedule(adam_w_mode):
    init, grads = make_problem(10)

    def groups(params):
        return [{"params": params[:3], "lr": 5e-3, "weight_decay": 0.1},
                {"params": params[3:], "lr": 2e-2, "weight_decay": 0.0, "betas": (0.8, 0.99), "eps": 1e-6}]

    ours, theirs = as_params(init), as_params(init)
    optimizer = FusedAdam(groups(ours), adam_w_mode=adam_w_mode)
    reference = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(groups(theirs))
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.8) for o in (optimizer, reference)]
    train(optimizer, ours, grads, after_step=lambda step: schedulers[0].step())
    train(reference, theirs, grads, after_step=lambda step: schedulers[1].step())

    assert_moved(ours, init, at_least=0.02)
    assert_same_trajectory(optimizer, ours, reference, theirs)


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam-l2"])
def test_fused_adam_without_bias_correction_follows_the_update_written_out(adam_w_mode):
    init, grads = make_problem(11)
    ours = as_params(init)
    optimizer = FusedAdam(ours, lr=5e-3, bias_correction=False, weight_decay=0.1, adam_w_mode=adam_w_mode)
    train(optimizer, ours, grads)
    expected = reference_trajectory(init, grads, lr=5e-3, weight_decay=0.1, adamw=adam_w_mode,
                                    bias_correction=False)

    assert_moved(ours, init, at_least=0.05)
    for p, (p_ref, m_ref, v_ref) in zip(ours, expected, strict=True):
        torch.testing.assert_close(p.detach(), p_ref, **FP32)
        torch.testing.assert_close(state_of(optimizer, p), (m_ref, v_ref), **FP32)


@pytest.mark.parametrize("bias_correction", [True, False], ids=["bias-correction", "no-bias-correction"])
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_fused_adam_low_precision_params_get_fp32_math_stored_in_their_dtype(dtype, adam_w_mode, bias_correction):
    """FusedAdam keeps its states in the param dtype; like the compiled kernel, each step computes in fp32 from
    the stored values and stores params and states back in that dtype."""
    init, grads = make_problem(12, away_from_zero=True)
    ours = as_params(init, dtype)
    optimizer = FusedAdam(ours, lr=2e-2, weight_decay=0.1, adam_w_mode=adam_w_mode, bias_correction=bias_correction)
    train_checking_every_step(optimizer, ours, grads, state_dtype=dtype, lr=2e-2, weight_decay=0.1,
                              adamw=adam_w_mode, bias_correction=bias_correction)

    assert_moved(ours, init, at_least=0.1)


# -- op builders ---------------------------------------------------------------------------------------------------

def test_adam_builder_names_are_devshims_builders_wherever_deepspeed_bound_them():
    import deepspeed.ops.adam.cpu_adam
    import deepspeed.ops.adam.fused_adam

    assert deepspeed.ops.op_builder.CPUAdamBuilder is devshim_builders.CPUAdamBuilder
    assert deepspeed.ops.op_builder.FusedAdamBuilder is devshim_builders.FusedAdamBuilder
    assert deepspeed.ops.adam.cpu_adam.CPUAdamBuilder is devshim_builders.CPUAdamBuilder
    assert deepspeed.ops.adam.fused_adam.FusedAdamBuilder is devshim_builders.FusedAdamBuilder
    assert get_accelerator().get_op_builder("CPUAdamBuilder") is devshim_builders.CPUAdamBuilder
    assert isinstance(get_accelerator().create_op_builder("FusedAdamBuilder"), devshim_builders.FusedAdamBuilder)


@pytest.mark.parametrize(("builder_name", "op_class"), [("CPUAdamBuilder", HostAdamOp),
                                                        ("FusedAdamBuilder", FusedAdamOp)])
def test_adam_builders_are_compatible_and_load_devshims_op_without_compiling_or_importing(builder_name, op_class,
                                                                                          monkeypatch):
    builder = getattr(deepspeed.ops.op_builder, builder_name)()
    assert builder.is_compatible() is True

    def refuse(*args, **kwargs):
        raise AssertionError("the builder tried to compile")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", refuse)
    imported = set(sys.modules)
    op = builder.load()
    assert set(sys.modules) - imported == set()  # the op was already there: nothing compiled, nothing imported
    assert isinstance(op, op_class)
    assert builder.jit_load() is op  # DeepSpeed's explicit JIT path ends at the same object
    assert builder.sources() == []


def test_deepspeed_reports_the_adam_ops_as_compatible():
    compatible = deepspeed.ops.__compatible_ops__
    assert compatible["cpu_adam"] is True
    assert compatible["fused_adam"] is True


def _other_builder_names() -> list[str]:
    served = {"AsyncIOBuilder", "CPUAdamBuilder", "FusedAdamBuilder", "NotImplementedBuilder", "PackbitsBuilder",
              "ShareMemCommBuilder", "CCLCommBuilder"}
    names = [name for name in vars(deepspeed.ops.op_builder)
             if name.endswith("Builder") and name not in ("OpBuilder", "CUDAOpBuilder") and name not in served]
    assert "TransformerBuilder" in names and len(names) >= 10
    return sorted(names)


@pytest.mark.parametrize("builder_name", _other_builder_names())
def test_every_other_deepspeed_op_is_a_devshim_refusal_naming_it_which_never_compiles(builder_name):
    builder_class = getattr(deepspeed.ops.op_builder, builder_name)
    assert issubclass(builder_class, devshim_builders.NotImplementedBuilder)
    assert builder_class is devshim_builders.refusal_for(builder_name)  # one class per name, wherever it is bound
    builder = builder_class()
    assert builder.is_compatible() is False
    for load in (builder.load, builder.jit_load):
        with pytest.raises(RuntimeError, match=rf"\({builder_name}\) is not .*never JIT-compiles DeepSpeed ops"):
            load()
    with pytest.raises(RuntimeError, match="nothing to compile"):
        builder.builder()


def test_the_packbits_op_packs_signs_as_numpy_packbits_does_and_unpacks_them_to_plus_and_minus_one():
    # the bit layout of 1-bit Adam's compressed all-reduce: set for x >= 0 (0 and -0.0 included), MSB first
    import numpy as np

    op = get_accelerator().create_op_builder("PackbitsBuilder").load()
    x = torch.randn(1003, generator=torch.Generator().manual_seed(3))
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), -float("inf")])
    packed = op.packbits(x, x.numel(), 0)
    assert packed.dtype == torch.uint8 and packed.numel() == 126
    assert np.array_equal(packed.numpy(), np.packbits(x.numpy() >= 0))
    signs = op.unpackbits(packed.to(torch.int8), packed.numel(), 0)  # the backend sends int8
    assert torch.equal(signs[:1003], torch.where(x >= 0, 1.0, -1.0)) and torch.equal(signs[1003:], -torch.ones(5))


def test_collective_ops_have_no_builder_so_deepspeed_uses_the_torch_backend():
    accelerator = get_accelerator()
    for name in ("ShareMemCommBuilder", "CCLCommBuilder"):
        assert accelerator.get_op_builder(name) is None
        assert accelerator.create_op_builder(name) is None
        assert getattr(deepspeed.ops.op_builder, name) is None
    assert importlib.import_module("deepspeed.comm.torch").build_shm_op() is None
    assert importlib.import_module("deepspeed.comm.ccl").build_ccl_op() is None


# -- last: nothing above compiled anything -------------------------------------------------------------------------

def test_nothing_was_jit_compiled_while_this_module_ran(jit_compilations):
    jit_watch.assert_nothing_compiled(jit_compilations)
