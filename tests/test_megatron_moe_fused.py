"""Spec: MoE experts run the plugin's fused ops (issue 29). The experts' weighted SwiGLU (``weighted_bias_swiglu_impl``,
what ``SequentialMLP``'s experts call with the routing probabilities) runs the device's ``swiglu`` kernel and
computes what Megatron's own Function computes, forward and backward; ``moe_grouped_gemm`` builds Megatron's
``GroupedMLP`` on devshim's ``grouped_gemm`` module, whose ``gmm`` is the device's ``grouped_gemm`` kernel, and the
grouped layer computes what the ungrouped one computes with the same weights.

No fault is injected. What the user sees without this: ``--moe-grouped-gemm`` refused (or Megatron's "Grouped GEMM
is not available" assertion), and the experts' SwiGLU on Megatron's kernel whatever the plugin provides.

In-process, one rank over gloo, on the cpu_reference device (DEVSHIM_PATCH_MEGATRON=0: the fused patches are
applied here, as devshim's Megatron integration applies them). The device's kernels are wrapped in counters (spies).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from typing import Any

import devshim_kernels
import pytest
import torch
import torch.nn.functional as F
from megatron_world import fused_patches_applied, one_rank_megatron

from devshim_core import FusedKernels
from devshim_core.device import Device, _with_reference_ops, build_device
from devshim_core.integrations.megatron import grouped_gemm_module
from devshim_core.integrations.megatron.unserved_flags import CONFIG_FIELDS, Served
from devshim_core.plugins import discover
from devshim_core.selection import select
from devshim_core.settings import Settings

Tensor = torch.Tensor
CALLS: collections.Counter[str] = collections.Counter()
EXPERTS, TOPK, HIDDEN, FFN, TOKENS = 4, 2, 16, 12, 24
# fp32 with the same weights: the grouped and ungrouped layers differ only in the order of floating-point operations
RTOL, ATOL = 1e-5, 1e-5
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _cpu_reference() -> Device:
    settings = Settings(forced="cpu_reference")
    registry = discover(settings)
    return build_device(registry, select(registry, settings))


def spied(base: Device) -> Device:
    """``base`` with its swiglu and grouped_gemm kernels counted in CALLS."""

    def counted(name: str, kernel: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            CALLS[name] += 1
            return kernel(*args, **kwargs)

        return call

    assert base.attention.swiglu is not None and base.attention.grouped_gemm is not None
    kernels = dataclasses.replace(base.attention, swiglu=counted("swiglu", base.attention.swiglu),
                                  grouped_gemm=counted("grouped_gemm", base.attention.grouped_gemm))
    return Device(base.info, base.module, base.traits, base.collectives, base.allocator, base.optimizer, kernels,
                  base.offload_io, base.patches)


BASE = _cpu_reference()
DEVICE = spied(BASE)

pytest.importorskip("megatron.core", reason="the MoE layers are Megatron's")
from megatron.core.fusions import fused_bias_swiglu  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import mlp  # noqa: E402
from megatron.core.transformer.moe import experts, grouped_gemm_util, moe_utils  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402


def megatrons_own(function: Any) -> Any:
    """Megatron's function under any devshim wrapper (a session active when this module was imported applied one)."""
    while hasattr(function, "__devshim_original__"):
        function = function.__devshim_original__
    return function


MEGATRON_WEIGHTED_SWIGLU = megatrons_own(fused_bias_swiglu.weighted_bias_swiglu_impl)


@pytest.fixture(scope="module", autouse=True)
def megatron_world() -> Iterator[None]:
    with one_rank_megatron() as mp:
        # what devshim's core patch "moe-router-gemm" does: 0.16.1 defines the name only when TE imports
        mp.setattr(moe_utils, "te_general_gemm", None, raising=False)
        yield


@pytest.fixture(autouse=True)
def no_calls_yet() -> None:
    CALLS.clear()
    torch.manual_seed(1234)


def fused(device: Device = DEVICE) -> contextlib.AbstractContextManager[None]:
    return fused_patches_applied(device)


