"""Kernel conformance on the emulated vendor device: the plugins' kernels and the simulated vendor ops against
``devshim_kernels`` computed on CPU (forward and backward), plus the vendor ops' documented semantics.

Run once per vendor, each in a process of its own: ``DEVSHIM_EMULATE=ascend pytest tests/emulated`` and
``DEVSHIM_EMULATE=sophgo ...``. Tests of one vendor's raw API carry ``only(vendor)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import devshim_kernels as dk
import pytest
import torch

from devshim_core.testing import compare
from emulated.conftest import DEVICE_TYPE, VENDOR, only

Tensor = torch.Tensor
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


def close(actual: Tensor, expected: Tensor, dtype: torch.dtype = torch.float32) -> None:
    compare.close(actual, expected, DEVICE_TYPE, dtype)


def conform(device_fn: Callable[..., Tensor], reference_fn: Callable[..., Tensor], inputs: dict[str, Any],
            grads: tuple[str, ...], dtype: torch.dtype) -> Tensor:
    return compare.conform(device_fn, reference_fn, inputs, grads, dtype, DEVICE_TYPE)


# The plugins' kernels against devshim_kernels (layouts, masks, dtypes, forward and backward) are checked by
# devshim's conformance kit, which `make test` runs on each emulated vendor: pytest --devshim-plugin=<vendor>.

B, HQ, D = 2, 4, 8


def test_records(plugin: Any) -> None:
    attention, optimizer = plugin.attention_kernels(), plugin.optimizer_kernels()
    assert optimizer.host_adam_step is dk.host_adam_step and optimizer.host_adam_rollback is dk.host_adam_rollback
    vendor_op = {"ascend": "npu_fusion_attention", "sophgo": "rmsnorm_forward"}[VENDOR]
    assert vendor_op in attention.source and "devshim_kernels" in attention.source
    assert {"ascend": "npu_apply_adam_w", "sophgo": "_fused_adamw_"}[VENDOR] in optimizer.source


# -- Ascend: torch_npu's ops, their documented semantics -----------------------------------------------------------

def _npu() -> Any:
    return importlib.import_module("torch_npu")


def _qkv(s_q: int = 6, s_kv: int = 6, hkv: int = HQ, dtype: torch.dtype = torch.float32) -> tuple[Tensor, ...]:
    return (torch.randn(B, HQ, s_q, D, dtype=dtype), torch.randn(B, hkv, s_kv, D, dtype=dtype),
            torch.randn(B, hkv, s_kv, D, dtype=dtype))


def _to_dev(*tensors: Tensor) -> list[Tensor]:
    return [t.to(DEVICE_TYPE) for t in tensors]


@only("ascend")
def test_npu_ops_are_dispatcher_ops() -> None:
    npu = _npu()
    for name in ("npu_fusion_attention", "npu_rms_norm", "npu_swiglu", "npu_rotary_mul"):
        assert getattr(npu, name) is getattr(torch.ops.npu, name)
    assert isinstance(torch.ops.npu.npu_apply_adam_w.out, torch._ops.OpOverload)


@only("ascend")
def test_npu_fusion_attention_mask_polarity_default_scale_and_tuple() -> None:
    npu = _npu()
    q, k, v = _qkv(6, 10)
    masked = torch.rand(6, 10) > 0.6
    masked[:, 0] = False
    result = npu.npu_fusion_attention(*_to_dev(q, k, v), HQ, "BNSD", atten_mask=masked.to(DEVICE_TYPE))
    assert isinstance(result, tuple) and len(result) == 7
    out, softmax_max, softmax_sum, softmax_out, seed, offset, numels = result
    # True = masked out, and the default scale is 1.0 (not 1/sqrt(d))
    close(out, dk.attention(q, k, v, attn_mask=~masked, scale=1.0))
    assert not torch.allclose(out.cpu(), dk.attention(q, k, v, attn_mask=~masked), atol=1e-3)
    for stat in (softmax_max, softmax_sum):
        assert stat.shape == (B, HQ, 6, 8) and stat.dtype == torch.float32 and stat.device.type == DEVICE_TYPE
    assert softmax_out.numel() == 0 and (seed, offset, numels) == (0, 0, 0)
    dropped = npu.npu_fusion_attention(*_to_dev(q, k, v), HQ, "BNSD", keep_prob=0.9)
    assert dropped[6] == B * HQ * 6 * 10


@only("ascend")
@pytest.mark.parametrize("layout", ["BNSD", "SBH", "TND"])
def test_npu_fusion_attention_returns_each_querys_softmax_max_and_sum(layout: str) -> None:
    """What MindSpeed's ring attention reads: max + log(sum) is the log-sum-exp of the scaled, kept scores; a query
    with no key has -inf and 0. No gradient flows through them, as on the hardware."""
    npu = _npu()
    q, k, v = _qkv(6, 6, hkv=2)
    masked = torch.zeros(6, 6, dtype=torch.bool).triu_(1)
    masked[4] = True  # query 4 may attend to nothing
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.3).masked_fill(masked, float("-inf"))
    want = torch.logsumexp(scores, -1)  # [B, N, S]
    if layout == "BNSD":
        args, shape = (q, k, v), (B, HQ, 6, 8)
    elif layout == "SBH":
        args, shape = tuple(dk.from_bnsd(t, "SBH") for t in (q, k, v)), (B, HQ, 6, 8)
    else:  # one sequence per batch element, packed
        args = tuple(t.transpose(1, 2).flatten(0, 1) for t in (q, k, v))
        shape, want = (B * 6, HQ, 8), want.transpose(1, 2).flatten(0, 1)
    kwargs = {"actual_seq_qlen": [6, 12], "actual_seq_kvlen": [6, 12]} if layout == "TND" else {}
    query = args[0].to(DEVICE_TYPE).requires_grad_()
    _, softmax_max, softmax_sum = npu.npu_fusion_attention(
        query, *_to_dev(*args[1:]), HQ, layout, atten_mask=masked.to(DEVICE_TYPE), scale=0.3, **kwargs)[:3]
    assert softmax_max.shape == softmax_sum.shape == shape and not softmax_max.requires_grad
    assert torch.equal(softmax_max[..., 0:1].expand(shape), softmax_max)  # each row's statistic, 8 times
    lse = (softmax_max[..., 0] + torch.log(softmax_sum[..., 0])).cpu()
    assert torch.allclose(lse.nan_to_num(neginf=-1.0), want.nan_to_num(neginf=-1.0), atol=1e-5)
    assert torch.all(softmax_sum[..., 0].cpu()[want == float("-inf")] == 0)


@only("ascend")
@pytest.mark.parametrize("sparse_mode", [2, 3])
def test_npu_fusion_attention_causal_sparse_modes(sparse_mode: int) -> None:
    npu = _npu()
    q, k, v = _qkv(5, 9, hkv=2)
    compressed = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1).to(DEVICE_TYPE)
    out = npu.npu_fusion_attention(*_to_dev(q, k, v), HQ, "BNSD", atten_mask=compressed, scale=0.25,
                                   sparse_mode=sparse_mode)[0]
    alignment = "top_left" if sparse_mode == 2 else "bottom_right"
    close(out, dk.attention(q, k, v, causal=True, causal_alignment=alignment, scale=0.25))
    # without atten_mask the vendor computes full attention, whatever sparse_mode says
    full = npu.npu_fusion_attention(*_to_dev(q, k, v), HQ, "BNSD", scale=0.25, sparse_mode=sparse_mode)[0]
    close(full, dk.attention(q, k, v, scale=0.25))


@only("ascend")
def test_npu_fusion_attention_refusals() -> None:
    npu = _npu()
    q, k, v = _to_dev(*_qkv())
    with pytest.raises(ValueError, match="compressed causal mask"):
        npu.npu_fusion_attention(q, k, v, HQ, "BNSD", atten_mask=torch.ones(6, 6, dtype=torch.bool,
                                                                           device=DEVICE_TYPE).triu(1), sparse_mode=2)
    band = torch.ones(6, 6, dtype=torch.bool, device=DEVICE_TYPE)
    with pytest.raises(NotImplementedError, match="sparse_mode=4"):
        npu.npu_fusion_attention(q, k, v, HQ, "BNSD", atten_mask=band, sparse_mode=4)
    with pytest.raises(TypeError, match="bool or uint8"):
        npu.npu_fusion_attention(q, k, v, HQ, "BNSD", atten_mask=torch.zeros(6, 6, device=DEVICE_TYPE))
    with pytest.raises(ValueError, match="head_num"):
        npu.npu_fusion_attention(q, k, v, 3, "BNSD")
    with pytest.raises(RuntimeError, match="NPU tensors only"):
        npu.npu_fusion_attention(q.cpu(), k, v, HQ, "BNSD")


@only("ascend")
def test_npu_fusion_attention_tnd_lengths_without_leading_zero() -> None:
    npu = _npu()
    q, k, v = (torch.randn(9, HQ, D) for _ in range(3))  # lengths [2, 3] then a token outside every sequence
    args = (*_to_dev(q, k, v), HQ, "TND")
    out = npu.npu_fusion_attention(*args, actual_seq_qlen=[2, 5, 0], actual_seq_kvlen=[2, 5, 0], scale=0.5)
    expected = dk.attention(q[:5], k[:5], v[:5], layout="TND", cu_seqlens_q=[0, 2, 5], scale=0.5)
    close(out[0][:5], expected)
    assert out[0][5:].abs().max().item() == 0.0  # trailing tokens take no part
    assert out[1].shape == (9, HQ, 8)
    with pytest.raises(ValueError, match="actual_seq_qlen"):
        npu.npu_fusion_attention(*args)


@only("ascend")
def test_npu_fusion_attention_pse_is_added_before_scaling() -> None:
    npu = _npu()
    q, k, v = _qkv()
    pse = torch.randn(1, HQ, 6, 6)
    out = npu.npu_fusion_attention(*_to_dev(q, k, v), HQ, "BNSD", pse=pse.to(DEVICE_TYPE), scale=0.5)[0]
    close(out, dk.attention(q, k, v, attn_mask=pse * 0.5, scale=0.5))


@only("ascend")
def test_npu_rms_norm_returns_y_and_rstd() -> None:
    npu = _npu()
    x, gamma = torch.randn(3, 4, 16), torch.randn(4, 16)  # gamma over the two trailing dimensions
    y, rstd = npu.npu_rms_norm(*_to_dev(x, gamma), epsilon=1e-5)
    expected_rstd = torch.rsqrt(x.pow(2).mean((-2, -1), keepdim=True) + 1e-5)
    close(rstd, expected_rstd)
    close(y, x * expected_rstd * gamma)
    assert rstd.shape == (3, 1, 1) and rstd.dtype == torch.float32
    bf16 = npu.npu_rms_norm(torch.randn(2, 8, dtype=torch.bfloat16, device=DEVICE_TYPE),
                            torch.randn(8, dtype=torch.bfloat16, device=DEVICE_TYPE))
    assert bf16[0].dtype == torch.bfloat16 and bf16[1].dtype == torch.float32
    with pytest.raises(TypeError, match="gamma"):
        npu.npu_rms_norm(torch.randn(2, 8, device=DEVICE_TYPE), torch.randn(8, dtype=torch.float16,
                                                                             device=DEVICE_TYPE))


@only("ascend")
def test_npu_swiglu_split_dim_and_validation() -> None:
    npu = _npu()
    out = conform(lambda x: npu.npu_swiglu(x, dim=1),
                  lambda x: torch.nn.functional.silu(x.chunk(2, 1)[0]) * x.chunk(2, 1)[1],  # a = the first half
                  {"x": torch.randn(4, 6, 3)}, ("x",), torch.float32)
    assert out.shape == (4, 3, 3) and out.is_contiguous()
    dev = torch.randn(4, 6, device=DEVICE_TYPE)
    with pytest.raises(RuntimeError, match="contiguous"):
        npu.npu_swiglu(dev.t())
    with pytest.raises(RuntimeError, match="odd"):
        npu.npu_swiglu(torch.randn(4, 5, device=DEVICE_TYPE))
    with pytest.raises(TypeError, match="float32"):
        npu.npu_swiglu(torch.ones(4, 6, dtype=torch.float64, device=DEVICE_TYPE))
    with pytest.raises(ValueError, match="1 to 8"):
        npu.npu_swiglu(torch.randn([1] * 8 + [2], device=DEVICE_TYPE))
    with pytest.raises(RuntimeError, match="empty"):
        npu.npu_swiglu(torch.randn(0, 4, device=DEVICE_TYPE))


def _vendor_rotary(x: Tensor, r1: Tensor, r2: Tensor, mode: str) -> Tensor:
    """torch_npu's documented formulas."""
    if mode == "half":
        x1, x2 = torch.chunk(x, 2, -1)
        x_new = torch.cat((-x2, x1), dim=-1)
    else:
        x_new = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return r1 * x + r2 * x_new


