"""Train a small GPT with megatron-core on whichever device devshim selected.

Everything below the first line is plain, CUDA-written megatron-core code (``torch.cuda.set_device``,
``backend='nccl'``, ``.cuda()``): devshim's CUDA redirect and Megatron integration run it on the selected
plugin's device, with its parallelism intact.

    torchrun --nproc-per-node 2 examples/megatron_gpt.py --tp 2 --sequence-parallel
    torchrun --nproc-per-node 2 examples/megatron_gpt.py --pp 2 --vpp 2 --layers 4
    torchrun --nproc-per-node 2 examples/megatron_gpt.py --distributed-optimizer --overlap
    torchrun --nproc-per-node 2 examples/megatron_gpt.py --experts 4 --ep 2
    torchrun --nproc-per-node 2 examples/megatron_gpt.py --cp 2 --cp-comm-type a2a   # or p2p (ring attention)
    torchrun --nproc-per-node 4 examples/megatron_gpt.py --cp 4 --cp-comm-type a2a+p2p --hierarchical-cp 2,2

``--report FILE`` writes the losses and grad norms (rank 0) as JSON. ``--save-initial DIR`` / ``--load DIR``
write and read the initial weights, and ``--save DIR`` the final model and optimizer state, with
``megatron.core.dist_checkpointing``, which reshards between parallel layouts.
"""

import devshim_core.auto  # noqa: F401, I001 - first: detect, select a plugin, patch

import argparse
import contextlib
import inspect
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import dist_checkpointing, package_info, parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_batch_on_this_cp_rank

from devshim_core.profiling import StepProfiler


@dataclass
class Options:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    cp: int = 1  # context parallel: each sequence split over this many ranks
    cp_comm_type: str = "p2p"  # p2p (ring attention), a2a (Ulysses), all_gather, a2a+p2p (with hierarchical_cp)
    hierarchical_cp: str | None = None  # "A2A,RING" sizes for a2a+p2p
    sequence_parallel: bool = False
    recompute: str = "none"  # none | full | selective
    distributed_optimizer: bool = False
    overlap: bool = False  # overlapped grad reduce and param gather
    experts: int | None = None
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    seq: int = 32
    vocab: int = 128
    micro_batch: int = 2
    global_batch: int = 8
    steps: int = 4
    lr: float = 3e-3
    seed: int = 1234
    bf16: bool = False
    fused: bool = True  # Megatron's fused paths (served by the plugin's kernels) versus its unfused local ones
    load: str | None = None  # initial model weights, written by --save-initial of a run of any layout
    save_initial: str | None = None
    save: str | None = None  # model and optimizer state after the last step
    resume: str | None = None  # model and optimizer state written by --save; training goes on at --start-step
    start_step: int = 0
    profile_steps: str | None = None  # "N-M": record steps N..M (inclusive) with torch.profiler
    profile_ranks: str = "0"
    profile_memory: bool = False
    profile_dir: str = "profile"
    report: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def parse(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in Options().__dict__.items():
        if name == "extra":
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            kind = int if name in ("vpp", "experts") else str if value is None else type(value)
            p.add_argument(flag, type=kind, default=value)
    return Options(**vars(p.parse_args(argv)))


# -- set-up ------------------------------------------------------------------------------------------------


def init_distributed() -> None:
    """What a CUDA script does: pick the local GPU, NCCL. devshim maps both to the plugin's device and backend."""
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl")


def init_parallel(o: Options) -> None:
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=o.tp, pipeline_model_parallel_size=o.pp,
        virtual_pipeline_model_parallel_size=o.vpp, expert_model_parallel_size=o.ep, context_parallel_size=o.cp,
        hierarchical_context_parallel_sizes=hierarchical_cp(o))
    torch.manual_seed(o.seed)  # as megatron.training does: the CPU's generator initialises the weights off CUDA too
    tensor_parallel.model_parallel_cuda_manual_seed(o.seed)


def hierarchical_cp(o: Options) -> list[int] | None:
    return [int(size) for size in o.hierarchical_cp.split(",")] if o.hierarchical_cp else None


