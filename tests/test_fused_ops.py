"""rms_norm, swiglu and rotary: each custom autograd Function against the math written out (fp64), forward and
backward, in fp32 and bf16, for contiguous and strided inputs; gradcheck in fp64. Every test runs twice: with the
native row-wise kernels (which serve the contiguous fp32 cases of rms_norm and swiglu) and without them."""

from __future__ import annotations

import devshim_kernels as K
import pytest
import torch
import torch.nn.functional as F
from devshim_kernels import glu, norm, rope
from devshim_kernels._native import rowwise

OP_MODULES = (norm, rope, glu)

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-4}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def randn(*shape, dtype=torch.float32, seed=0, grad=True):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return t.requires_grad_(grad)


@pytest.fixture(autouse=True, params=["native", "torch-ops"])
def custom_functions_at_every_size(request, monkeypatch):
    """Tensors below MIN_CUSTOM_NUMEL take the plain expression; these small test tensors must exercise the
    custom autograd Functions, so the threshold is lifted (the plain path has its own test at the end)."""
    for module in OP_MODULES:
        monkeypatch.setattr(module, "MIN_CUSTOM_NUMEL", 0)
    if request.param == "native" and rowwise.LIBRARY is None:
        pytest.skip(f"the native row-wise kernels are not built: {rowwise.REASON}")
    if request.param == "torch-ops":
        monkeypatch.setattr(rowwise, "LIBRARY", None)


def assert_close_to(got, want, dtype):
    """Within ``TOL[dtype]``, the absolute part scaled to the reference's magnitude: a weight gradient sums
    hundreds of rows, and its rounding grows with it."""
    atol = TOL[dtype]["atol"] * max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want.to(got.dtype), atol=atol, rtol=TOL[dtype]["rtol"])


def assert_forward_and_backward_match(ours_fn, math_fn, inputs, dtype):
    """``ours_fn(*inputs)`` and the gradients of every input that requires grad agree with ``math_fn`` in fp64."""
    out = ours_fn(*inputs)
    ref_inputs = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    expected = math_fn(*ref_inputs)
    assert_close_to(out, expected, dtype)
    grad_out = randn(*out.shape, seed=9, grad=False)
    wanted = [i for i, t in enumerate(inputs) if t.requires_grad]
    got = torch.autograd.grad(out, [inputs[i] for i in wanted], grad_out.to(out.dtype))
    want = torch.autograd.grad(expected, [ref_inputs[i] for i in wanted], grad_out.double())
    for g, w in zip(got, want, strict=True):
        assert_close_to(g, w, dtype)


# --- rms_norm ------------------------------------------------------------------------------------------------


def rms_math(x, w=None, eps=1e-6):
    normed = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed if w is None else normed * w


@DTYPES
@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "no-weight"])
@pytest.mark.parametrize("shape", [(2, 5, 16), (300, 2048), (7,)], ids=["BSH", "rows-over-3-blocks", "1-D"])
def test_rms_norm_is_x_over_its_root_mean_square_times_weight(shape, weighted, dtype):
    x = randn(*shape, dtype=dtype)
    w = randn(shape[-1], dtype=dtype, seed=1) if weighted else None
    inputs = (x, w) if weighted else (x,)
    assert_forward_and_backward_match(lambda x, w=None: K.rms_norm(x, w, 1e-6), rms_math, inputs, dtype)


def test_rms_norm_agrees_with_torchs_own_rms_norm():
    x, w = randn(4, 6, 32), randn(32, seed=1)
    torch.testing.assert_close(K.rms_norm(x, w, 1e-5), F.rms_norm(x, (32,), w, 1e-5))


def test_rms_norm_rounds_the_normalised_value_to_the_input_dtype_before_the_weight_like_megatron():
    x, w = randn(8, 64, dtype=torch.bfloat16, grad=False), randn(64, seed=1, grad=False)  # bf16 data, fp32 weight
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * w
    out = K.rms_norm(x, w, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)
    assert_forward_and_backward_match(lambda x, w: K.rms_norm(x, w, 1e-6), rms_math,
                                      (x.requires_grad_(), w.requires_grad_()), torch.bfloat16)


