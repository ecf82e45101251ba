"""Spec: with devshim's fused patches, Megatron's local (non-TE) GPT spec runs the device's kernels on every fused
path (attention, RMSNorm, SwiGLU, rotary, masked softmax, gradient-accumulation fusion), computes what Megatron's
own paths compute, leaves Megatron's path wherever the device lacks the op, and reverts to Megatron's originals.

In-process, one rank over gloo, on the cpu_reference device (activated as ``import devshim_core.auto`` would, but
with DEVSHIM_PATCH_MEGATRON=0: this module applies the fused patches itself, as devshim's Megatron integration
will). The device's kernels are wrapped in counters so each spec can see which op Megatron reached.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from megatron_world import fused_patches_applied, one_rank_megatron

from devshim_core.device import Device, build_device
from devshim_core.integrations.megatron.fused_ops import DeviceRMSNorm
from devshim_core.integrations.megatron.wgrad_module import make_module
from devshim_core.plugins import discover
from devshim_core.selection import select
from devshim_core.settings import Settings

OPS = ("attention", "rms_norm", "swiglu", "rotary", "masked_softmax", "wgrad_accumulate")
CALLS: list[tuple[str, dict[str, Any]]] = []  # (op, keyword arguments) of every counted kernel call


def _cpu_reference() -> Device:
    settings = Settings(forced="cpu_reference")
    registry = discover(settings)
    return build_device(registry, select(registry, settings))


def counting_device(base: Device, **replaced: Any) -> Device:
    """``base`` with every attention kernel wrapped in a counter; ``replaced`` overrides fields (``op=None``)."""

    def counted(name: str, kernel: Callable[..., Any] | None) -> Callable[..., Any] | None:
        if kernel is None:
            return None

        def call(*args: Any, **kwargs: Any) -> Any:
            CALLS.append((name, kwargs))
            return kernel(*args, **kwargs)

        return call

    wrapped = {op: counted(op, getattr(base.attention, op)) for op in OPS}
    kernels = dataclasses.replace(base.attention, **{**wrapped, **replaced})
    return Device(base.info, base.module, base.traits, base.collectives, base.allocator, base.optimizer, kernels,
                  base.offload_io, base.patches)


BASE = _cpu_reference()
DEVICE = counting_device(BASE)
# tensor_parallel.layers imports this extension once, at import time: the stand-in is in place before megatron is
# imported (devshim's Megatron integration installs it for real); the fixture below covers an earlier import
sys.modules["fused_weight_gradient_mlp_cuda"] = make_module(DEVICE)

pytest.importorskip("megatron.core", reason="the fused paths are Megatron's")
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.fusions import fused_bias_swiglu, fused_softmax  # noqa: E402
from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel import layers  # noqa: E402
from megatron.core.transformer import dot_product_attention, mlp, torch_norm  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.core.transformer.utils import attention_mask_func  # noqa: E402

SEQ, BATCH, VOCAB = 16, 2, 128
# fp32, the same weights and dropout 0: the two runs differ only in the order of floating-point operations
RTOL, ATOL = 1e-5, 1e-5


@pytest.fixture(scope="module", autouse=True)
def megatron_world() -> Iterator[None]:
    with one_rank_megatron() as mp:
        mp.setattr(layers, "fused_weight_gradient_mlp_cuda", sys.modules["fused_weight_gradient_mlp_cuda"],
                   raising=False)
        mp.setattr(layers, "_grad_accum_fusion_available", True)
        yield


def fused(device: Device = DEVICE) -> contextlib.AbstractContextManager[None]:
    return fused_patches_applied(device)


@pytest.fixture(autouse=True)
def no_calls_yet() -> None:
    CALLS.clear()


def counts() -> collections.Counter[str]:
    return collections.Counter(op for op, _ in CALLS)


def gpt_config(**overrides: Any) -> TransformerConfig:
    settings = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                    normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                    bias_activation_fusion=True, add_bias_linear=True, gradient_accumulation_fusion=True,
                    apply_query_key_layer_scaling=True, hidden_dropout=0.0, attention_dropout=0.0,
                    use_cpu_initialization=True)
    return TransformerConfig(**{**settings, **overrides})


def gpt(config: TransformerConfig) -> GPTModel:
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization=config.normalization), vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type="rope")
    for param in model.parameters():  # what Megatron's DDP gives gradient_accumulation_fusion to accumulate into
        param.main_grad = torch.zeros_like(param)
    return model


def causal_padded_mask() -> torch.Tensor:
    """[b, 1, s, s], True = masked: causal, and the last three keys of batch 1 are padding."""
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).repeat(BATCH, 1, 1, 1)
    mask[1, ..., -3:] = True
    return mask


def run(model: GPTModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits of one forward and every parameter's gradient after backward."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    logits = model(tokens, positions, causal_padded_mask())
    (logits.float() * torch.linspace(-1, 1, VOCAB)).sum().backward()
    grads = {n: p.grad if p.grad is not None else p.main_grad for n, p in model.named_parameters()}
    return logits.detach(), grads


# -- every path reaches the device ---------------------------------------------------------------------------------


def test_a_local_spec_gpt_runs_every_fused_path_on_the_devices_kernels():
    config = gpt_config()
    with fused():
        model = gpt(config)
        run(model)
    layers_, linears = config.num_layers, 4 * config.num_layers + 1  # qkv, proj, fc1, fc2 per layer; output layer
    assert counts() == {"attention": layers_, "rms_norm": 2 * layers_ + 1, "swiglu": layers_,
                        "rotary": 2 * layers_, "wgrad_accumulate": linears}
    attention = next(kwargs for op, kwargs in CALLS if op == "attention")
    assert attention["mask_true_means_masked"] is True and attention["causal"] is True
    assert attention["scale"] == pytest.approx(1 / (config.kv_channels ** 0.5))  # layer scaling undone
    assert isinstance(model.decoder.layers[0].input_layernorm, DeviceRMSNorm)


def test_the_fused_model_computes_megatrons_logits_and_gradients():
    """Same seed and weights, dropout 0, fp32: grouped-query attention with a padding mask, layer-scaled softmax,
    RMSNorm, biased SwiGLU, RoPE and fused weight-gradient accumulation agree with Megatron's own paths."""
    config = gpt_config()
    reference = gpt(config)
    want_logits, want_grads = run(reference)
    with fused():
        model = gpt(config)
        model.load_state_dict(reference.state_dict())  # torch.nn.RMSNorm's checkpoint loads into DeviceRMSNorm
        got_logits, got_grads = run(model)
    assert counts()["attention"] == config.num_layers
    torch.testing.assert_close(got_logits, want_logits, rtol=RTOL, atol=ATOL)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=RTOL, atol=ATOL, msg=name)


