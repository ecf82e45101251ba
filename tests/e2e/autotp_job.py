"""DeepSpeed AutoTP inference of transformers models through devshim, on 2 ranks: what ``test_autotp.py`` checks.

Each rank builds a tiny Llama and a tiny GPT-2 from a config (random weights from a fixed seed, nothing
downloaded), computes the unsharded model's logits on its device, then shards a second copy with
``deepspeed.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.float32,
replace_with_kernel_inject=False)`` and computes the logits again. Where AutoTP sharded, the job asserts that it
really did (column-parallel layers hold half the output features, row-parallel ones are ``LinearAllreduce``);
where DeepSpeed refuses or fails, the error is reported. Rank 0 writes every rank's results.

GPT-2 is tried two ways: as above (DeepSpeed 0.19.8's AutoTP parser refuses it by name: 'gpt2' is in the
unsupported list of ``AutoTP.supported``), and with the injection policy DeepSpeed asks for instead
(``injection_policy={GPT2Block: ("attn.c_proj", "mlp.c_proj")}``, AutoTP's Conv1D path).

Usage: torchrun --nproc-per-node 2 autotp_job.py --report OUT.json
"""

import devshim_core.auto  # noqa: F401, I001 - first: the only line a DeepSpeed script adds

import argparse
import importlib.util
import json
from collections.abc import Callable
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from devshim_core import active_session
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

TP = 2
SEED = 1234
VOCAB, HIDDEN, HEADS, LAYERS, POSITIONS = 96, 64, 4, 2, 32
BATCH, SEQUENCE = 2, 12


def llama() -> torch.nn.Module:
    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,  # grouped-query: 1 KV head a rank
                         max_position_embeddings=POSITIONS, use_cache=False)
    return LlamaForCausalLM(config).eval()


def gpt2() -> torch.nn.Module:
    torch.manual_seed(SEED)
    config = GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, use_cache=False)
    return GPT2LMHeadModel(config).eval()


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"llama": llama, "gpt2": gpt2}
# the ways each model is sharded: init_inference's extra arguments
ROUTES: dict[str, dict[str, dict[str, Any]]] = {
    "llama": {"auto": {}},
    "gpt2": {"auto": {}, "injection_policy": {"injection_policy": {GPT2Block: ("attn.c_proj", "mlp.c_proj")}}},
}
# the first block's projections AutoTP splits by output features (column) and by input features (row)
COLUMN = {"llama": ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj"), "gpt2": ("attn.c_attn", "mlp.c_fc")}
ROW = {"llama": ("self_attn.o_proj", "mlp.down_proj"), "gpt2": ("attn.c_proj", "mlp.c_proj")}


def first_block(name: str, model: torch.nn.Module) -> torch.nn.Module:
    return model.model.layers[0] if name == "llama" else model.transformer.h[0]


def features(layer: torch.nn.Module) -> list[int]:
    """[output, input] features of a Linear (weight [out, in]) or of GPT-2's Conv1D (weight [in, out])."""
    out, into = layer.weight.shape
    return [into, out] if type(layer).__name__ == "Conv1D" else [out, into]


def shard(name: str, extra: dict[str, Any], ids: torch.Tensor, want: torch.Tensor,
          unsharded: dict[str, list[int]]) -> dict[str, Any]:
    try:
        engine = deepspeed.init_inference(MODELS[name](), tensor_parallel={"tp_size": TP}, dtype=torch.float32,
                                          replace_with_kernel_inject=False, **extra)
    except Exception as error:  # DeepSpeed's refusal (or failure) is the result: the test says which is expected
        return {"error": f"{type(error).__name__}: {error}"}
    with torch.no_grad():
        got = engine(input_ids=ids).logits
    block = first_block(name, engine.module)
    layers = {n: block.get_submodule(n) for n in (*COLUMN[name], *ROW[name])}
    classes = {n: type(layer).__name__ for n, layer in layers.items()}
    shapes = {n: list(layer.weight.shape) for n, layer in layers.items()}
    for n in COLUMN[name]:  # column-parallel: [out / TP, in], each rank computes half the output features
        out, into = unsharded[n]
        assert classes[n] == "LinearLayer" and shapes[n] == [out // TP, into], (name, n, classes[n], shapes[n])
    for n in ROW[name]:  # row-parallel: [out, in / TP], each rank's partial sums all-reduced
        out, into = unsharded[n]
        assert classes[n] == "LinearAllreduce" and shapes[n] == [out, into // TP], (name, n, classes[n], shapes[n])
    assert got.shape == want.shape == (BATCH, SEQUENCE, VOCAB), (got.shape, want.shape)
    return {"max_logit_difference": (got.float() - want.float()).abs().max().item(),
            "logits_device": str(got.device), "classes": classes, "shapes": shapes}


def run(name: str, device: torch.device) -> dict[str, Any]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(0)).to(device)
    whole = MODELS[name]().to(device)
    block = first_block(name, whole)
    unsharded = {n: features(block.get_submodule(n)) for n in (*COLUMN[name], *ROW[name])}
    with torch.no_grad():
        want = whole(input_ids=ids).logits
    del whole
    return {"unsharded_shapes": unsharded, "logit_scale": want.abs().max().item(),
            "unsharded_logits_device": str(want.device),
            "routes": {route: shard(name, extra, ids, want, unsharded) for route, extra in ROUTES[name].items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    args = parser.parse_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    accelerator = get_accelerator()
    accelerator.set_device(rank)
    device = torch.device(accelerator.device_name(rank))
    # megatron-core is installed: its CUDA-only imports are blocked, and transformers probed them on import above
    mine: dict[str, Any] = {"patch_sets": sorted({p["set"] for p in active_session().as_dict()["patches"]}),
                            "flash_attn_probe": repr(importlib.util.find_spec("flash_attn"))}
    mine.update({name: run(name, device) for name in MODELS})
    ranks: list[Any] = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        with open(args.report, "w") as f:
            json.dump({"world": world, "device": str(device), "ranks": ranks}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