@only("ascend")
@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_npu_rotary_mul_modes(mode: str) -> None:
    npu = _npu()
    angles = torch.rand(1, 6, 1, D)
    inputs = {"x": torch.randn(B, 6, HQ, D), "r1": angles.cos(), "r2": angles.sin()}
    conform(lambda x, r1, r2: npu.npu_rotary_mul(x, r1, r2, rotary_mode=mode),
            lambda x, r1, r2: _vendor_rotary(x, r1, r2, mode), inputs, ("x", "r1", "r2"), torch.float32)
    with pytest.raises(ValueError, match="4-D"):
        npu.npu_rotary_mul(*_to_dev(torch.randn(6, D), angles.cos()[0, :, 0], angles.sin()[0, :, 0]))


def _vendor_adam_w(var: Tensor, m: Tensor, v: Tensor, grad: Tensor, b1_power: float, b2_power: float, lr: float,
                   wd: float, b1: float, b2: float, eps: float) -> Tensor:
    """The op-plugin test's CPU reference for npu_apply_adam_w (no amsgrad, no maximize)."""
    m.mul_(b1).add_(grad, alpha=1 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    var_t = var * (1 - lr * wd)
    denom = torch.sqrt(v / (1 - b2_power * b2)) + eps
    return var_t - lr * m / (1 - b1_power * b1) / denom


@only("ascend")
def test_npu_apply_adam_w_semantics() -> None:
    npu = _npu()
    var, m, v, grad = torch.randn(64) * 3, torch.rand(64), torch.rand(64), torch.randn(64)
    dv, dm, dvv, dg = _to_dev(var, m, v, grad)
    args = (0.7, 0.95, 0.01, 0.05, 0.9, 0.999, 1e-6)
    result = npu.npu_apply_adam_w(*args, dg, None, False, False, out=(dv, dm, dvv))
    assert result[0] is dv and result[1] is dm and result[2] is dvv
    expected = _vendor_adam_w(var, m, v, grad, 0.7, 0.95, 0.01, 0.05, 0.9, 0.999, 1e-6)
    close(dv, expected)
    close(dm, m)
    close(dvv, v)
    with pytest.raises(RuntimeError, match="not implemented for Tensor"):
        npu.npu_apply_adam_w(*args, dg, None, False, False)
    with pytest.raises(RuntimeError, match="max_grad_norm"):
        npu.npu_apply_adam_w(*args, dg, None, True, False, out=(dv, dm, dvv))
    with pytest.raises(RuntimeError, match="NPU tensors only"):
        npu.npu_apply_adam_w(*args, grad, None, False, False, out=(dv, dm, dvv))


@only("ascend")
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
def test_npu_fused_adamw_matches_torch_adamw(amsgrad: bool) -> None:
    """Bias correction and weight decay over several steps and two groups (DeepSpeed PRs 5775/5777 fixed both in
    its NPU FusedAdam): the optimizer passes beta**(t-1) and the kernel multiplies by beta once more."""
    from torch_npu.optim import NpuFusedAdamW

    cpu = [torch.nn.Parameter(torch.randn(5, 4)), torch.nn.Parameter(torch.randn(7))]
    dev = [torch.nn.Parameter(p.detach().to(DEVICE_TYPE)) for p in cpu]

    def groups(ps: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
        return [{"params": [ps[0]]}, {"params": [ps[1]], "lr": 3e-2, "weight_decay": 0.0}]

    reference = torch.optim.AdamW(groups(cpu), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, amsgrad=amsgrad)
    fused = NpuFusedAdamW(groups(dev), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, amsgrad=amsgrad)
    for _ in range(6):
        for c, d in zip(cpu, dev, strict=True):
            c.grad = torch.randn(c.shape)
            d.grad = c.grad.to(DEVICE_TYPE)
        reference.step()
        fused.step()
    for c, d in zip(cpu, dev, strict=True):
        assert d.device.type == DEVICE_TYPE
        torch.testing.assert_close(d.detach().cpu(), c.detach(), atol=1e-6, rtol=1e-5)
    assert fused.state[dev[0]]["step"] == 6


@only("ascend")
def test_npu_ops_refuse_host_tensors() -> None:
    npu = _npu()
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="NPU tensors only"):
        npu.npu_rms_norm(x, torch.randn(8, device=DEVICE_TYPE))
    with pytest.raises(RuntimeError, match="NPU tensors only"):
        torch.ops.npu.npu_swiglu(x)
    with pytest.raises(RuntimeError, match="NPU tensors only"):
        npu.npu_rotary_mul(torch.randn(1, 2, 3, 8), *_to_dev(torch.ones(1, 1, 3, 8), torch.ones(1, 1, 3, 8)))


# -- Sophgo: torch_tpu's my_ops out-parameter kernels --------------------------------------------------------------

def _vendor_rmsnorm(x: Tensor, scale: Tensor | None, bias: Tensor | None, dims: tuple[int, ...], eps: float) -> Tensor:
    """Sophgo's CPU reference (python/regression/test_llm/test_rmsnorm.py), over ``dims``."""
    y = x / torch.sqrt(torch.mean(torch.square(x), dim=dims, keepdim=True) + eps)
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    return y


@only("sophgo")
@pytest.mark.parametrize("scale, bias", [(True, True), (True, False), (False, True), (False, False)])
def test_my_ops_rmsnorm_forward_out_parameter(scale: bool, bias: bool) -> None:
    x = torch.randn(4, 1, 1, 32)
    s, b = (torch.rand(32) if scale else None), (torch.rand(32) if bias else None)
    out = torch.empty(4, 1, 1, 32, device=DEVICE_TYPE)
    s_dev = None if s is None else s.to(DEVICE_TYPE)
    b_dev = None if b is None else b.to(DEVICE_TYPE)
    returned = torch.ops.my_ops.rmsnorm_forward(x.to(DEVICE_TYPE), s_dev, b_dev, out, 3, 1e-5)
    assert returned is out  # written in place and returned, as the vendor's
    close(out, _vendor_rmsnorm(x, s, b, (-1,), 1e-5))


@only("sophgo")
def test_my_ops_rmsnorm_axis_and_backward() -> None:
    x, s, b = torch.randn(3, 4, 8), torch.rand(4, 8), torch.rand(4, 8)
    out = torch.empty(3, 4, 8, device=DEVICE_TYPE)
    torch.ops.my_ops.rmsnorm_forward(*_to_dev(x, s, b), out, 1, 1e-6)  # normalise dims 1 and 2
    close(out, _vendor_rmsnorm(x, s, b, (1, 2), 1e-6))
    with pytest.raises(ValueError, match="axis"):
        torch.ops.my_ops.rmsnorm_forward(*_to_dev(x, s, b), out, -1, 1e-6)
    # backward: gradients written into the given buffers
    xc, sc, bc = (t.clone().requires_grad_() for t in (x, s, b))
    grad = torch.randn(3, 4, 8)
    _vendor_rmsnorm(xc, sc, bc, (1, 2), 1e-6).backward(grad)
    gx, gs, gb = (torch.empty(t.shape, device=DEVICE_TYPE) for t in (x, s, b))
    rms = torch.zeros(3, 4, 8, device=DEVICE_TYPE)
    returned = torch.ops.my_ops.rmsnorm_backward(*_to_dev(grad, x, s, b), rms, gx, gs, gb, 1, 1e-6)
    assert returned is rms
    for got, want in ((gx, xc.grad), (gs, sc.grad), (gb, bc.grad)):
        close(got, want)


@only("sophgo")
def test_my_ops_llama_mlp_forward() -> None:
    tokens, h, i = 5, 16, 24
    x, w0, w1, w_down = torch.randn(tokens, h), torch.randn(i, h), torch.randn(i, h), torch.randn(h, i)
    out, fc1, m0 = (torch.empty(shape, device=DEVICE_TYPE) for shape in ((tokens, h), (tokens, i), (tokens, i)))
    torch.ops.my_ops.llama_mlp_forward(*_to_dev(x, w0, w1, w_down.t().contiguous()), None, None, None, fc1, m0, out,
                                       True)
    # Sophgo's reference (python/test/llama_mlp.py): mm2(mm0(x) * silu(mm1(x)))
    close(out, (x @ w0.t() * torch.nn.functional.silu(x @ w1.t())) @ w_down.t())
    close(fc1, x @ w1.t())
    close(m0, x @ w0.t())


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@only("sophgo")
def test_my_ops_llama_attention_forward() -> None:
    """Against Sophgo's reference (python/utest_ops/llama_attn_fwd_bwd.py: attention()): rotary on q and k, additive
    triu mask per token row, grouped-query heads, log-sum-exp written."""
    batch, seq, hq, hkv, d = 2, 6, 4, 2, 8
    q, k, v = torch.randn(batch * seq, hq, d), torch.randn(batch * seq, hkv, d), torch.randn(batch * seq, hkv, d)
    theta = torch.rand(seq, 1, d // 2).repeat(1, 1, 2)
    cos, sin = theta.cos(), theta.sin()
    mask = torch.triu(torch.full((seq, seq), -10000.0), diagonal=1).repeat(batch, 1)  # [batch * seq, seq]
    scale = d ** -0.5
    out = torch.empty(batch * seq, hq, d, device=DEVICE_TYPE)
    lse = torch.empty(batch * seq, hq, 1, device=DEVICE_TYPE)
    lengths = torch.tensor([seq] * batch, dtype=torch.int32)  # host tensor, as the vendor reads it
    torch.ops.my_ops.llama_attention_forward(out, *_to_dev(q, k, v, cos, sin, mask), lse, lengths, seq, scale, 0.0,
                                             batch)
    qr = (q.view(batch, seq, hq, d) * cos + _rotate_half(q.view(batch, seq, hq, d)) * sin).transpose(1, 2)
    kr = k.view(batch, seq, hkv, d) * cos + _rotate_half(k.view(batch, seq, hkv, d)) * sin
    kr = kr.repeat_interleave(hq // hkv, 2).transpose(1, 2)
    vr = v.view(batch, seq, hkv, d).repeat_interleave(hq // hkv, 2).transpose(1, 2)
    scores = qr @ kr.transpose(-1, -2) * scale + mask.view(batch, 1, seq, seq)
    expected = (scores.softmax(-1) @ vr).transpose(1, 2).reshape(batch * seq, hq, d)
    close(out, expected)
    close(lse, torch.logsumexp(scores, -1).transpose(1, 2).reshape(batch * seq, hq, 1))


@only("sophgo")
def test_my_ops_refuse_host_tensors_and_have_no_standalone_swiglu_or_rotary() -> None:
    out = torch.empty(2, 8, device=DEVICE_TYPE)
    with pytest.raises(RuntimeError, match="TPU tensors only"):
        torch.ops.my_ops.rmsnorm_forward(torch.randn(2, 8), None, None, out, 1, 1e-6)
    for name in ("swiglu", "rotary", "rotary_mul"):
        assert not hasattr(torch.ops.my_ops, name)


@only("sophgo")
def test_fused_adamw_is_torch_fused_kernel_on_tpu() -> None:
    """What ``torch.optim.AdamW(fused=True)`` runs on Sophgo's device."""
    param = torch.nn.Parameter(torch.randn(6, 2))
    dev = torch.nn.Parameter(param.detach().to(DEVICE_TYPE))
    reference = torch.optim.AdamW([param], lr=1e-2, weight_decay=0.1)
    fused = torch.optim.AdamW([dev], lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(4):
        param.grad = torch.randn(6, 2)
        dev.grad = param.grad.to(DEVICE_TYPE)
        reference.step()
        fused.step()
    torch.testing.assert_close(dev.detach().cpu(), param.detach(), atol=1e-6, rtol=1e-5)