def transformer_config(o: Options) -> TransformerConfig:
    recompute = {} if o.recompute == "none" else (
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
        if o.recompute == "full" else {"recompute_granularity": "selective"})
    moe = {} if not o.experts else {
        "num_moe_experts": o.experts, "moe_router_topk": 2, "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0, "moe_token_dispatcher_type": "alltoall", "expert_model_parallel_size": o.ep}
    return TransformerConfig(
        num_layers=o.layers, hidden_size=o.hidden, num_attention_heads=o.heads, ffn_hidden_size=4 * o.hidden,
        tensor_model_parallel_size=o.tp, pipeline_model_parallel_size=o.pp,
        virtual_pipeline_model_parallel_size=o.vpp, sequence_parallel=o.sequence_parallel,
        context_parallel_size=o.cp, cp_comm_type=o.cp_comm_type if o.cp > 1 else None,
        hierarchical_context_parallel_sizes=hierarchical_cp(o),
        hidden_dropout=0.0, attention_dropout=0.0,  # dropout 0: parallel layouts must agree with one rank
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_activation_fusion=o.fused, masked_softmax_fusion=o.fused, apply_rope_fusion=o.fused,
        gradient_accumulation_fusion=o.fused, bf16=o.bf16, params_dtype=torch.bfloat16 if o.bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if o.bf16 else torch.float32, use_cpu_initialization=True,
        **recompute, **moe, **o.extra)


def build_model(o: Options, config: TransformerConfig) -> list[GPTModel]:
    """One GPTModel per virtual pipeline stage of this rank (one, without interleaving)."""
    spec = get_gpt_layer_local_spec(num_experts=o.experts, normalization="RMSNorm")
    chunks = []
    for stage in range(o.vpp or 1):
        vp_stage = stage if o.vpp else None
        where: dict[str, Any] = {"vp_stage": vp_stage} if VP_STAGE_ARGUMENT else {}
        with virtual_stage(vp_stage):
            model = GPTModel(
                config=config, transformer_layer_spec=spec, vocab_size=o.vocab, max_sequence_length=o.seq,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, **where),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, **where),
                position_embedding_type="rope", **where)
        chunks.append(model.cuda())
    return chunks


# megatron-core >= 0.13 takes the virtual pipeline stage as an argument; 0.12 reads the one parallel_state holds
VP_STAGE_ARGUMENT = "vp_stage" in inspect.signature(GPTModel.__init__).parameters
# megatron-core 0.12 differs from 0.13 on: its schedule multiplies the loss by the context-parallel size and wants
# the token count of the whole sequence (Megatron-LM's loss_func all-reduces it over the CP group), where later
# releases take this rank's count; its distributed optimizer has no dp_reshardable checkpoint format
BEFORE_0_13 = tuple(int(x) for x in package_info.__version__.split(".")[:2]) < (0, 13)


@contextlib.contextmanager
def virtual_stage(stage: int | None) -> Iterator[None]:
    """Where megatron-core reads the virtual stage from parallel_state (0.12), set it for the block."""
    if stage is None or VP_STAGE_ARGUMENT:
        yield
        return
    parallel_state.set_virtual_pipeline_model_parallel_rank(stage)
    try:
        yield
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)


def wrap(o: Options, config: TransformerConfig, chunks: list[Any]) -> list[DistributedDataParallel]:
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=o.overlap, overlap_param_gather=o.overlap,
        use_distributed_optimizer=o.distributed_optimizer, bucket_size=4096 if o.overlap else None)
    if o.bf16:  # as megatron.training does: bf16 inputs to the first stage, fp32 outputs from the last
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    wrapped = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
               for i, chunk in enumerate(chunks)]
    # how megatron.training wires the schedule to the buffers
    config.finalize_model_grads_func = finalize_model_grads
    if o.overlap:
        config.no_sync_func = [m.no_sync for m in wrapped]
        config.grad_sync_func = [m.start_grad_sync for m in wrapped]
        config.param_sync_func = [m.start_param_sync for m in wrapped]
        if len(wrapped) == 1:
            config.no_sync_func, config.grad_sync_func, config.param_sync_func = (
                config.no_sync_func[0], config.grad_sync_func[0], config.param_sync_func[0])
    return wrapped


def optimizer_for(o: Options, chunks: list[DistributedDataParallel]) -> Any:
    return get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=o.lr, weight_decay=0.01, clip_grad=1.0, bf16=o.bf16,
        use_distributed_optimizer=o.distributed_optimizer, params_dtype=torch.float32), chunks)


def optimizer_classes(optimizer: Any) -> list[str]:
    """The torch optimizers under Megatron's wrappers (chained, mixed precision, distributed), by class path: which
    Adam Megatron built (TE's or apex's FusedAdam on CUDA, the plugin's under devshim, else torch's AdamW)."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return sorted({f"{type(inner).__module__}.{type(inner).__qualname__}"
                   for inner in (getattr(wrapper, "optimizer", wrapper) for wrapper in chained)})


# -- data and steps ----------------------------------------------------------------------------------------


def global_batch(o: Options, step: int) -> torch.Tensor:
    """The same tokens for step ``step`` whatever the layout: generated on the host from the step number.
    Two batches alternate, so that a few steps are enough to see the loss fall (they are memorised)."""
    generator = torch.Generator().manual_seed(o.seed * 1000 + step % 2)
    return torch.randint(0, o.vocab, (o.global_batch, o.seq + 1), generator=generator)


def microbatches(o: Options, step: int) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's share of the global batch, split into micro-batches, on the device; with context
    parallelism, this rank's chunks of each sequence (Megatron's load-balanced split)."""
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    share = global_batch(o, step).chunk(dp)[rank]
    positions = torch.arange(o.seq, device="cuda").unsqueeze(0).expand(o.micro_batch, -1)
    return [get_batch_on_this_cp_rank({"tokens": b[:, :-1].cuda(), "labels": b[:, 1:].cuda(),
                                       "position_ids": positions})
            for b in share.split(o.micro_batch)]