# -- paths that need more than one model to see -------------------------------------------------------------------


def test_fused_masked_softmax_is_megatrons_unfused_softmax_in_fp16():
    softmax = fused_softmax.FusedScaleMaskSoftmax(
        input_in_fp16=True, input_in_bf16=False, attn_mask_type=AttnMaskType.padding,
        scaled_masked_softmax_fusion=True, mask_func=attention_mask_func, softmax_in_fp32=True, scale=3.0)
    scores = torch.randn(2, 4, SEQ, SEQ, generator=torch.Generator().manual_seed(3)).half()
    mask = causal_padded_mask()
    want = softmax.forward_torch_softmax(scores.clone(), mask)
    with fused():
        assert softmax.is_kernel_available(mask, *scores.shape)
        got = softmax(scores.clone(), mask)
    assert counts() == {"masked_softmax": 1}
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)  # both fp32 statistics rounded to fp16


def test_attention_megatron_keeps_reaches_the_devices_masked_softmax():
    """A device without attention keeps Megatron's DotProductAttention, whose bf16 softmax fusion runs the device's
    masked_softmax."""
    config = gpt_config(bf16=True, masked_softmax_fusion=True, params_dtype=torch.bfloat16)
    with fused(counting_device(BASE, attention=None)):
        core = dot_product_attention.DotProductAttention(config, 1, AttnMaskType.causal, "self")
        q, k, v = (torch.randn(SEQ, BATCH, n, config.kv_channels, dtype=torch.bfloat16) for n in (4, 2, 2))
        out = core(q, k, v, None)
    assert counts() == {"masked_softmax": 1}
    assert out.shape == (SEQ, BATCH, config.hidden_size)


