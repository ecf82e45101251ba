"""devshim's Adam kernels (``devshim_kernels.adam``) against PyTorch's optimizers.

``fused_adamw`` is what the ``fused_adam`` op runs, ``host_adam_step``/``host_adam_rollback`` what the
``cpu_adam`` op runs. ``step`` is the number of the update being made (1 for the first), as in
``torch.optim.AdamW``. Both take amsgrad's running maximum and a bf16/fp16 copy of the params to write.

Every behaviour is specified for each implementation ("path"): the native C kernel as this CPU runs it, the
same kernel's portable loop, and PyTorch (``DEVSHIM_KERNELS_NATIVE=0``). A native path is skipped, saying
why, where the kernel was not built.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

# isort: off
import devshim_core.auto  # noqa: F401  (activates devshim in this pytest process, before deepspeed)
import deepspeed  # noqa: F401

# isort: on
import devshim_kernels
import pytest
import torch
from devshim_kernels import _native, adam
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.optim.adam import adam as torch_adam_function
from torch.optim.adamw import adamw as torch_adamw_function

from bench import adam_identity

FP32 = {"rtol": 1e-6, "atol": 1e-6}
STEPS = 50
SHAPES = [(5,), (3, 7), (2, 2, 9), (257,)]
ODD_SHAPES = [(1,), (7,), (3, 7), (2, 2, 9), (257,), (30_011,)]  # no size a multiple of a SIMD width
PATHS = list(adam_identity.PATHS)  # native as this CPU runs it, its portable C loop, PyTorch


@contextlib.contextmanager
def using(path: str) -> Iterator[None]:
    """Run the kernels on ``path`` (skips the test if that path cannot run here)."""
    if path != "torch" and _native.LIBRARY is None:
        pytest.skip(f"native kernel unavailable: {_native.REASON}")
    with adam_identity.kernel_path(path):
        if path == "native" and not adam.implementation().startswith("native"):
            pytest.skip(f"no native kernel for this CPU: {adam.implementation()}")
        yield


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    with using(request.param):
        yield request.param


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


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


# -- which implementation runs -------------------------------------------------------------------------------------

def test_implementation_names_the_native_kernel_its_variant_and_threads_or_why_torch_runs():
    """By default the native kernel runs where it has a SIMD variant for the CPU; DEVSHIM_KERNELS_NATIVE=0
    forces PyTorch and =generic the native portable loop."""
    with using("torch"):
        assert adam.implementation() == "torch (DEVSHIM_KERNELS_NATIVE=0)"
    if _native.LIBRARY is None:
        assert adam.implementation() == f"torch ({_native.REASON})"
        return
    threads = torch.get_num_threads()
    runs_on = f"{threads} thread{'' if threads == 1 else 's'}: {_native.threads()})"
    with using("native-generic"):
        assert adam.implementation() == f"native (generic C, {runs_on}"
    if _native.BEST_ISA == _native.ISA_AVX2:
        assert adam.implementation() == f"native (avx2+fma+f16c, {runs_on}"
        assert _native.threads() in ("torch's OpenMP threads", "pthreads")
    else:
        assert adam.implementation().startswith("torch (the native kernel has no SIMD variant for this CPU")


def test_the_native_kernel_is_the_library_built_at_install_time_next_to_its_loader():
    if _native.LIBRARY is None:
        pytest.skip(f"native kernel unavailable: {_native.REASON}")
    library = _native.library_path("_adam")
    assert library is not None and library.parent.name == "_native" and library.name.startswith("_adam")
    file_io = _native.library_path("_aio")  # the NVMe-offload engine, built by the same install
    assert file_io is not None and file_io.parent == library.parent and file_io.name.startswith("_aio")


# -- against torch.optim -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("amsgrad", [False, True], ids=["plain", "amsgrad"])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam-l2"])
def test_fused_adamw_matches_torch_optimizers_over_many_steps_with_a_changing_lr(path, adamw_mode, amsgrad):
    """150 steps, weight decay, a cosine schedule, odd sizes up to 30k elements: params and both moments (and
    amsgrad's maximum) stay within 1e-6 of ``torch.optim.AdamW``/``Adam`` (bias correction and step counting
    exactly theirs)."""
    steps = 150
    init = _random(ODD_SHAPES, seed=0)
    ours = [t.clone() for t in init]
    exp_avgs, exp_avg_sqs = [torch.zeros_like(t) for t in init], [torch.zeros_like(t) for t in init]
    maxima = [torch.zeros_like(t) for t in init] if amsgrad else None
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    reference = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)(theirs, lr=1e-2, weight_decay=0.1,
                                                                        amsgrad=amsgrad)
    g = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        lr = 1e-2 * (0.5 + 0.5 * math.cos(math.pi * step / steps))
        reference.param_groups[0]["lr"] = lr
        grads = [torch.randn(t.shape, generator=g) * (0.1 if step % 7 else 3.0) for t in init]  # maxima change
        for q, grad in zip(theirs, grads, strict=True):
            q.grad = grad.clone()
        reference.step()
        devshim_kernels.fused_adamw(ours, grads, exp_avgs, exp_avg_sqs, step=step, adamw_mode=adamw_mode,
                                    max_exp_avg_sqs=maxima, **hyper(lr=lr))

    for k, (p, q, start) in enumerate(zip(ours, theirs, init, strict=True)):
        assert (p - start).abs().max() > 1e-2  # not a vacuous comparison
        state = reference.state[q]
        torch.testing.assert_close(p, q.detach(), **FP32)
        torch.testing.assert_close((exp_avgs[k], exp_avg_sqs[k]), (state["exp_avg"], state["exp_avg_sq"]), **FP32)
        if maxima is not None:
            torch.testing.assert_close(maxima[k], state["max_exp_avg_sq"], **FP32)
            assert not torch.equal(maxima[k], exp_avg_sqs[k])  # amsgrad really took a different second moment


@pytest.mark.parametrize("amsgrad", [False, True], ids=["plain", "amsgrad"])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam-l2"])
def test_host_adam_step_matches_torch_on_multi_dimensional_tensors(path, adamw_mode, amsgrad):
    (init,) = _random([(6, 5, 7)], seed=3)
    p, m, v = init.clone(), torch.zeros_like(init), torch.zeros_like(init)
    vmax = torch.zeros_like(init) if amsgrad else None
    q = torch.nn.Parameter(init.clone())
    reference = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)([q], lr=1e-2, weight_decay=0.1,
                                                                        amsgrad=amsgrad)
    for step in range(1, STEPS + 1):
        (grad,) = _random([(6, 5, 7)], seed=400 + step)
        q.grad = grad.clone()
        reference.step()
        devshim_kernels.host_adam_step(p, grad, m, v, step=step, adamw_mode=adamw_mode, max_exp_avg_sq=vmax,
                                       **hyper())
    assert p.shape == (6, 5, 7)
    state = reference.state[q]
    torch.testing.assert_close((p, m, v), (q.detach(), state["exp_avg"], state["exp_avg_sq"]), **FP32)
    if vmax is not None:
        torch.testing.assert_close(vmax, state["max_exp_avg_sq"], **FP32)


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam-l2"])
def test_fused_adamw_without_bias_correction_follows_the_update_written_out(path, adamw_mode):
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


@pytest.mark.parametrize("path_name", PATHS)
@settings(max_examples=40, deadline=None)
@given(lr=st.floats(1e-5, 0.1), beta1=st.floats(0.5, 0.99), beta2=st.floats(0.9, 0.9999),
       eps=st.floats(1e-10, 1e-6), weight_decay=st.sampled_from([0.0, 0.01, 0.3]), adamw_mode=st.booleans(),
       amsgrad=st.booleans(), step=st.integers(1, 100_000), seed=st.integers(0, 2**16))
def test_any_single_fused_step_from_any_state_matches_torch(path_name, lr, beta1, beta2, eps, weight_decay, adamw_mode,
                                                           amsgrad, step, seed):
    """Over the hyperparameter space, and from any step number (bias corrections from strong to vanishing)."""
    g = torch.Generator().manual_seed(seed)
    p, grad = torch.randn(37, generator=g), torch.randn(37, generator=g)
    m, v = 0.1 * torch.randn(37, generator=g), 0.01 * torch.rand(37, generator=g)
    vmax = v + 0.01 * torch.rand(37, generator=g) * (torch.rand(37, generator=g) < 0.5) if amsgrad else None
    expected = [t.clone() for t in (p, m, v)]
    expected_max = None if vmax is None else vmax.clone()
    function = torch_adamw_function if adamw_mode else torch_adam_function
    function([expected[0]], [grad], [expected[1]], [expected[2]], [] if vmax is None else [expected_max],
             [torch.tensor(float(step - 1))], foreach=False, amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr,
             weight_decay=weight_decay, eps=eps, maximize=False)
    with using(path_name):
        devshim_kernels.fused_adamw([p], [grad], [m], [v], step=step, adamw_mode=adamw_mode,
                                    max_exp_avg_sqs=None if vmax is None else [vmax],
                                    **hyper(lr, beta1, beta2, eps, weight_decay))
    torch.testing.assert_close((p, m, v), tuple(expected), rtol=1e-5, atol=1e-6)
    if vmax is not None:
        torch.testing.assert_close(vmax, expected_max, rtol=1e-5, atol=1e-6)


# -- low precision: params and the param copy ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("state_dtype", ["fp32", "param"])
def test_low_precision_params_get_fp32_math_rounded_once_into_their_storage(path, dtype, state_dtype):
    """bf16/fp16 params, states fp32 (mixed precision: the native kernel, or devshim's fp32 path) or the param
    dtype (PyTorch's fused kernel): each step equals the fp32 update of the stored values, rounded once to each
    tensor's dtype — to one ulp of that dtype, since PyTorch orders the fp32 operations differently and a result
    within an fp32 ulp of a rounding boundary may round either way. ``atol``: fp32 error of a sum that cancels
    to nearly zero."""
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


@pytest.mark.parametrize("path_name", ["native", "native-generic"])
@pytest.mark.parametrize("grad_dtype", ["param", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_native_low_precision_params_are_exactly_the_fp32_update_rounded_once(path_name, dtype, grad_dtype):
    """With fp32 states the native kernel loads a bf16/fp16 param (and grad) into fp32, runs the fp32 update and
    rounds the param once: bit for bit what the fp32 kernel gives for the same stored values."""
    (init,) = _random([(4099,)], seed=7)
    p, m, v = init.to(dtype), 0.1 * init.clone(), 0.01 * init.square()
    (grad,) = _random([(4099,)], seed=8)
    grad = grad.to(dtype if grad_dtype == "param" else torch.float32)
    p32, m32, v32 = p.float(), m.clone(), v.clone()
    with using(path_name):
        devshim_kernels.host_adam_step(p, grad, m, v, step=5, **hyper(lr=3e-2))
        devshim_kernels.host_adam_step(p32, grad.float(), m32, v32, step=5, **hyper(lr=3e-2))
    assert torch.equal(bits(p), bits(p32.to(dtype))) and (p.float() != init.to(dtype).float()).any()
    assert torch.equal(m, m32) and torch.equal(v, v32)


def _conversion_cases(n: int = 200_003) -> torch.Tensor:
    """fp32 values whose bf16/fp16 rounding is delicate, at the start and the end (so both the vector loop and
    the scalar tail meet them), and random bit patterns (every exponent, NaN payloads, subnormals) between."""
    special = [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 3.4028234663852886e38, 1e-45,
               65504.0, 65519.99, 65520.0, -65520.0, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-26, 1e-30, -1e-30,
               1 + 2.0**-11, 1 + 3 * 2.0**-11, 6.103515625e-05, 6.1e-05]
    as_int = [0x3F808000, 0x3F818000, 0x3F80C000, 0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000, 0x7F800001, 0x7FC12345,
              0xFFA00001, 0x00008000, 0x00018000, 0x80018000, 0x477FF000, 0x477FEFFF, 0x387FE000, 0x33000000]
    special_bits = torch.cat([torch.tensor(special, dtype=torch.float32).view(torch.int32),
                              torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in as_int], dtype=torch.int32)])
    g = torch.Generator().manual_seed(9)
    middle = torch.randint(-(2**31), 2**31, (n - 2 * len(special_bits),), generator=g, dtype=torch.int64)
    return torch.cat([special_bits, middle.to(torch.int32), special_bits]).view(torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_param_copy_is_the_updated_param_converted_by_pytorch_bit_for_bit(path, dtype):
    """``param_copy`` holds exactly ``param.to(dtype)`` of the updated param: round to nearest even, ties to
    even, overflow to inf, subnormals, and NaN (bf16: 0xFFFF, PyTorch's vectorised conversion; fp16: quiet,
    payload truncated). With lr = 0 and no weight decay the step keeps every value, so each case reaches the
    copy; a second, real step then covers ordinary values."""
    values = _conversion_cases()
    p, copy = values.clone(), torch.full(values.shape, 7.0, dtype=dtype)
    grad = torch.ones_like(values)
    m, v = torch.zeros_like(values), torch.zeros_like(values)
    devshim_kernels.host_adam_step(p, grad, m, v, step=1, param_copy=copy, **hyper(lr=0.0, weight_decay=0.0))
    kept = ~values.isnan()
    assert torch.equal(bits(p)[kept], bits(values)[kept]) and p.isnan().equal(values.isnan())
    assert torch.equal(bits(copy), bits(p.to(dtype)))

    (p,) = _random([(100_003,)], seed=10)
    devshim_kernels.host_adam_step(p, -grad[:100_003], m[:100_003], v[:100_003], step=2, param_copy=copy[:100_003],
                                   **hyper())
    assert torch.equal(bits(copy[:100_003]), bits(p.to(dtype)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_large_param_copy_at_any_alignment_is_exact_too(path, dtype):
    """Millions of elements per thread: the native kernel writes such copies with streaming stores, which need
    16-byte alignment it reaches element by element; here the copy and the param start off that alignment."""
    n = 2_500_003
    p = _conversion_cases(n + 1)[1:]  # 4 bytes past an aligned start
    copy = torch.zeros(n + 3, dtype=dtype)[3:]  # 6 bytes past an aligned start
    m, v = torch.zeros(n), torch.zeros(n)
    devshim_kernels.host_adam_step(p, torch.ones(n), m, v, step=1, param_copy=copy, **hyper(lr=0.0, weight_decay=0.0))
    assert torch.equal(bits(copy), bits(p.to(dtype)))


def test_fused_adamw_writes_each_copy_given_and_takes_none_for_params_without_one(path):
    init = _random(ODD_SHAPES[:5], seed=11)
    params = [t.clone() for t in init]
    states = [(torch.zeros_like(t), torch.zeros_like(t)) for t in init]
    dtypes = [torch.bfloat16, None, torch.float16, None, torch.bfloat16]
    copies = [None if dtype is None else torch.zeros(t.shape, dtype=dtype)
              for t, dtype in zip(init, dtypes, strict=True)]
    devshim_kernels.fused_adamw(params, _random(ODD_SHAPES[:5], seed=12), [m for m, _ in states],
                                [v for _, v in states], step=1, param_copies=copies, **hyper())
    for p, copy in zip(params, copies, strict=True):
        if copy is not None:
            assert torch.equal(bits(copy), bits(p.to(copy.dtype)))


# -- threads and variants ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("runner", ["openmp", "pthreads"])
@pytest.mark.parametrize("path_name", ["native", "native-generic"])
def test_a_native_update_split_over_threads_equals_the_single_threaded_one_bit_for_bit(path_name, runner,
                                                                                       monkeypatch):
    """Splits fall anywhere in a list of odd-sized tensors (a few elements per thread here); each thread's
    range ends in a scalar tail, which computes exactly what the vector loop does. Threads are torch's OpenMP
    team (the default when torch runs on OpenMP) or the kernel's own pthreads."""
    monkeypatch.setattr(adam, "_MIN_ELEMENTS_PER_THREAD", dict.fromkeys(adam._MIN_ELEMENTS_PER_THREAD, 1000))
    shapes = [(1,), (7,), (1000,), (4099,), (3, 3337), (10_007,)]
    results = {}
    before = torch.get_num_threads()
    with using(path_name):
        if runner == "openmp" and _native.torch_openmp_entry() is None:
            pytest.skip("torch does not run on OpenMP here")
        try:
            assert _native.use_threads(runner) == {"openmp": "torch's OpenMP threads", "pthreads": "pthreads"}[runner]
            for threads in (1, 2, 5, 11):
                torch.set_num_threads(threads)
                init = _random(shapes, seed=13)
                m, v, vmax = ([torch.full_like(t, 0.01) for t in init] for _ in range(3))
                copies = [torch.empty(t.shape, dtype=torch.bfloat16) for t in init]
                for step in range(1, 4):
                    devshim_kernels.fused_adamw(init, _random(shapes, seed=14 + step), m, v, step=step,
                                                max_exp_avg_sqs=vmax, param_copies=copies, **hyper())
                results[threads] = [bits(t) for t in (*init, *m, *v, *vmax, *copies)]
        finally:
            torch.set_num_threads(before)
            _native.use_threads("auto")
    for threads in (2, 5, 11):
        assert all(torch.equal(a, b) for a, b in zip(results[1], results[threads], strict=True)), threads


@pytest.mark.parametrize("amsgrad", [False, True], ids=["plain", "amsgrad"])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam-l2"])
def test_the_portable_native_loop_equals_the_simd_one_bit_for_bit(adamw_mode, amsgrad):
    """Every operation is a correctly rounded IEEE one, so which loop runs cannot change a bit."""
    outputs = []
    for path_name in ("native", "native-generic"):
        init = _random(ODD_SHAPES, seed=15)
        m, v, vmax = ([torch.zeros_like(t) for t in init] for _ in range(3))
        copies = [torch.empty(t.shape, dtype=torch.float16) for t in init]
        with using(path_name):
            for step in range(1, 6):
                devshim_kernels.fused_adamw(init, _random(ODD_SHAPES, seed=16 + step), m, v, step=step,
                                            adamw_mode=adamw_mode, max_exp_avg_sqs=vmax if amsgrad else None,
                                            param_copies=copies, **hyper())
        outputs.append([bits(t) for t in (*init, *m, *v, *vmax, *copies)])
    assert all(torch.equal(a, b) for a, b in zip(*outputs, strict=True))


# -- arguments -----------------------------------------------------------------------------------------------------

def test_fused_adamw_updates_leaf_parameters_that_require_grad(path):
    """FusedAdam hands bf16 params to the op as ``nn.Parameter``s outside ``no_grad``; the update is no autograd
    operation (as in the compiled kernel), whichever path computes it."""
    for dtype, bias_correction in [(torch.float32, True), (torch.float32, False), (torch.bfloat16, False)]:
        p = torch.nn.Parameter(torch.ones(6, dtype=dtype))
        m, v = torch.zeros(6, dtype=dtype), torch.zeros(6, dtype=dtype)
        devshim_kernels.fused_adamw([p], [torch.ones(6, dtype=dtype)], [m], [v], step=1,
                                    bias_correction=bias_correction, **hyper(weight_decay=0.0))
        assert (p.detach() < 1).all() and p.grad_fn is None and p.requires_grad


def test_fused_adamw_counts_steps_from_one(path):
    p, g, m, v = torch.ones(3), torch.ones(3), torch.zeros(3), torch.zeros(3)
    with pytest.raises(ValueError, match="step must be >= 1"):
        devshim_kernels.fused_adamw([p], [g], [m], [v], step=0, **hyper())
    assert torch.equal(p, torch.ones(3))


def test_fused_adamw_rejects_lists_of_different_lengths(path):
    p, g, m, v = torch.ones(3), torch.ones(3), torch.zeros(3), torch.zeros(3)
    with pytest.raises(ValueError):
        devshim_kernels.fused_adamw([p, p.clone()], [g], [m], [v], step=1, **hyper())
    with pytest.raises(ValueError):
        devshim_kernels.fused_adamw([p], [g], [m], [v], step=1, param_copies=[], **hyper())


def test_bad_sizes_and_copy_dtypes_are_refused_before_anything_is_written(path):
    p, g, m, v = torch.ones(8), torch.ones(8), torch.zeros(8), torch.zeros(8)
    with pytest.raises(ValueError, match="grad has 7 elements, the param 8"):
        devshim_kernels.host_adam_step(p, g[:7], m, v, step=1, **hyper())
    with pytest.raises(ValueError, match="max_exp_avg_sq has 9 elements"):
        devshim_kernels.host_adam_step(p, g, m, v, step=1, max_exp_avg_sq=torch.zeros(9), **hyper())
    with pytest.raises(ValueError, match="param_copy has 4 elements"):
        devshim_kernels.host_adam_step(p, g, m, v, step=1, param_copy=torch.zeros(4, dtype=torch.bfloat16),
                                       **hyper())
    with pytest.raises(TypeError, match=r"param_copy must be torch\.bfloat16 or torch\.float16"):
        devshim_kernels.host_adam_step(p, g, m, v, step=1, param_copy=torch.zeros(8), **hyper())
    with pytest.raises(ValueError, match="must be contiguous"):
        devshim_kernels.host_adam_step(p, torch.ones(4, 2).t(), m, v, step=1, **hyper())
    assert torch.equal(p, torch.ones(8)) and torch.equal(m, torch.zeros(8))


def test_strided_tensors_and_other_dtypes_in_the_same_list_are_updated_alike(path):
    """What the native kernel does not take (strided tensors, fp64) runs on PyTorch within the same call, and
    gets the same update as contiguous fp32 tensors do; tensors of the same shape need not be contiguous."""
    (init,) = _random([(64, 33)], seed=17)
    (grad,) = _random([(64, 33)], seed=18)
    expected = [init.clone(), torch.zeros_like(init), torch.zeros_like(init), torch.zeros_like(init)]
    devshim_kernels.host_adam_step(expected[0], grad, expected[1], expected[2], step=1, max_exp_avg_sq=expected[3],
                                   **hyper())

    def strided(t: torch.Tensor) -> torch.Tensor:
        return t.t().contiguous().t()

    lists = {"contiguous": [init.clone(), grad, *(torch.zeros_like(init) for _ in range(3))],
             "strided": [strided(t) for t in (init, grad, *(torch.zeros_like(init) for _ in range(3)))],
             "fp64": [t.double() for t in (init, grad, *(torch.zeros_like(init) for _ in range(3)))]}
    copies = [torch.zeros(64, 33, dtype=torch.bfloat16), torch.zeros(33, 64, dtype=torch.bfloat16).t(), None]
    params, grads, exp_avgs, exp_avg_sqs, maxima = (list(column) for column in zip(*lists.values(), strict=True))
    devshim_kernels.fused_adamw(params, grads, exp_avgs, exp_avg_sqs, step=1, max_exp_avg_sqs=maxima,
                                param_copies=copies, **hyper())
    for name, (p, _, m, v, vmax) in lists.items():
        torch.testing.assert_close((p.float(), m.float(), v.float(), vmax.float()), tuple(expected), **FP32, msg=name)
    for p, copy in zip(params[:2], copies[:2], strict=True):
        assert torch.equal(bits(copy), bits(p.to(torch.bfloat16)))


def test_empty_tensors_are_skipped(path):
    empty, p = torch.empty(0), torch.ones(3)
    devshim_kernels.fused_adamw([empty, p], [empty, torch.ones(3)], [empty, torch.zeros(3)], [empty, torch.zeros(3)],
                                step=1, param_copies=[torch.empty(0, dtype=torch.bfloat16), None], **hyper())
    assert (p < 1).all()


# -- host_adam_rollback --------------------------------------------------------------------------------------------

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


def test_host_adam_rollback_rewrites_the_param_copy_and_refuses_amsgrad(path):
    (p,) = _random([(1001,)], seed=19)
    (grad,) = _random([(1001,)], seed=20)
    m, v, copy = torch.zeros(1001), torch.zeros(1001), torch.zeros(1001, dtype=torch.float16)
    before = p.clone()
    devshim_kernels.host_adam_step(p, grad, m, v, step=1, param_copy=copy, **hyper())
    devshim_kernels.host_adam_rollback(p, grad, m, v, step=1, param_copy=copy, **hyper())
    torch.testing.assert_close(p, before, **FP32)
    assert torch.equal(copy, p.to(torch.float16))
    with pytest.raises(ValueError, match="amsgrad step cannot be undone"):
        devshim_kernels.host_adam_rollback(p, grad, m, v, step=1, max_exp_avg_sq=torch.zeros(1001), **hyper())


def test_host_adam_rollback_of_bf16_params_with_fp32_states_restores_them_to_bf16_resolution(path):
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


@pytest.mark.parametrize("adamw,amsgrad", adam_identity.MODES, ids=["adamw", "adamw-amsgrad", "adam", "adam-amsgrad"])
def test_fp32_host_adam_equals_torchs_fused_adam_bit_for_bit_but_in_its_scalar_tail(path, adamw, amsgrad):
    """The claim in docs/performance.md (``bench/adam_identity.py`` reports it): over 120 steps and odd sizes, every
    element before the last ``numel % W`` (W: the float width of torch's vectorized kernel) is bit-identical; torch
    computes the tail with contracted scalar code, and there the results stay within 1e-6 relative."""
    for numel in adam_identity.SIZES:
        result = adam_identity.compare(numel, adamw, amsgrad)
        assert result["body_identical"], (numel, result)
        assert result["tail_max_relative"] <= 1e-6, (numel, result)
