"""Kit: every kernel the plugin under test provides, against ``devshim_kernels`` computed on the host.

Inputs are drawn on the host, copied to the device, and the device result and the gradients of the named inputs
are compared with the reference's (``TOL``: fp32 and bf16). Attention runs over the dense layouts ``BNSD``,
``BSND``, ``BSH``, ``SBH`` and packed ``TND``, with boolean masks of both polarities, padding, additive masks,
both causal alignments and grouped-query heads; attention with its log-sum-exp (both outputs and their gradients);
the MoE grouped GEMM with an empty group. An op the plugin does not
provide is skipped, saying so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

dk = pytest.importorskip("devshim_kernels", reason="the kernel conformance compares against devshim_kernels")

from devshim_core.testing.compare import TOL, Tolerance, close, conform  # noqa: E402

Tensor = torch.Tensor
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


@pytest.fixture(scope="module")
def device_type(devshim_device: Any) -> str:
    return str(devshim_device.torch_device(devshim_device.current_device()))


def provided(devshim_device: Any, record: str, op: str) -> Callable[..., Any]:
    kernel = getattr(getattr(devshim_device, record), op)
    if kernel is None:
        pytest.skip(f"plugin {devshim_device.plugin!r} provides no {op} kernel")
    return kernel


@pytest.fixture
def attention(devshim_device: Any) -> Callable[..., Any]:
    return provided(devshim_device, "attention", "attention")


# -- attention -----------------------------------------------------------------------------------------------------

B, HQ, D = 2, 4, 8
DENSE = ["BNSD", "BSND", "BSH", "SBH"]
CASES = ["none", "keep_mask", "masked_mask", "padding_mask", "causal_top_left", "causal_bottom_right", "gqa_causal",
         "causal_and_mask", "additive_mask"]


def _dense_case(case: str, layout: str, dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, Any]]:
    s_q, s_kv = (6, 10) if case in ("keep_mask", "masked_mask", "causal_bottom_right", "causal_and_mask") else (6, 6)
    hkv = 2 if case == "gqa_causal" else HQ
    q, k, v = (torch.randn(B, h, s, D, dtype=dtype) for h, s in ((HQ, s_q), (hkv, s_kv), (hkv, s_kv)))
    inputs: dict[str, Any] = {"q": dk.from_bnsd(q, layout).contiguous(), "k": dk.from_bnsd(k, layout).contiguous(),
                              "v": dk.from_bnsd(v, layout).contiguous()}
    options: dict[str, Any] = {"layout": layout, "num_heads": HQ if layout in ("BSH", "SBH") else None}
    keep = torch.rand(B, 1, s_q, s_kv) > 0.4
    keep[..., 0] = True  # no fully masked row
    if case == "keep_mask":
        inputs["attn_mask"] = keep
    elif case == "masked_mask":  # True = masked out, 2-D
        inputs["attn_mask"] = ~keep[0, 0]
        options["mask_true_means_masked"] = True
    elif case == "padding_mask":  # [B, 1, 1, Skv] key padding: broadcast over queries
        inputs["attn_mask"] = keep[:, :, :1, :]
    elif case == "causal_and_mask":
        inputs["attn_mask"] = keep
        options.update(causal=True, causal_alignment="bottom_right")
    elif case == "additive_mask":
        inputs["attn_mask"] = torch.randn(1, 1, s_q, s_kv, dtype=dtype)
    if case in ("causal_top_left", "gqa_causal"):
        options["causal"] = True
    elif case == "causal_bottom_right":
        options.update(causal=True, causal_alignment="bottom_right")
    if case == "none":
        options["scale"] = 0.37
    return inputs, options


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", DENSE)
def test_attention_dense(attention: Any, device_type: str, layout: str, case: str, dtype: torch.dtype) -> None:
    inputs, options = _dense_case(case, layout, dtype)
    out = conform(lambda **t: attention(**t, **options), lambda **t: dk.attention(**t, **options), inputs,
                  ("q", "k", "v"), dtype, device_type)
    assert out.shape == inputs["q"].shape[:-1] + out.shape[-1:] and out.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["none", "causal_top_left", "causal_bottom_right", "gqa_causal"])
def test_attention_packed_tnd(attention: Any, device_type: str, case: str, dtype: torch.dtype) -> None:
    len_q, len_kv = [3, 5], ([5, 7] if case == "causal_bottom_right" else [3, 5])
    hkv = 2 if case == "gqa_causal" else HQ
    inputs: dict[str, Any] = {"q": torch.randn(sum(len_q), HQ, D, dtype=dtype),
                              "k": torch.randn(sum(len_kv), hkv, D, dtype=dtype),
                              "v": torch.randn(sum(len_kv), hkv, D, dtype=dtype),
                              # flash-attn style (leading 0, int32 tensor, moved to the device) for q ...
                              "cu_seqlens_q": torch.tensor([0, 3, 8], dtype=torch.int32)}
    options: dict[str, Any] = {"layout": "TND", "causal": case != "none",
                               "causal_alignment": "bottom_right" if case == "causal_bottom_right" else "top_left",
                               # ... and Ascend style (no leading 0, a list) for k/v
                               "cu_seqlens_kv": [len_kv[0], sum(len_kv)]}
    conform(lambda **t: attention(**t, **options), lambda **t: dk.attention(**t, **options), inputs,
            ("q", "k", "v"), dtype, device_type)


def test_attention_dropout_p_is_the_drop_probability(attention: Any, device_type: str) -> None:
    """With v = identity each output cell is one key's probability, so the share of zeros is the share of
    dropped probabilities (vendors' ``keep_prob`` is ``1 - dropout_p``)."""
    q, k = (torch.randn(2, 2, 64, 16, device=device_type, requires_grad=True) for _ in range(2))
    v = torch.eye(16, device=device_type).expand(2, 2, 16, 16).contiguous().requires_grad_()
    out = attention(q, k[:, :, :16], v, layout="BNSD", dropout_p=0.8)
    assert str(out.device) == device_type and bool(torch.isfinite(out).all())
    zeros = (out == 0).float().mean().item()
    assert 0.7 < zeros < 0.9, f"{zeros:.0%} of the probabilities were dropped with dropout_p=0.8"
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


# -- rms_norm, swiglu, rotary, masked_softmax, wgrad_accumulate -----------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
def test_rms_norm(devshim_device: Any, device_type: str, with_weight: bool, dtype: torch.dtype) -> None:
    rms_norm = provided(devshim_device, "attention", "rms_norm")
    inputs: dict[str, Any] = {"x": torch.randn(3, 5, 64, dtype=dtype),
                              "weight": torch.randn(64, dtype=dtype) if with_weight else None}
    grads = ("x", "weight") if with_weight else ("x",)
    conform(lambda **t: rms_norm(**t, eps=1e-5), lambda **t: dk.rms_norm(**t, eps=1e-5), inputs, grads, dtype,
            device_type)


def test_rms_norm_fp32_weight_on_bf16_input_promotes_to_the_weights_dtype(devshim_device: Any,
                                                                          device_type: str) -> None:
    rms_norm = provided(devshim_device, "attention", "rms_norm")
    inputs = {"x": torch.randn(4, 32, dtype=torch.bfloat16), "weight": torch.randn(32)}
    out = conform(rms_norm, dk.rms_norm, inputs, ("x", "weight"), torch.bfloat16, device_type)
    assert out.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "transposed"])