def moe_layer(grouped: bool) -> torch.nn.Module:
    """Megatron's MoE layer from the local GPT spec: SequentialMLP, or GroupedMLP under moe_grouped_gemm."""
    model_parallel_cuda_manual_seed(1234)
    # bf16=True: GroupedMLP asserts it (Megatron's mixed-precision wrapper casts, not the layer); the parameters and
    # inputs here stay fp32
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=F.silu,
        bias_activation_fusion=True, add_bias_linear=False, use_cpu_initialization=True, bf16=True,
        params_dtype=torch.float32, moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
        moe_grouped_gemm=grouped, hidden_dropout=0.0)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=grouped)
    return build_module(spec.submodules.mlp, config=config)


def copy_weights(sequential: torch.nn.Module, grouped: torch.nn.Module) -> None:
    """GroupedMLP stores expert e's fc1 as weight1.view(E, h, 2f)[e] = fc1.weight^T, its fc2 as
    weight2.view(E, f, h)[e] = fc2.weight^T."""
    with torch.no_grad():
        grouped.router.weight.copy_(sequential.router.weight)
        w1 = grouped.experts.weight1.view(EXPERTS, HIDDEN, -1)
        w2 = grouped.experts.weight2.view(EXPERTS, -1, HIDDEN)
        for e, expert in enumerate(sequential.experts.local_experts):
            w1[e].copy_(expert.linear_fc1.weight.t())
            w2[e].copy_(expert.linear_fc2.weight.t())