def forward_step(data: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    batch = next(data)
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        # Megatron's convention: (sum over this rank's tokens, their number); the schedule divides the sum in place
        # and the gradient reduction averages over the data- and context-parallel ranks
        total = output.float().sum()
        tokens = torch.tensor(output.numel(), device=output.device)
        report = {"lm loss": (total / tokens).detach()}
        if BEFORE_0_13 and parallel_state.get_context_parallel_world_size() > 1:
            dist.all_reduce(tokens, group=parallel_state.get_context_parallel_group())
        return total, tokens, report

    return losses, loss_func


def train_step(o: Options, chunks: list[DistributedDataParallel], optimizer: Any, step: int) -> tuple[float, float]:
    """One optimizer step over the global batch; returns (loss averaged over the global batch, grad norm)."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    batches = microbatches(o, step)
    iterators = [iter(batches) for _ in chunks]
    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(batches), seq_length=o.seq,
        micro_batch_size=o.micro_batch, forward_only=False)
    _, grad_norm, _ = optimizer.step()
    return global_loss(results), float(grad_norm)


def global_loss(results: list[dict[str, torch.Tensor]]) -> float:
    """Mean loss over every micro-batch of every data-parallel rank, known on every rank."""
    last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    local = torch.stack([r["lm loss"] for r in results]).mean() if last_stage and results else torch.zeros(())
    total = local.reshape(1).cuda()
    dist.all_reduce(total)  # every last-stage rank holds its DP (and CP) share; TP ranks hold the same value
    last_stage_ranks = dist.get_world_size() // parallel_state.get_pipeline_model_parallel_world_size()
    return total.item() / last_stage_ranks


# -- checkpoints -------------------------------------------------------------------------------------------


def sharded_state(chunks: list[torch.nn.Module], optimizer: Any = None, loading: bool = False) -> dict[str, Any]:
    modules = [getattr(c, "module", c) for c in chunks]
    state: dict[str, Any] = {}
    for i, m in enumerate(modules):
        with virtual_stage(i if len(modules) > 1 else None):
            state[f"model{i}"] = m.sharded_state_dict()
    if optimizer is not None:
        # 'dp_reshardable': the distributed optimizer's non-deprecated format for resuming the same layout (>= 0.13;
        # megatron-core 0.12 has only its default, fully_sharded_model_space)
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=loading,
            **({} if BEFORE_0_13 else {"metadata": {"distrib_optim_sharding_type": "dp_reshardable"}}))
    return state


def save(directory: str, chunks: list[torch.nn.Module], optimizer: Any = None) -> None:
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(sharded_state(chunks, optimizer), directory)


def load(directory: str, chunks: list[torch.nn.Module], optimizer: Any = None) -> None:
    """Model (and optimizer) state from a checkpoint written by any parallel layout."""
    loaded = dist_checkpointing.load(sharded_state(chunks, optimizer, loading=True), directory)
    for i, chunk in enumerate(chunks):
        getattr(chunk, "module", chunk).load_state_dict(loaded[f"model{i}"])
    if optimizer is not None:
        with torch.no_grad():  # fp32 main params are views of the (grad-requiring) model params
            optimizer.load_state_dict(loaded["optimizer"])


# -- the run -----------------------------------------------------------------------------------------------


def device_report() -> dict[str, Any]:
    from devshim_core.session import current

    session = current()
    param_device = torch.empty(0, device="cuda").device
    return {"rank": dist.get_rank(), "plugin": session.device.plugin if session else None,
            "backend": dist.get_backend(), "device": str(param_device)}


def run(o: Options) -> dict[str, Any]:
    """Build, optionally load, train ``o.steps`` steps from ``o.start_step``; return the losses and grad norms."""
    init_parallel(o)
    config = transformer_config(o)
    chunks = build_model(o, config)
    if o.save_initial:
        save(o.save_initial, chunks)
    if o.load:
        load(o.load, chunks)
    chunks = wrap(o, config, chunks)
    optimizer = optimizer_for(o, chunks)
    if o.resume:
        load(o.resume, chunks, optimizer)
    losses, norms = [], []
    profiler = None
    if o.profile_steps:  # MindSpeed's --profile-step-start/end, --profile-ranks, --profile-with-memory
        first, _, last = o.profile_steps.partition("-")
        profiler = StepProfiler(int(first), int(last or first) + 1, [int(r) for r in o.profile_ranks.split(",")],
                                with_memory=o.profile_memory, output_dir=o.profile_dir)
    for step in range(o.start_step, o.start_step + o.steps):
        loss, norm = train_step(o, chunks, optimizer, step)
        if profiler is not None:
            profiler.step()
        losses.append(loss)
        norms.append(norm)
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss:.6f} grad norm {norm:.6f}", flush=True)
    if o.save:
        save(o.save, chunks, optimizer)
    return {"losses": losses, "grad_norms": norms, "chunks": chunks, "optimizer": optimizer}


def main() -> None:
    o = parse()
    init_distributed()
    result = run(o)
    devices = [None] * dist.get_world_size()
    dist.all_gather_object(devices, device_report())
    if dist.get_rank() == 0 and o.report:
        with open(o.report, "w") as f:
            json.dump({"losses": result["losses"], "grad_norms": result["grad_norms"], "ranks": devices}, f)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