def test_swiglu(devshim_device: Any, device_type: str, strided: bool, dtype: torch.dtype) -> None:
    swiglu = provided(devshim_device, "attention", "swiglu")
    if strided:  # a non-contiguous view: many vendor ops take only contiguous input, the plugin must cope
        conform(lambda x: swiglu(x.transpose(0, 2)), lambda x: dk.swiglu(x.transpose(0, 2)),
                {"x": torch.randn(16, 3, 4, dtype=dtype)}, ("x",), dtype, device_type)
    else:
        conform(swiglu, dk.swiglu, {"x": torch.randn(4, 3, 16, dtype=dtype)}, ("x",), dtype, device_type)


# cos/sin as Megatron (SBND: [S, 1, 1, D]), the vendors' BSND ([1, S, 1, D]) and 2-D [S, D] for BNSD
ROTARY_LAYOUTS = {"SBND": ((6, B, HQ, D), (6, 1, 1)), "BSND": ((B, 6, HQ, D), (1, 6, 1)), "BNSD": ((B, HQ, 6, D), (6,))}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("layout", list(ROTARY_LAYOUTS))
def test_rotary(devshim_device: Any, device_type: str, layout: str, interleaved: bool, partial: bool,
                dtype: torch.dtype) -> None:
    rotary = provided(devshim_device, "attention", "rotary")
    shape, lead = ROTARY_LAYOUTS[layout]
    angles = torch.rand(*lead, D // 2 if partial else D)
    inputs = {"x": torch.randn(*shape, dtype=dtype), "cos": angles.cos(), "sin": angles.sin()}
    conform(lambda **t: rotary(**t, interleaved=interleaved), lambda **t: dk.rotary(**t, interleaved=interleaved),
            inputs, ("x",), dtype, device_type)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["no_mask", "padding_mask", "causal", "causal_and_mask", "fully_masked_row"])
