"""Fault: a Megatron flag or config field the selected device cannot serve (DeepEP, attention_backend=flash,
TransformerEngine-only options, CUDA graphs, NCCL-only features, ...).

What the user sees: building the ``TransformerConfig`` (or ``MLATransformerConfig``) raises devshim's ConfigError,
one line per setting, each naming the field, its Megatron-LM flag, why the device cannot run it and what to use
instead; no module has been built yet. Without the refusal Megatron accepts some of them and runs something else
(``attention_backend=flash`` builds its local attention) or fails later inside the model. The defaults, and the
served alternatives the messages name, are accepted. Under Megatron-LM the same settings, and the flags that never
reach a config (``--use-nccl-ub``, ``--te-rng-tracker``, ...), are refused when the arguments are validated.

The classification is complete by construction: every dataclass field of the installed megatron-core's configs,
and every flag of a Megatron-LM checkout's parser (``MEGATRON_LM_PATH``, tag ``core_v0.16.1``; skipped when unset),
must have an entry, so a new release forces a decision. Fields served only by a device kernel (``sequence_parallel``
needs ``rms_norm``, ``gradient_accumulation_fusion`` needs ``wgrad_accumulate``, ...) are accepted on
``cpu_reference`` and refused on a third-party plugin that provides no kernels.

Each probe runs in a fresh interpreter (``import devshim_core.auto`` is process-wide), with megatron-core 0.16.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from devshim_core.integrations.megatron.unserved_args import (
    ARGS_ONLY,
    FLAG_DESTS,
    KITCHEN_ONLY,
    RENAMED,
    UNSERVED_ARGS,
)
from devshim_core.integrations.megatron.unserved_flags import CONFIG_FIELDS, UNSERVED, Unserved
from tests.e2e.third_party import checkout

pytest.importorskip("megatron.core", reason="the Megatron specs need the megatron extra")

TESTS_DIR = Path(__file__).resolve().parents[1]
BASE = "dict(num_layers=2, hidden_size=64, num_attention_heads=4)"
# fields whose refusal depends on a kernel the plugin provides: served on cpu_reference
KERNEL_BACKED = {"sequence_parallel": "rms_norm", "layernorm_zero_centered_gamma": "rms_norm",
                 "persist_layer_norm": "rms_norm", "memory_efficient_layer_norm": "rms_norm",
                 "gradient_accumulation_fusion": "wgrad_accumulate", "apply_rope_fusion": "rotary",
                 "context_parallel_size": "attention", "hierarchical_context_parallel_sizes": "attention"}
# (case, config class, keyword arguments): one refused value per unserved field, True where none is given
VALUES = {"pipeline_model_parallel_comm_backend": "'ucc'", "context_parallel_size": "2",
          "hierarchical_context_parallel_sizes": "[2, 2]", "cross_entropy_fusion_impl": "'te'",
          "normalization": "'L2Norm'", "experimental_attention_variant": "'dsa'", "fp8": "'hybrid'", "fp4": "'e2m1'",
          "quant_recipe": "RecipeConfig([], {})", "moe_token_dispatcher_type": "'flex'", "cuda_graph_impl": "'local'",
          "symmetric_ar_type": "'two_shot'", "transformer_impl": "'inference_optimized'",
          "attention_backend": "AttnBackend.flash", "sequence_parallel": "True, tensor_model_parallel_size=2"}
CASES = [(field, "TransformerConfig", f"{field}={VALUES.get(field, 'True')}") for field in UNSERVED
         if field != "cache_mla_latents"]
CASES += [("attention_backend:fused", "TransformerConfig", "attention_backend=AttnBackend.fused"),
          ("apply_rope_fusion:mla", "MLATransformerConfig", "apply_rope_fusion=True"),
          ("cache_mla_latents", "MLATransformerConfig", "cache_mla_latents=True")]
# values the messages name instead, and the defaults: accepted
ACCEPTED = [("defaults", "TransformerConfig", ""), ("defaults:mla", "MLATransformerConfig", ""),
            *[(f"attention_backend:{b}", "TransformerConfig", f"attention_backend=AttnBackend.{b}")
              for b in ("auto", "local", "unfused")],
            ("alltoall", "TransformerConfig", "moe_token_dispatcher_type='alltoall', num_moe_experts=2"),
            ("native-cross-entropy", "TransformerConfig", "cross_entropy_fusion_impl='native'"),
            ("local-impl", "TransformerConfig", "transformer_impl='local'"),
            ("layer-norm", "TransformerConfig", "normalization='LayerNorm'")]

CONFIG_PROBE = """
import json
import devshim_core.auto  # noqa
from megatron.core.quantization.quant_config import RecipeConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
outcome = {{}}
for case, cls, kwargs in {cases!r}:
    try:
        eval(f"{{cls}}(**{base}, {{kwargs}})")
        outcome[case] = "accepted"
    except Exception as error:
        outcome[case] = f"{{type(error).__name__}}: {{error}}"