def run(layer: torch.nn.Module, hidden: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    x = hidden.clone().requires_grad_()
    out, bias = layer(x)
    assert bias is None
    out.backward(grad)
    assert x.grad is not None
    return out.detach(), x.grad


def reference_gmm(x: Tensor, w: Tensor, sizes: list[int], trans_b: bool = False) -> Tensor:
    """The loop every grouped GEMM must agree with, written out: one matmul per group, in fp64."""
    rows = torch.split(x.double(), sizes)
    return torch.cat([r @ (w[g].t() if trans_b else w[g]).double() for g, r in enumerate(rows)]).to(x.dtype)


# -- weighted SwiGLU ----------------------------------------------------------------------------------------------


def test_the_experts_weighted_swiglu_runs_the_devices_swiglu_kernel_and_matches_megatrons() -> None:
    layer = moe_layer(grouped=False)
    bound = mlp.weighted_bias_swiglu_impl  # Megatron's own, as mlp imported it
    hidden, grad = torch.randn(TOKENS // 2, 2, HIDDEN), torch.randn(TOKENS // 2, 2, HIDDEN)
    own_out, own_dx = run(layer, hidden, grad)
    own_grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    assert CALLS["swiglu"] == 0
    with fused():
        # the experts call the name they imported: the rebinding reached mlp's and experts' copies
        assert mlp.weighted_bias_swiglu_impl is experts.weighted_bias_swiglu_impl is not MEGATRON_WEIGHTED_SWIGLU
        out, dx = run(layer, hidden, grad)
    assert CALLS["swiglu"] == EXPERTS  # one call per expert: SequentialMLP runs every local expert
    torch.testing.assert_close(out, own_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(dx, own_dx, rtol=RTOL, atol=ATOL)
    for p, own in zip(layer.parameters(), own_grads, strict=True):
        torch.testing.assert_close(p.grad, own, rtol=RTOL, atol=ATOL)
    assert mlp.weighted_bias_swiglu_impl is bound  # reverted


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(10, 2 * FFN), (5, 2, 2 * FFN)], ids=["2d", "3d"])
def test_weighted_swiglu_equals_megatrons_function_forward_and_backward(dtype: torch.dtype,
                                                                        shape: tuple[int, ...]) -> None:
    tokens = shape[0] * (shape[1] if len(shape) == 3 else 1)
    x, probs = torch.randn(shape, dtype=dtype), torch.rand(tokens, 1)  # Megatron's probabilities stay fp32
    with fused():
        patched = fused_bias_swiglu.weighted_bias_swiglu_impl
    assert patched is not MEGATRON_WEIGHTED_SWIGLU

    def both(fn: Callable[..., Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        out = fn(xi, None, pi)
        out.backward(torch.ones_like(out))
        assert xi.grad is not None and pi.grad is not None
        return out, xi.grad, pi.grad

    CALLS.clear()
    ours, own = both(patched), both(MEGATRON_WEIGHTED_SWIGLU)
    assert CALLS["swiglu"] == 1
    for mine, theirs in zip(ours, own, strict=True):
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
        torch.testing.assert_close(mine, theirs, **TOL[dtype])


def test_weighted_swiglu_leaves_fp8_input_store_and_a_bias_to_megatron() -> None:
    with fused():
        patched = fused_bias_swiglu.weighted_bias_swiglu_impl
        x, probs = torch.randn(6, 2 * FFN), torch.rand(6, 1)
        with pytest.raises(NotImplementedError, match="Bias is not supported"):  # Megatron's own refusal
            patched(x, torch.zeros(2 * FFN), probs)
        patched(x, None, probs, True)
    assert CALLS["swiglu"] == 0


# -- grouped GEMM: the op, the facade's fallback, the module -----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans_b", [False, True], ids=["KN", "NK-trans_b"])
def test_the_devices_grouped_gemm_is_the_loop_of_matmuls_forward_and_backward(dtype: torch.dtype,
                                                                              trans_b: bool) -> None:
    kernel = BASE.attention.grouped_gemm
    assert kernel is not None
    sizes = [5, 0, 9, 2]  # an expert without tokens, as routing gives
    x = torch.randn(sum(sizes), HIDDEN, dtype=dtype)
    w = torch.randn(len(sizes), *((FFN, HIDDEN) if trans_b else (HIDDEN, FFN)), dtype=dtype)
    g = torch.randn(sum(sizes), FFN, dtype=dtype)
    results = []
    for fn in (kernel, reference_gmm):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xi, wi, torch.tensor(sizes) if fn is kernel else sizes, trans_b=trans_b)
        out.backward(g)
        results.append((out, xi.grad, wi.grad))
    for mine, ref in zip(*results, strict=True):
        assert mine.dtype == dtype
        torch.testing.assert_close(mine, ref, **TOL[dtype])
    assert results[0][2][1].abs().max() == 0  # no rows, no weight gradient


@pytest.mark.parametrize(("sizes", "message"), [([5, 5], "holds 3 groups"), ([4, 4, 4], "sum to x's 10 rows"),
                                                ([12, -1, -1], "non-negative")])
def test_the_grouped_gemm_names_group_sizes_that_do_not_fit(sizes: list[int], message: str) -> None:
    kernel = BASE.attention.grouped_gemm
    assert kernel is not None
    with pytest.raises(ValueError, match=message):
        kernel(torch.randn(10, 4), torch.randn(3, 4, 6), sizes)


def test_a_plugin_without_a_grouped_gemm_gets_devshim_kernels_loop() -> None:
    filled = _with_reference_ops(FusedKernels(swiglu=devshim_kernels.swiglu, source="acme: swiglu"))
    assert filled.grouped_gemm is devshim_kernels.grouped_gemm and filled.swiglu is devshim_kernels.swiglu
    assert filled.source == "acme: swiglu; grouped_gemm: devshim_kernels"
    own = FusedKernels(grouped_gemm=reference_gmm, source="acme")
    assert _with_reference_ops(own) is own  # a plugin's own op is kept
    assert BASE.describe()["attention_kernels"]["grouped_gemm"] is True


def test_the_grouped_gemm_module_is_megatrons_gmm_on_the_devices_kernel() -> None:
    modules = grouped_gemm_module.make_modules(DEVICE)
    package = modules["grouped_gemm"]
    assert modules["grouped_gemm.ops"] is package.ops and modules["grouped_gemm.backend"] is package.backend
    sizes = torch.tensor([3, 1, 0, 4])
    x, w = torch.randn(8, HIDDEN), torch.randn(4, HIDDEN, FFN)
    torch.testing.assert_close(package.ops.gmm(x, w, sizes), reference_gmm(x, w, sizes.tolist()))
    torch.testing.assert_close(package.ops.gmm(x, w.transpose(1, 2).contiguous(), sizes, trans_b=True),
                               reference_gmm(x, w, sizes.tolist()))
    assert CALLS["grouped_gemm"] == 2
    # the backend's weight-gradient form: a_g^T @ b_g per group, written into c
    dy, c = torch.randn(8, FFN), torch.empty(4, HIDDEN, FFN)
    assert package.backend.gmm(x, dy, sizes, trans_a=True, c=c) is c
    torch.testing.assert_close(c[0], x[:3].t() @ dy[:3])
    assert c[2].abs().max() == 0
    with contextlib.ExitStack() as stack:  # importable by name once in sys.modules, as devshim's integration puts it
        for name, module in modules.items():
            stack.enter_context(_in_sys_modules(name, module))
        import grouped_gemm.ops  # type: ignore[import-not-found]  # the stand-in

        assert grouped_gemm.ops.gmm is package.ops.gmm


@contextlib.contextmanager
def _in_sys_modules(name: str, module: Any) -> Iterator[None]:
    saved = sys.modules.get(name)
    sys.modules[name] = module
    try:
        yield
    finally:
        if saved is None:
            del sys.modules[name]
        else:
            sys.modules[name] = saved


def test_without_a_grouped_gemm_kernel_gmm_says_which_flag_to_drop() -> None:
    bare = dataclasses.replace(BASE.attention, grouped_gemm=None)
    device = Device(BASE.info, BASE.module, BASE.traits, BASE.collectives, BASE.allocator, BASE.optimizer, bare,
                    BASE.offload_io, BASE.patches)
    module = grouped_gemm_module.make_module(device)
    with pytest.raises(RuntimeError, match=r"moe_grouped_gemm=True .* cpu_reference plugin provides none.*"
                                           r"--moe-grouped-gemm"):
        module.ops.gmm(torch.randn(2, 4), torch.randn(1, 4, 4), [2])


# -- moe_grouped_gemm in Megatron ---------------------------------------------------------------------------------


def test_moe_grouped_gemm_is_served() -> None:
    assert isinstance(CONFIG_FIELDS["moe_grouped_gemm"], Served)


def test_the_grouped_moe_layer_runs_the_devices_grouped_gemm_and_equals_the_ungrouped_one() -> None:
    hidden, grad = torch.randn(TOKENS // 2, 2, HIDDEN), torch.randn(TOKENS // 2, 2, HIDDEN)
    before = grouped_gemm_util.grouped_gemm
    with fused():
        # bound in Megatron's module even though megatron was imported (and found no grouped_gemm) before devshim
        assert grouped_gemm_util.grouped_gemm_is_available() and grouped_gemm_module.is_standin(
            grouped_gemm_util.grouped_gemm)
        sequential, grouped = moe_layer(grouped=False), moe_layer(grouped=True)
        assert type(grouped.experts).__name__ == "GroupedMLP"
        copy_weights(sequential, grouped)
        seq_out, seq_dx = run(sequential, hidden, grad)
        CALLS.clear()
        out, dx = run(grouped, hidden, grad)
    assert CALLS["grouped_gemm"] == 2  # fc1 and fc2
    assert CALLS["swiglu"] == 1  # GroupedMLP's activation: one call over every expert's rows
    assert grouped_gemm_util.grouped_gemm is before  # reverted
    torch.testing.assert_close(out, seq_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(dx, seq_dx, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grouped.router.weight.grad, sequential.router.weight.grad, rtol=RTOL, atol=ATOL)
    w1 = grouped.experts.weight1.grad.view(EXPERTS, HIDDEN, -1)
    w2 = grouped.experts.weight2.grad.view(EXPERTS, -1, HIDDEN)
    for e, expert in enumerate(sequential.experts.local_experts):
        torch.testing.assert_close(w1[e], expert.linear_fc1.weight.grad.t(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(w2[e], expert.linear_fc2.weight.grad.t(), rtol=RTOL, atol=ATOL)


def test_the_grouped_moe_layer_trains_as_the_ungrouped_one() -> None:
    """A few SGD steps on a regression target: the two layers' losses stay equal step by step."""
    with fused():
        sequential, grouped = moe_layer(grouped=False), moe_layer(grouped=True)
        copy_weights(sequential, grouped)
        hidden, target = torch.randn(TOKENS // 2, 2, HIDDEN), torch.randn(TOKENS // 2, 2, HIDDEN)
        losses: dict[str, list[float]] = {"sequential": [], "grouped": []}
        for name, layer in (("sequential", sequential), ("grouped", grouped)):
            optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
            for _ in range(4):
                optimizer.zero_grad()
                loss = F.mse_loss(layer(hidden)[0], target)
                loss.backward()
                optimizer.step()
                losses[name].append(loss.item())
    assert losses["grouped"][-1] < losses["grouped"][0]  # it learns
    torch.testing.assert_close(torch.tensor(losses["grouped"]), torch.tensor(losses["sequential"]), rtol=1e-5,
                               atol=1e-6)