def test_masked_softmax(devshim_device: Any, device_type: str, case: str, dtype: torch.dtype) -> None:
    masked_softmax = provided(devshim_device, "attention", "masked_softmax")
    mask = None
    if case in ("padding_mask", "causal_and_mask"):
        mask = torch.rand(2, 1, 1, 7) > 0.7  # True = masked (Megatron's convention), broadcast over queries
    elif case == "fully_masked_row":
        mask = torch.zeros(2, 1, 5, 7, dtype=torch.bool)
        mask[:, :, 2] = True  # every key of query 2: Megatron's CUDA kernel gives zeros there
    inputs = {"scores": torch.randn(2, 3, 5, 7, dtype=dtype), "mask": mask}
    options = {"scale": 0.5, "causal": case.startswith("causal")}
    out = conform(lambda **t: masked_softmax(**t, **options), lambda **t: dk.masked_softmax(**t, **options), inputs,
                  ("scores",), dtype, device_type)
    assert out.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["none", "causal", "keep_mask", "masked_mask_causal", "gqa_causal", "row_masked"])
def test_attention_lse(devshim_device: Any, device_type: str, case: str, dtype: torch.dtype) -> None:
    """Attention with its log-sum-exp (ring context parallelism): both outputs and the gradients through both."""
    attention_lse = provided(devshim_device, "attention", "attention_lse")
    hkv = 2 if case == "gqa_causal" else HQ
    s_q, s_kv = (6, 6) if "causal" in case else (6, 9)
    inputs: dict[str, Any] = {"q": torch.randn(B, HQ, s_q, D, dtype=dtype),
                              "k": torch.randn(B, hkv, s_kv, D, dtype=dtype),
                              "v": torch.randn(B, hkv, s_kv, D, dtype=dtype)}
    options: dict[str, Any] = {"scale": 0.4, "causal": "causal" in case}
    keep = torch.rand(B, 1, s_q, s_kv) > 0.4
    keep[..., 0] = True
    if case == "keep_mask":
        inputs["attn_mask"] = keep
    elif case == "masked_mask_causal":
        inputs["attn_mask"] = ~keep
        options["mask_true_means_masked"] = True
    elif case == "row_masked":  # query 2 may attend to nothing: zeros and -inf, finite gradients
        keep[:, :, 2] = False
        inputs["attn_mask"] = keep

    def joined(kernel: Callable[..., Any]) -> Callable[..., Tensor]:
        def run(**t: Any) -> Tensor:
            out, lse = kernel(**t, **options)
            assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (B, HQ, s_q)
            return torch.cat((out.float(), lse.nan_to_num(neginf=0.0).unsqueeze(-1)), -1)
        return run

    joined_out = conform(joined(attention_lse), joined(dk.attention_with_lse), inputs, ("q", "k", "v"), dtype,
                         device_type)
    if case == "row_masked":
        assert torch.all(joined_out[:, :, 2] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans_b", [False, True], ids=["b", "b_transposed"])
def test_grouped_gemm(devshim_device: Any, device_type: str, trans_b: bool, dtype: torch.dtype) -> None:
    grouped_gemm = provided(devshim_device, "attention", "grouped_gemm")
    sizes = [3, 0, 5, 2]  # an expert that got no tokens among them
    weight = torch.randn(4, 6, 16, dtype=dtype) if trans_b else torch.randn(4, 16, 6, dtype=dtype)
    inputs = {"x": torch.randn(sum(sizes), 16, dtype=dtype), "weight": weight}
    out = conform(lambda **t: grouped_gemm(t["x"], t["weight"], sizes, trans_b=trans_b),
                  lambda **t: dk.grouped_gemm(t["x"], t["weight"], sizes, trans_b=trans_b), inputs, ("x", "weight"),
                  dtype, device_type)
    assert out.shape == (sum(sizes), 6) and out.dtype == dtype


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32_main_grad", "bf16_main_grad"])
def test_wgrad_accumulate(devshim_device: Any, device_type: str, grad_dtype: torch.dtype) -> None:
    wgrad = provided(devshim_device, "attention", "wgrad_accumulate")
    total_input, grad_output = torch.randn(3, 5, 16, dtype=torch.bfloat16), torch.randn(3, 5, 8, dtype=torch.bfloat16)
    start = torch.randn(8, 16).to(grad_dtype)
    expected, actual = start.clone(), start.to(device_type)
    dk.wgrad_accumulate(total_input, grad_output, expected)
    wgrad(total_input.to(device_type), grad_output.to(device_type), actual)
    close(actual, expected, device_type, torch.float32 if grad_dtype == torch.float32 else torch.bfloat16)


# -- fused Adam on the device --------------------------------------------------------------------------------------

SHAPES = [(7, 5), (33,), (4, 3, 2)]
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}