print("PROBE " + json.dumps(outcome))
"""

# a third-party plugin that answers no kernel hook: every op is None
BARE_PLUGIN = "from plugin_fixtures import FakePlugin\nplugin = FakePlugin(priority=100)\n"


def run_probe(code: str, *, pythonpath: list[str] | None = None, **env: str) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DEVSHIM_") and k != "PYTHONPATH"}
    clean.update(PYTHONWARNINGS="ignore", DEVSHIM_DISABLED_PLUGINS="ascend,sophgo,cuda", **env)
    if pythonpath:
        clean["PYTHONPATH"] = os.pathsep.join(pythonpath)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("PROBE "))
    return json.loads(line[len("PROBE "):])


# several at once: one line each, in the table's order
SEVERAL = [("several", "TransformerConfig", "attention_backend=AttnBackend.flash, moe_enable_deepep=True, "
            "moe_token_dispatcher_type='flex', num_moe_experts=4")]


@pytest.fixture(scope="module")
def on_cpu_reference() -> dict[str, str]:
    return run_probe(CONFIG_PROBE.format(cases=CASES + ACCEPTED + SEVERAL, base=BASE), DEVSHIM_PLUGIN="cpu_reference")


@pytest.fixture(scope="module")
def on_bare_plugin(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from plugin_fixtures import write_distribution

    site = tmp_path_factory.mktemp("bare-plugin")
    write_distribution(site, "devshim-bare", "0.0.1", {"bare": "bare_plugin:plugin"},
                       files={"bare_plugin.py": BARE_PLUGIN})
    cases = [case for case in CASES if case[0] in KERNEL_BACKED] + ACCEPTED[:2]
    return run_probe(CONFIG_PROBE.format(cases=cases, base=BASE), pythonpath=[str(site), str(TESTS_DIR)],
                     DEVSHIM_PLUGIN="bare")


def assert_refused_by_name(message: str, field: str, plugin: str, device: str = "cpu") -> None:
    entry = UNSERVED[field]
    assert message.startswith("ConfigError: ") and f"cannot run on the {device} device ({plugin} plugin)" in message
    assert "before the model is built" in message
    line = next((x for x in message.splitlines() if x.startswith(f"  - {field}=")), None)
    assert line is not None, message
    flag = entry.flag or "no Megatron-LM flag"
    assert f"({flag}" in line or f"(on unless {flag})" in line, line
    assert entry.why.replace("{plugin}", plugin) in line and f". Instead: {entry.instead}" in line, line


# -- the classification is complete --------------------------------------------------------------------------


ONLY_IN_0_12 = {"pipeline_model_parallel_split_rank", "max_position_embeddings"}


def megatron_core_version() -> tuple[int, ...]:
    from megatron.core import package_info

    return tuple(int(x) for x in package_info.__version__.split(".")[:2])


def test_every_field_of_the_installed_megatron_core_configs_has_a_decision() -> None:
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    fields = {f.name for cls in (ModelParallelConfig, TransformerConfig, MLATransformerConfig)
              for f in dataclasses.fields(cls)}
    assert sorted(fields - set(CONFIG_FIELDS)) == [], "new megatron-core fields: classify them in unserved_flags.py"
    if megatron_core_version() >= (0, 16):  # the table covers 0.12 too: on 0.16 every other entry is a field
        assert sorted(set(CONFIG_FIELDS) - fields - ONLY_IN_0_12) == [], "fields megatron-core no longer has"
    for name, entry in UNSERVED.items():
        assert entry.why and entry.instead, name
        assert not entry.refused(_Defaults(), _NO_KERNELS), f"{name}'s default is refused"


class _Defaults:
    """Every field at megatron-core's default (MLATransformerConfig's, which adds to TransformerConfig's)."""

    def __getattr__(self, name: str) -> Any:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        field = {f.name: f for f in dataclasses.fields(MLATransformerConfig)}.get(name)
        if field is None:  # a field of another release (the table covers 0.12 and 0.16)
            raise AttributeError(name)
        if field.default is not dataclasses.MISSING:
            return field.default
        return field.default_factory()  # type: ignore[misc]  # MISSING has no call: every config field has one