def test_apply_rope_fusion_is_accepted_and_runs_the_devices_rotary():
    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
        gpt_config(apply_rope_fusion=True)  # Megatron without TE
    t = torch.randn(SEQ, BATCH, 4, 16)
    freqs = torch.randn(SEQ, 1, 1, 16)
    want = rope_utils.apply_rotary_pos_emb(t, freqs, config=gpt_config())
    with fused():
        config = gpt_config(apply_rope_fusion=True)
        got = rope_utils.apply_rotary_pos_emb(t, freqs, config=config)
    assert counts() == {"rotary": 1}
    torch.testing.assert_close(got, want)


def test_attention_dropout_draws_inside_megatrons_rng_tracker_fork():
    config = gpt_config(attention_dropout=0.5)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    q, k, v = (torch.randn(SEQ, BATCH, n, config.kv_channels) for n in (4, 2, 2))
    with fused():
        core = dot_product_attention.DotProductAttention(config, 1, AttnMaskType.causal, "self").train()
        tensor_parallel.model_parallel_cuda_manual_seed(99)
        default_before, tracked_before = torch.get_rng_state(), tracker.get_states()["model-parallel-rng"].clone()
        first = core(q, k, v, None)
        assert torch.equal(torch.get_rng_state(), default_before)  # the default generator was not drawn from
        assert not torch.equal(tracker.get_states()["model-parallel-rng"], tracked_before)
        tensor_parallel.model_parallel_cuda_manual_seed(99)
        again = core(q, k, v, None)
    assert [kwargs["dropout_p"] for op, kwargs in CALLS] == [0.5, 0.5]
    torch.testing.assert_close(first, again)  # replayable from the tracker's state, as recomputation needs


def test_the_norm_takes_sequence_parallel_and_zero_centred_gamma_as_te_and_apex_norms_do():
    config = gpt_config()
    config.sequence_parallel, config.layernorm_zero_centered_gamma = True, True  # as a TP > 1 run sets them
    with pytest.raises(AssertionError, match="zero_centered_gamma"):
        torch_norm.WrappedTorchNorm(config, 64)
    x = torch.randn(SEQ, BATCH, 64)
    with fused():
        rms = torch_norm.WrappedTorchNorm(config, 64, eps=1e-5)
        config.normalization = "LayerNorm"
        layer = torch_norm.WrappedTorchNorm(config, 64, eps=1e-5)
        assert all(p.sequence_parallel for norm in (rms, layer) for p in norm.parameters())
        assert torch.all(rms.weight == 0)  # gamma - 1
        torch.testing.assert_close(rms(x), F.rms_norm(x, (64,), eps=1e-5))
        torch.testing.assert_close(layer(x), F.layer_norm(x, (64,), eps=1e-5))
    assert counts() == {"rms_norm": 1}


# -- revert and missing ops --------------------------------------------------------------------------------------


def _megatron_paths() -> dict[str, Any]:
    return {
        "attention": dot_product_attention.DotProductAttention.forward,
        "norm": torch_norm.WrappedTorchNorm.__dict__["__new__"],
        "swiglu": fused_bias_swiglu.bias_swiglu_impl,
        "swiglu imported by mlp": mlp.bias_swiglu_impl,
        "rotary": rope_utils._apply_rotary_pos_emb_bshd,
        "rotary imported by rotary_pos_embedding": rotary_pos_embedding._apply_rotary_pos_emb_bshd,
        "fused rope": rope_utils.fused_apply_rotary_pos_emb,
        "fused rope thd": rope_utils.fused_apply_rotary_pos_emb_thd,
        "softmax availability": fused_softmax.FusedScaleMaskSoftmax.is_kernel_available,
        "fused softmax": fused_softmax.FusedScaleMaskSoftmax.forward_fused_softmax,
    }