def _run_fused(fused: Callable[..., None], steps: int, device: str, *, dtype: torch.dtype = torch.float32,
               grad_dtype: torch.dtype | None = None, amsgrad: bool = False, copies: bool = False,
               **hyper: Any) -> tuple[list[Tensor], ...]:
    gen = torch.Generator().manual_seed(7)
    params = [torch.randn(s, generator=gen).to(dtype).to(device) for s in SHAPES]
    avgs = [torch.zeros_like(p) for p in params]
    sqs = [torch.zeros_like(p) for p in params]
    maxima = [torch.zeros_like(p) for p in params] if amsgrad else None
    param_copies = [torch.empty(p.shape, dtype=torch.bfloat16, device=device) for p in params] if copies else None
    for step in range(1, steps + 1):
        grads = [torch.randn(s, generator=gen).to(grad_dtype or dtype).to(device) for s in SHAPES]
        fused(params, grads, avgs, sqs, step=step, max_exp_avg_sqs=maxima, param_copies=param_copies, **hyper)
    return params, avgs, sqs, param_copies or []


@pytest.mark.parametrize("variant", ["adamw", "adam_l2", "no_bias_correction", "amsgrad", "bf16_copies",
                                     "bf16_grads", "bf16_params"])
def test_fused_adamw_matches_the_reference_over_five_steps(devshim_device: Any, device_type: str,
                                                           variant: str) -> None:
    """Bias correction and weight decay accumulate over steps, which is where a kernel that is right after one
    step goes wrong."""
    fused = provided(devshim_device, "optimizer", "fused_adamw")
    kwargs: dict[str, Any] = {"adamw_mode": variant != "adam_l2", "bias_correction": variant != "no_bias_correction",
                              "amsgrad": variant == "amsgrad", "copies": variant == "bf16_copies", **HYPER}
    if variant == "bf16_grads":
        kwargs["grad_dtype"] = torch.bfloat16
    if variant == "bf16_params":
        kwargs["dtype"] = torch.bfloat16
    tol: Tolerance = TOL[torch.bfloat16] if variant == "bf16_params" else {"atol": 1e-6, "rtol": 1e-5}
    actual = _run_fused(fused, 5, device_type, **kwargs)
    expected = _run_fused(dk.fused_adamw, 5, "cpu", **kwargs)
    for got, want in zip(actual, expected, strict=True):
        for a, e in zip(got, want, strict=True):
            assert str(a.device) == device_type
            torch.testing.assert_close(a.cpu().float(), e.float(), **tol)


def test_fused_adamw_matches_torch_adamw(devshim_device: Any, device_type: str) -> None:
    fused = provided(devshim_device, "optimizer", "fused_adamw")
    param = torch.nn.Parameter(torch.randn(10, 3))
    reference = torch.optim.AdamW([param], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    p, m, v = (t.to(device_type) for t in (param.detach(), torch.zeros(10, 3), torch.zeros(10, 3)))
    for step in range(1, 7):
        grad = torch.randn(10, 3)
        param.grad = grad
        reference.step()
        fused([p], [grad.to(device_type)], [m], [v], step=step, adamw_mode=True, bias_correction=True, **HYPER)
        torch.testing.assert_close(p.cpu(), param.detach(), atol=1e-6, rtol=1e-5)