class _NoKernels:
    attention = type("FusedKernels", (), {"__getattr__": lambda self, name: None})()


_NO_KERNELS: Any = _NoKernels()


def test_docs_megatron_md_lists_every_refused_field_and_flag() -> None:
    doc = (TESTS_DIR.parent / "docs" / "megatron.md").read_text()
    section = doc[doc.index("## Settings refused before the model is built"):doc.index("## Running it")]
    assert [f for f in UNSERVED if f"`{f}`" not in section] == []
    assert [e.flag for e in UNSERVED_ARGS.values() if f"`{e.flag}`" not in section] == []


# -- refused by name when the config is built ------------------------------------------------------------------


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_an_unserved_value_is_refused_by_name_when_the_config_is_built(case: str, on_cpu_reference) -> None:
    field = case.partition(":")[0]
    message = on_cpu_reference[case]
    if field in KERNEL_BACKED and case != "apply_rope_fusion:mla":
        assert message == "accepted", f"cpu_reference's {KERNEL_BACKED[field]} kernel serves {field}: {message}"
    else:
        assert_refused_by_name(message, field, "cpu_reference")


@pytest.mark.parametrize("field", sorted(KERNEL_BACKED))
def test_a_kernel_backed_field_is_refused_on_a_plugin_without_the_kernel(field: str, on_bare_plugin) -> None:
    assert_refused_by_name(on_bare_plugin[field], field, "bare")
    assert "the bare plugin provides none" in on_bare_plugin[field] or field == "apply_rope_fusion"


def test_the_defaults_and_the_alternatives_the_messages_name_are_accepted(on_cpu_reference, on_bare_plugin) -> None:
    assert {case: on_cpu_reference[case] for case, _, _ in ACCEPTED} == {case: "accepted" for case, _, _ in ACCEPTED}
    assert on_bare_plugin["defaults"] == on_bare_plugin["defaults:mla"] == "accepted"


def test_every_unserved_field_has_a_case() -> None:
    assert {c[0].partition(":")[0] for c in CASES} == set(UNSERVED)


def test_several_unserved_settings_are_refused_together_one_line_each(on_cpu_reference) -> None:
    message = on_cpu_reference["several"]
    assert message.startswith("ConfigError: 3 Megatron settings cannot run on the cpu device (cpu_reference plugin)")
    assert [line.split("=")[0] for line in message.splitlines()[1:]] == [
        "  - attention_backend", "  - moe_token_dispatcher_type", "  - moe_enable_deepep"]
    assert ("  - attention_backend=AttnBackend.flash (--attention-backend flash): " in message
            and "  - moe_enable_deepep=True (--moe-enable-deepep): " in message)


# -- a real GPTModel: refused before any module is built ------------------------------------------------------

