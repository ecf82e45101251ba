"""One process training Megatron's MoE layer twice on the emulated vendor device, for
``test_grouped_gemm_emulated.py``: ``SequentialMLP`` (``moe_grouped_gemm=False``) and ``GroupedMLP``
(``moe_grouped_gemm=True``) with the same weights.

Like a training script it runs ``import devshim_core.auto`` (the vendor plugin, devshim's Megatron integration), then
builds both layers from the local GPT spec on the host, copies the weights across, moves them to the device and
takes a few SGD steps on one batch. The last stdout line is the JSON of what it observed: losses per step, the
first step's output and input gradient, where the tensors lived and which grouped_gemm module Megatron used. The
test compares; this script asserts nothing.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import devshim_core.auto as devshim

EXPERTS, HIDDEN, FFN, STEPS = 4, 16, 12, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


dist.init_process_group(devshim.device.collectives.backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                        world_size=1)
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.moe import grouped_gemm_util  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

parallel_state.initialize_model_parallel(1, 1)
DEVICE = devshim.device.torch_device(0)


def moe_layer(grouped: bool) -> Any:
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS, moe_router_topk=2,
        moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, use_cpu_initialization=True, bf16=True, params_dtype=torch.float32,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none", moe_grouped_gemm=grouped,
        hidden_dropout=0.0)
    return build_module(get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=grouped).submodules.mlp,
                        config=config)


sequential, grouped = moe_layer(False), moe_layer(True)
with torch.no_grad():  # GroupedMLP holds expert e's fc1 as weight1.view(E, h, 2f)[e] = fc1.weight^T (fc2 likewise)
    grouped.router.weight.copy_(sequential.router.weight)
    for e, expert in enumerate(sequential.experts.local_experts):
        grouped.experts.weight1.view(EXPERTS, HIDDEN, -1)[e].copy_(expert.linear_fc1.weight.t())
        grouped.experts.weight2.view(EXPERTS, -1, HIDDEN)[e].copy_(expert.linear_fc2.weight.t())
torch.manual_seed(0)
hidden, target = torch.randn(6, 2, HIDDEN), torch.randn(6, 2, HIDDEN)
results: dict[str, Any] = {"experts": type(grouped.experts).__name__,
                           "grouped_gemm_plugin": getattr(grouped_gemm_util.grouped_gemm, "devshim_plugin", None)}
for name, layer in (("sequential", sequential), ("grouped", grouped)):
    layer.to(DEVICE)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        x = hidden.to(DEVICE).requires_grad_()
        optimizer.zero_grad()
        out = layer(x)[0]
        loss = F.mse_loss(out, target.to(DEVICE))
        loss.backward()
        if step == 0:
            results[name] = {"device": str(out.device), "out": out.detach().cpu().flatten().tolist(),
                             "dx": x.grad.cpu().flatten().tolist()}
        optimizer.step()
        losses.append(loss.item())
    results[name]["losses"] = losses
print(json.dumps(results))