@pytest.mark.parametrize("view", ["transposed", "strided-rows"])
def test_rms_norm_accepts_non_contiguous_input(view):
    base = randn(16, 12)
    x = base.t() if view == "transposed" else base[:, ::2]
    w = randn(x.shape[-1], seed=1)
    assert not x.is_contiguous()
    assert_forward_and_backward_match(lambda x, w: K.rms_norm(x, w, 1e-6), rms_math, (x, w), torch.float32)


@pytest.mark.parametrize("weight", ["trained", "frozen", "none"])
def test_rms_norm_gradchecks_in_fp64(weight):
    x = randn(3, 4, 6, dtype=torch.float64)
    w = None if weight == "none" else randn(6, dtype=torch.float64, seed=1, grad=weight == "trained")
    assert torch.autograd.gradcheck(lambda x: K.rms_norm(x, w, 1e-6), (x,))
    if weight == "trained":
        assert torch.autograd.gradcheck(lambda x, w: K.rms_norm(x, w, 1e-6), (x, w))


def test_rms_norm_refuses_a_weight_of_the_wrong_size():
    with pytest.raises(ValueError, match="does not match"):
        K.rms_norm(torch.randn(2, 8), torch.randn(4))


# --- swiglu --------------------------------------------------------------------------------------------------


def swiglu_math(x):
    a, b = x.chunk(2, dim=-1)
    return a * torch.sigmoid(a) * b


@DTYPES
@pytest.mark.parametrize("shape", [(2, 5, 16), (64, 1024)])
def test_swiglu_is_silu_of_the_first_half_times_the_second(shape, dtype):
    assert_forward_and_backward_match(K.swiglu, swiglu_math, (randn(*shape, dtype=dtype),), dtype)


def test_swiglu_accepts_a_strided_slice_of_a_fused_projection():
    projection = randn(6, 40)
    x = projection[:, 4:36]  # rows of stride 40, as when gate and up come out of one larger matmul
    assert not x.is_contiguous()
    assert_forward_and_backward_match(K.swiglu, swiglu_math, (x,), torch.float32)


def test_swiglu_gradchecks_in_fp64_and_refuses_an_odd_last_dimension():
    assert torch.autograd.gradcheck(K.swiglu, (randn(3, 2, 8, dtype=torch.float64),))
    with pytest.raises(ValueError, match="even"):
        K.swiglu(torch.randn(2, 5))


# --- rotary --------------------------------------------------------------------------------------------------


def rotary_math(x, cos, sin, interleaved=False):
    """Megatron's ``_apply_rotary_pos_emb_bshd``: cos/sin cast to x's dtype, partial rotary passes the rest."""
    rot = cos.shape[-1]
    t, rest = x[..., :rot], x[..., rot:]
    if interleaved:
        turned = torch.stack((-t[..., 1::2], t[..., 0::2]), dim=-1).flatten(-2)
    else:
        t1, t2 = t.chunk(2, dim=-1)
        turned = torch.cat((-t2, t1), dim=-1)
    return torch.cat((t * cos.to(x.dtype) + turned * sin.to(x.dtype), rest), dim=-1)


def angles(seq, dim, interleaved, dtype=torch.float32):
    """Per-position frequencies as Megatron builds them: each frequency twice, side by side when interleaved."""
    theta = torch.arange(seq, dtype=dtype)[:, None] * (10000 ** (-torch.arange(0, dim, 2, dtype=dtype) / dim))
    return theta.repeat_interleave(2, -1) if interleaved else torch.cat((theta, theta), -1)


# x shape and where the sequence axis sits, as Megatron (SBND) and the vendors (BSND, BNSD) pass cos/sin
LAYOUTS = {
    "SBND-S11D": ((6, 2, 3, 8), lambda f: f[:, None, None]),
    "BSND-1S1D": ((2, 6, 3, 8), lambda f: f[None, :, None]),
    "BNSD-11SD": ((2, 3, 6, 8), lambda f: f[None, None]),
    "BNSD-SD": ((2, 3, 6, 8), lambda f: f),
    "full-shape": ((2, 3, 6, 8), lambda f: f.expand(2, 3, 6, 8).contiguous()),
}