GPT_PROBE = """
import json, os, socket
import devshim_core.auto  # noqa
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(1)
built = []
init = MegatronModule.__init__
def counted(self, *args, **kwargs):
    built.append(type(self).__name__)
    init(self, *args, **kwargs)
MegatronModule.__init__ = counted
CASES = {
    "flash": (dict(attention_backend=AttnBackend.flash), dict()),
    "deepep": (dict(num_moe_experts=2, moe_token_dispatcher_type="flex", moe_enable_deepep=True,
                    moe_router_load_balancing_type="none", add_bias_linear=False), dict(num_experts=2)),
}
outcome = {}
for case, (fields, spec) in CASES.items():
    built.clear()
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):  # GPTModel sets them from the backend
        os.environ.pop(name, None)
    stage = "config"
    try:
        config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **fields)
        stage = "model"
        model = GPTModel(config, get_gpt_layer_local_spec(**spec), vocab_size=128, max_sequence_length=16)
        stage = "built"
        attention = type(model.decoder.layers[0].self_attention.core_attention).__name__
        outcome[case] = {"stage": stage, "modules": len(built), "core_attention": attention}
    except Exception as error:
        outcome[case] = {"stage": stage, "modules": len(built), "error": f"{type(error).__name__}: {error}"}
print("PROBE " + json.dumps(outcome))
"""


@pytest.fixture(scope="module")
def gpt_models() -> dict[str, dict[str, Any]]:
    return {"refused": run_probe(GPT_PROBE, DEVSHIM_PLUGIN="cpu_reference"),
            "unchecked": run_probe(GPT_PROBE, DEVSHIM_PLUGIN="cpu_reference",
                                   DEVSHIM_DISABLE="megatron-core:refuse-unserved-flags")}


def test_a_gpt_model_with_flash_attention_is_refused_before_any_module_is_built(gpt_models) -> None:
    refused, unchecked = gpt_models["refused"]["flash"], gpt_models["unchecked"]["flash"]
    assert refused["stage"] == "config" and refused["modules"] == 0, refused
    assert_refused_by_name(refused["error"], "attention_backend", "cpu_reference")
    # what the refusal prevents: Megatron builds its local attention and trains with it, not the flash asked for
    assert unchecked["stage"] == "built" and unchecked["core_attention"] == "DotProductAttention", unchecked


def test_a_gpt_model_with_deepep_is_refused_before_any_module_is_built(gpt_models) -> None:
    refused, unchecked = gpt_models["refused"]["deepep"], gpt_models["unchecked"]["deepep"]
    assert refused["stage"] == "config" and refused["modules"] == 0, refused
    assert_refused_by_name(refused["error"], "moe_enable_deepep", "cpu_reference")
    assert_refused_by_name(refused["error"], "moe_token_dispatcher_type", "cpu_reference")
    # what the refusal prevents: Megatron fails half-way through building the model, with an error about the
    # layout (one rank), not about DeepEP, which it would only reach on a TPxEP > 1 layout
    assert unchecked["stage"] == "model" and unchecked["modules"] > 0, unchecked
    assert "deepep" not in unchecked["error"].lower(), unchecked


# -- Megatron-LM's flags: refused when the arguments are validated --------------------------------------------

# one argv per args-only refusal, and two config fields' flags
ARGV = {"te_rng_tracker": ["--te-rng-tracker"], "use_flash_attn": ["--use-flash-attn"],
        "use_legacy_models": ["--use-legacy-models"], "record_memory_history": ["--record-memory-history"],
        "high_priority_stream_groups": ["--high-priority-stream-groups", "dp"],
        "nccl_communicator_config_path": ["--nccl-communicator-config-path", "nccl.yaml"],
        "nccl_ub": ["--use-nccl-ub"], "use_sharp": ["--use-sharp"],
        "reuse_grad_buf_for_mxfp8_param_ag": ["--reuse-grad-buf-for-mxfp8-param-ag"],
        "te_precision_config_file": ["--te-precision-config-file", "precision.yaml"],
        "use_precision_aware_optimizer": ["--use-precision-aware-optimizer"],
        "log_device_memory_used": ["--log-device-memory-used"], "log_energy": ["--log-energy"],
        "log_straggler": ["--log-straggler"], "refit_method": ["--refit-method", "nvshmem"],
        "rl_inference_model_unified_memory_level": ["--rl-inference-model-unified-memory-level", "1"],
        "inference_dynamic_batching_unified_memory_level": ["--inference-dynamic-batching-unified-memory-level", "1"],
        "hybrid_override_pattern": ["--hybrid-override-pattern", "M*M-"],
        "hybrid_attention_ratio": ["--hybrid-attention-ratio", "0.5"],
        "hybrid_mlp_ratio": ["--hybrid-mlp-ratio", "0.5"],
        "moe_enable_deepep": ["--moe-enable-deepep"], "attention_backend": ["--attention-backend", "flash"]}

