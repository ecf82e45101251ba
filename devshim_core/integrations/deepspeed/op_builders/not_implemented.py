"""The answer for every DeepSpeed op devshim does not serve: a clear error naming the op, instead of a compiler run.

:func:`refusal_for` makes one builder class per DeepSpeed builder name (``FusedLambBuilder``, ...), a subclass of
:class:`NotImplementedBuilder` whose ``name`` is DeepSpeed's own op name (``fused_lamb``), read from DeepSpeed's
builder sources, so that the error, ``ds_report`` and ``__compatible_ops__`` all name the op the user asked for.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

from devshim_core.device import Device
from devshim_core.integrations.deepspeed.op_builders.base import DevshimOpBuilder

_ADAM_INSTEAD = ('use "optimizer": {"type": "Adam"} or "AdamW" (the plugin\'s Adam kernels), or pass a torch.optim '
                 "optimizer to deepspeed.initialize(optimizer=...)")
_NO_INJECTION = ("pass replace_with_kernel_inject=False to deepspeed.init_inference (AutoTP tensor parallelism still "
                 "runs)")
_FASTGEN = ("DeepSpeed-FastGen (deepspeed.inference.v2, build_hf_engine) needs it: run inference through "
            "deepspeed.init_inference(..., replace_with_kernel_inject=False) instead")
_TRANSFORMER = ("DeepSpeedTransformerLayer (deepspeed.ops.transformer) needs it: build the model from its PyTorch "
                "layers instead (HuggingFace's own, or torch.nn.TransformerEncoderLayer)")

# What each op DeepSpeed builds is for, and what to do instead: keyed by DeepSpeed's builder class name.
ADVICE: dict[str, str] = {
    "FusedLambBuilder": f'the "Lamb" optimizer (FusedLamb) needs it: {_ADAM_INSTEAD}',
    "FusedLionBuilder": f'the "Lion" optimizer without optimizer offload (FusedLion) needs it: {_ADAM_INSTEAD}',
    "CPULionBuilder": f'the "Lion" optimizer with offload_optimizer (DeepSpeedCPULion) needs it: {_ADAM_INSTEAD}',
    "CPUAdagradBuilder": ('the "Adagrad" optimizer with offload_optimizer (DeepSpeedCPUAdagrad) needs it: use "Adam" '
                          'or "AdamW" with offload (the plugin\'s host Adam), or Adagrad without offload_optimizer '
                          "(DeepSpeed then uses torch.optim.Adagrad)"),
    "TransformerBuilder": _TRANSFORMER,
    "StochasticTransformerBuilder": _TRANSFORMER,
    "InferenceBuilder": f"deepspeed.init_inference's kernel injection needs it: {_NO_INJECTION}",
    "SpatialInferenceBuilder": f"kernel injection into diffusion models (init_inference) needs it: {_NO_INJECTION}",
    "InferenceCoreBuilder": _FASTGEN,
    "InferenceCutlassBuilder": _FASTGEN,
    "RaggedOpsBuilder": _FASTGEN,
    "RaggedUtilsBuilder": _FASTGEN,
    "QuantizerBuilder": ('ZeRO++ quantized communication and quantized inference need it: set "zero_quantized_weights" '
                         'and "zero_quantized_gradients" to false in "zero_optimization", and leave init_inference '
                         "unquantized"),
    "FPQuantizerBuilder": ("FP8/FP6 quantization (deepspeed.linear's OptimizedLinear with a quantization_config) needs "
                           "it: leave quantization_config unset"),
    "RandomLTDBuilder": ('random-LTD needs it: set "data_efficiency": {"data_routing": {"random_ltd": {"enabled": '
                         "false}}}"),
    "EvoformerAttnBuilder": ("DS4Sci_EvoformerAttention (deepspeed.ops.deepspeed4science) needs it: use the model's "
                             "own PyTorch attention instead (OpenFold's without DeepSpeed's kernel)"),
    "DeepCompileBuilder": ('DeepCompile needs it: set "compile": {"deepcompile": false} (engine.compile() with '
                           "torch.compile still runs)"),
    "GDSBuilder": ('GPUDirect Storage needs it: set "aio": {"use_gds": false}; NVMe offload then runs on the async_io '
                   "op, which devshim serves"),
    "PinMemoryBuilder": ("DS_PIN_MEMORY_BACKEND=native needs it: unset DS_PIN_MEMORY_BACKEND (the accelerator then "
                         "pins host memory)"),
    "SparseAttnBuilder": ('sparse attention (deepspeed.ops.sparse_attention, the "sparse_attention" config) needs it: '
                          "use the model's dense attention"),
    "UtilsBuilder": ("its flatten/unflatten are torch._utils._flatten_dense_tensors and _unflatten_dense_tensors: "
                     "call those instead"),
    "FlashAttentionBuilder": "only DeepSpeed's XPU accelerator has it: use torch's scaled_dot_product_attention",
}
DEFAULT_ADVICE = ("devshim serves DeepSpeed's async_io, cpu_adam, fused_adam and pack_bits ops only: turn off the "
                  "DeepSpeed feature that loads this one")
# Names the accelerator is asked for that are base classes, not ops (DeepSpeed's all_ops walks every *Builder name
# of devshim's own modules): they get the generic refusal.
_NOT_OPS = frozenset({"OpBuilder", "CUDAOpBuilder", "DevshimOpBuilder", "NotImplementedBuilder"})


class NotImplementedBuilder(DevshimOpBuilder):
    """The refusal. Itself the generic one (DeepSpeed's ``NotImplementedBuilder``); :func:`refusal_for` makes the
    one for a named DeepSpeed builder."""

    BUILD_VAR = "DS_BUILD_NOT_IMPLEMENTED"
    NAME = "deepspeed_not_implemented"
    BUILDER = "NotImplementedBuilder"  # the DeepSpeed builder class name this refusal answers for

    def __init__(self, name: str | None = None) -> None:
        unknown = self.NAME if self.BUILDER in _NOT_OPS else self.BUILDER  # a builder DeepSpeed's sources lack
        super().__init__(name=name or deepspeed_op_name(self.BUILDER) or unknown)

    def op_description(self) -> str:
        return repr(self.name) if self.name == self.BUILDER or self.BUILDER in _NOT_OPS else \
            f"{self.name!r} ({self.BUILDER})"

    def kernel_problem(self, device: Device) -> str | None:
        return f"devshim has no implementation of it; {ADVICE.get(self.BUILDER, DEFAULT_ADVICE)}"


@functools.cache
def refusal_for(class_name: str) -> type[NotImplementedBuilder]:
    """The builder class answering DeepSpeed's ``class_name`` (``"FusedLambBuilder"``), one per name."""
    if class_name in _NOT_OPS or not class_name.isidentifier():
        return NotImplementedBuilder
    # its op name is looked up when it is instantiated, not here: import deepspeed asks for every builder class
    return type(class_name, (NotImplementedBuilder,),
                {"BUILDER": class_name, "__module__": __name__, "__qualname__": class_name,
                 "__doc__": f"devshim's refusal of DeepSpeed's {class_name}: no devshim implementation."})


_CLASS_LINE = re.compile(r"class\s+(\w+Builder)\b")
_NAME_LINE = re.compile(r"\s+NAME\s*=\s*[\"']([^\"']+)[\"']")


def _names_in(path: Path) -> dict[str, str]:
    """``{class: NAME}`` for the builder classes in one source file whose body sets ``NAME`` to a literal."""
    found: dict[str, str] = {}
    current: str | None = None
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        opened = _CLASS_LINE.match(line)
        if opened:
            current = opened.group(1)
        elif line[:1] not in ("", " ", "\t", "#", "@"):
            current = None  # back at module level
        elif current is not None and (literal := _NAME_LINE.match(line)):
            found.setdefault(current, literal.group(1))
            current = None
    return found


@functools.cache
def _op_names_in(directory: Path, pattern: str) -> dict[str, str]:
    names: dict[str, str] = {}
    for path in sorted(directory.glob(pattern)):
        try:
            for class_name, op_name in _names_in(path).items():
                names.setdefault(class_name, op_name)
        except OSError:
            continue
    return names


def deepspeed_op_name(class_name: str) -> str | None:
    """DeepSpeed's op name for its builder ``class_name`` (``FusedLambBuilder`` -> ``fused_lamb``), or ``None``.

    Read from the sources, not imported: the accelerator packages (``op_builder/npu``, ``/xpu``, ...) belong to other
    devices. DeepSpeed's CUDA builders (the top level) are read first; the accelerators' only for a name they lack."""
    builder_module = sys.modules.get("deepspeed.ops.op_builder.builder")
    origin = getattr(builder_module, "__file__", None)
    if class_name in _NOT_OPS or not origin:
        return None
    directory = Path(origin).parent
    return _op_names_in(directory, "*.py").get(class_name) or _op_names_in(directory, "*/*.py").get(class_name)