@DTYPES
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rotary_is_x_cos_plus_rotated_x_sin_however_cos_and_sin_broadcast(layout, interleaved, dtype):
    shape, place = LAYOUTS[layout]
    freqs = place(angles(6, 8, interleaved))
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    out_fn = lambda x: K.rotary(x, cos, sin, interleaved=interleaved)  # noqa: E731
    assert_forward_and_backward_match(out_fn, lambda x: rotary_math(x, cos, sin, interleaved),
                                      (randn(*shape, dtype=dtype),), dtype)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_partial_rotary_rotates_the_first_channels_and_passes_the_rest(interleaved):
    x = randn(5, 2, 2, 12)
    freqs = angles(5, 8, interleaved)[:, None, None]
    out = K.rotary(x, freqs.cos(), freqs.sin(), interleaved=interleaved)
    assert torch.equal(out[..., 8:], x[..., 8:])
    assert_forward_and_backward_match(lambda x: K.rotary(x, freqs.cos(), freqs.sin(), interleaved=interleaved),
                                      lambda x: rotary_math(x, freqs.cos(), freqs.sin(), interleaved), (x,),
                                      torch.float32)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rotary_preserves_the_length_of_every_rotated_pair(interleaved):
    """A rotation is an isometry of each (x_i, x_pair(i)) plane: a check independent of the formula."""
    x = randn(4, 3, 8, grad=False)
    freqs = torch.randn(4, 1, 8)
    freqs = freqs[..., :4].repeat_interleave(2, -1) if interleaved else torch.cat((freqs[..., :4],) * 2, -1)
    out = K.rotary(x, freqs.cos(), freqs.sin(), interleaved=interleaved)
    first, second = ((slice(0, None, 2), slice(1, None, 2)) if interleaved else (slice(0, 4), slice(4, 8)))
    torch.testing.assert_close(out[..., first] ** 2 + out[..., second] ** 2, x[..., first] ** 2 + x[..., second] ** 2)


def test_rotary_of_a_query_sliced_from_a_fused_qkv_tensor():
    qkv = randn(5, 2, 3, 24)
    q = qkv[..., :8]  # non-contiguous view, as Megatron splits its fused projection
    freqs = angles(5, 8, False)[:, None, None]
    assert_forward_and_backward_match(lambda q: K.rotary(q, freqs.cos(), freqs.sin()),
                                      lambda q: rotary_math(q, freqs.cos(), freqs.sin()), (q,), torch.float32)


def test_rotary_differentiates_cos_and_sin_too_when_they_require_grad():
    x, cos, sin = randn(4, 2, 8), randn(4, 1, 8, seed=1), randn(4, 1, 8, seed=2)
    assert_forward_and_backward_match(K.rotary, rotary_math, (x, cos, sin), torch.float32)


def test_rotary_computes_in_the_dtype_of_x():
    x = randn(4, 2, 8, dtype=torch.bfloat16)
    freqs = angles(4, 8, False)[:, None]  # fp32 tables, as Megatron keeps them
    out = K.rotary(x, freqs.cos(), freqs.sin())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, rotary_math(x, freqs.cos(), freqs.sin()), **TOL[torch.bfloat16])


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("rot", [8, 4], ids=["full", "partial"])
def test_rotary_gradchecks_in_fp64(interleaved, rot):
    x = randn(3, 2, 1, 8, dtype=torch.float64)
    freqs = torch.randn(3, 1, 1, rot, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: K.rotary(x, freqs.cos(), freqs.sin(), interleaved=interleaved), (x,))


@pytest.mark.parametrize("cos_shape,sin_shape,message", [
    ((4, 1, 7), (4, 1, 7), "even"),
    ((4, 1, 10), (4, 1, 10), "even count that fits"),
    ((4, 1, 8), (4, 1, 4), "differ in shape"),
    ((4, 3, 8), (4, 3, 8), "do not broadcast"),
])
def test_rotary_refuses_tables_that_do_not_fit_x(cos_shape, sin_shape, message):
    with pytest.raises(ValueError, match=message):
        K.rotary(torch.randn(4, 1, 8), torch.randn(cos_shape), torch.randn(sin_shape))