ARGS_PROBE = """
import argparse, json, sys
import devshim_core.auto  # noqa
import megatron.training  # noqa: arms devshim's megatron-training patch sets
from megatron.training import arguments, initialize
parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
flags = {{a.dest: a.option_strings for a in parser._actions if a.option_strings and a.dest != "help"}}
outcome = {{}}
for case, argv in {argv!r}.items():
    sys.argv = ["pretrain_gpt.py", *argv]
    args = arguments.parse_args()
    try:
        initialize.validate_args(args, {{}})  # what initialize_megatron calls
        outcome[case] = "accepted"
    except Exception as error:
        outcome[case] = f"{{type(error).__name__}}: {{error}}"
from devshim_core import session
from devshim_core.integrations.megatron.unserved_args import args_problems
sys.argv = ["pretrain_gpt.py"]
defaults = args_problems(arguments.parse_args(), session.current().device)
print("PROBE " + json.dumps({{"flags": flags, "outcome": outcome, "defaults": defaults}}))
"""


@pytest.fixture(scope="module")
def megatron_lm() -> dict[str, Any]:
    path = checkout("MEGATRON_LM_PATH", "NVIDIA/Megatron-LM at tag core_v0.16.1", "megatron/training/arguments.py")
    return run_probe(ARGS_PROBE.format(argv=ARGV), pythonpath=[str(path)], DEVSHIM_PLUGIN="cpu_reference")


def test_every_megatron_lm_flag_has_a_decision_and_every_refused_flag_is_spelled_as_megatron_lm_spells_it(
        megatron_lm) -> None:
    flags: dict[str, list[str]] = megatron_lm["flags"]
    assert sorted(d for d in flags if d not in CONFIG_FIELDS and d not in ARGS_ONLY) == [], (
        "new Megatron-LM flags: classify them in unserved_args.py")
    assert sorted(set(ARGS_ONLY) - set(flags) - KITCHEN_ONLY) == [], "flags Megatron-LM no longer has"
    spelled = {option: dest for dest, options in flags.items() for option in options}
    for name, entry in [*UNSERVED.items(), *UNSERVED_ARGS.items()]:
        if entry.flag is not None and name not in KITCHEN_ONLY:
            assert spelled.get(entry.flag) == FLAG_DESTS.get(name, name), (name, entry.flag)
    assert set(RENAMED.values()) <= set(flags)


@pytest.mark.parametrize("case", sorted(ARGV))
def test_an_unserved_megatron_lm_flag_is_refused_when_the_arguments_are_validated(case: str, megatron_lm) -> None:
    message = megatron_lm["outcome"][case]
    entry: Unserved = UNSERVED_ARGS.get(case) or UNSERVED[case]
    assert message.startswith("ConfigError: ") and "when Megatron-LM's arguments are validated" in message, message
    line = next(x for x in message.splitlines() if x.startswith(f"  - {case}="))
    assert f"({entry.flag}" in line and entry.why in line and f". Instead: {entry.instead}" in line, line


def test_megatron_lm_defaults_pass_devshim_s_check(megatron_lm) -> None:
    assert megatron_lm["defaults"] == []  # --transformer-impl transformer_engine, fusions on: all served