def test_revert_gives_megatron_back_its_own_objects():
    originals = _megatron_paths()
    with fused():
        patched = _megatron_paths()
        assert all(patched[path] is not originals[path] for path in originals), patched
    assert all(after is originals[path] for path, after in _megatron_paths().items())


PATHS_OF = {"attention": ("attention",), "rms_norm": ("norm",),
            "swiglu": ("swiglu", "swiglu imported by mlp"),
            "rotary": ("rotary", "rotary imported by rotary_pos_embedding", "fused rope", "fused rope thd"),
            "masked_softmax": ("softmax availability", "fused softmax"), "wgrad_accumulate": ()}


@pytest.mark.parametrize("op", OPS)
def test_a_device_without_an_op_leaves_megatrons_path_for_it(op):
    originals = _megatron_paths()
    with fused(counting_device(BASE, **{op: None})):
        kept = {path for path, now in _megatron_paths().items() if now is originals[path]}
    assert kept == set(PATHS_OF[op])


def test_gradient_accumulation_fusion_without_the_devices_kernel_names_the_flag():
    module = make_module(counting_device(BASE, wgrad_accumulate=None))
    with pytest.raises(RuntimeError, match="gradient_accumulation_fusion"):
        module.wgrad_gemm_accum_fp32(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(4, 3))


# -- context parallelism ---------------------------------------------------------------------------------------------


def test_context_parallel_builds_megatrons_local_attention_keeping_the_config_and_the_comm_type():
    config = gpt_config(context_parallel_size=2)
    with pytest.raises(AssertionError, match="Context parallelism is only supported by TEDotProductAttention"):
        dot_product_attention.DotProductAttention(config, 1, AttnMaskType.causal, "self")  # Megatron's own
    with fused():
        ring = dot_product_attention.DotProductAttention(config, 1, AttnMaskType.causal, "self")
        ulysses = dot_product_attention.DotProductAttention(config, 1, AttnMaskType.causal, "self", cp_comm_type="a2a")
        unsplit = dot_product_attention.DotProductAttention(gpt_config(), 1, AttnMaskType.causal, "self")
    assert ring.config is config and config.context_parallel_size == 2  # the real config, untouched
    assert (ring.devshim_cp_comm_type, ulysses.devshim_cp_comm_type) == ("p2p", "a2a")  # p2p: TE's default
    assert not hasattr(unsplit, "devshim_cp_comm_type")


@pytest.mark.parametrize(("setting", "named"), [({"window_size": (4, 0)}, "a sliding window"),
                                                ({"softmax_type": "learnable"}, "a softmax offset")])
def test_context_parallel_refuses_what_its_attention_cannot_take_by_name(setting, named):
    if named == "a sliding window" and "window_size" not in inspect.signature(
            fused_softmax.FusedScaleMaskSoftmax.__init__).parameters:
        pytest.skip("this megatron-core's local attention has no sliding window (0.15 added it)")
    if "softmax_type" in setting and "softmax_type" not in TransformerConfig.__dataclass_fields__:
        pytest.skip("this megatron-core has no softmax offsets (0.15 added them)")
    with fused():
        config = gpt_config(context_parallel_size=2, **setting)
        core = dot_product_attention.DotProductAttention(config, 1, AttnMaskType.causal, "self")
        q, k, v = (torch.randn(SEQ // 2, BATCH, n, config.kv_channels) for n in (4, 2, 2))
        with pytest.raises(ValueError, match=f"context parallelism .* does not take {named}; use "
                                             "context_parallel_size=1"):
            core(q, k, v, None)
    assert counts() == {}