# --- small tensors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["rms_norm", "swiglu", "rotary-half", "rotary-interleaved"])
def test_small_tensors_take_the_plain_expression_with_the_same_result(op, monkeypatch):
    monkeypatch.setattr(rowwise, "LIBRARY", None)  # which serves small host fp32 tensors too (the next tests)
    x, w = randn(4, 3, 16), randn(16, seed=1)
    freqs = angles(4, 16, op.endswith("interleaved"))[:, None]
    call = {"rms_norm": lambda x: K.rms_norm(x, w, 1e-6), "swiglu": K.swiglu,
            "rotary-half": lambda x: K.rotary(x, freqs.cos(), freqs.sin()),
            "rotary-interleaved": lambda x: K.rotary(x, freqs.cos(), freqs.sin(), interleaved=True)}[op]
    custom = call(x)
    (custom_grad,) = torch.autograd.grad(custom.sum(), x)
    for module in OP_MODULES:
        monkeypatch.setattr(module, "MIN_CUSTOM_NUMEL", 1 << 18)
    plain = call(x)
    custom_node = torch.autograd.function.BackwardCFunction  # the backward node of every autograd.Function
    assert isinstance(custom.grad_fn, custom_node) and not isinstance(plain.grad_fn, custom_node)
    torch.testing.assert_close(plain, custom)
    torch.testing.assert_close(torch.autograd.grad(plain.sum(), x)[0], custom_grad)


NATIVE_NODES = {"rms_norm": "_NativeRMSNormBackward", "swiglu": "_NativeSwiGLUBackward"}


@pytest.fixture
def native() -> None:
    if rowwise.LIBRARY is None:  # the torch-ops run of the module, or a build without the library
        pytest.skip("no native row-wise kernels in this run")


def _native_op(op: str, x: torch.Tensor) -> torch.Tensor:
    return K.rms_norm(x, torch.ones(x.shape[-1], dtype=x.dtype), 1e-6) if op == "rms_norm" else K.swiglu(x)


@pytest.mark.skipif(rowwise.LIBRARY is None, reason=f"the native row-wise kernels are not built: {rowwise.REASON}")
@pytest.mark.parametrize("op", ["rms_norm", "swiglu"])
def test_host_fp32_contiguous_tensors_take_the_native_kernels_where_one_thread_serves_them(op, native, monkeypatch):
    big = randn(256, 256)  # above the size aten splits over threads
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert type(_native_op(op, big).grad_fn).__name__ == NATIVE_NODES[op]
        torch.set_num_threads(2)
        assert type(_native_op(op, big).grad_fn).__name__ != NATIVE_NODES[op]  # torch's threads serve it better
        assert type(_native_op(op, randn(64, 128)).grad_fn).__name__ == NATIVE_NODES[op]  # one thread either way
        for other in (randn(64, 128, dtype=torch.bfloat16), randn(128, 64).t()):  # another dtype, strided
            assert type(_native_op(op, other).grad_fn).__name__ != NATIVE_NODES[op]
        monkeypatch.setenv("DEVSHIM_KERNELS_NATIVE", "0")  # the switch the host Adam honours too
        assert type(_native_op(op, randn(64, 128)).grad_fn).__name__ != NATIVE_NODES[op]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(rowwise.LIBRARY is None, reason=f"the native row-wise kernels are not built: {rowwise.REASON}")
def test_native_swiglu_saturates_as_torch_does_far_into_both_tails(native):
    a = torch.tensor([-1e4, -200.0, -88.0, -87.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 88.0, 1e4])
    x = torch.cat((a, torch.full_like(a, 3.0))).requires_grad_()
    out = glu._NativeSwiGLU.apply(x)
    torch.testing.assert_close(out, F.silu(a) * 3.0, atol=1e-30, rtol=1e-6)
    (grad,) = torch.autograd.grad(out.sum(), x)
    x_ref = x.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad((F.silu(x_ref[:11]) * x_ref[11:]).sum(), x_ref)
    torch.testing.assert_close(grad, want, atol=1e-30, rtol=1e-6)
