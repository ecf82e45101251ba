"""Spec: Megatron gets the same patches whichever is imported first and its CUDA-only imports are answered before it
makes them. (The config fields and flags no devshim device can serve, refused by name: tests/faults/
test_megatron_unserved.py.)

Each case runs in a fresh interpreter (``import devshim_core.auto`` is process-wide), with megatron-core 0.16 as
installed for the tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from devshim_core.integrations.megatron import softmax_modules
from devshim_core.integrations.megatron.extension_modules import BATCH_INVARIANT, BLOCKED

pytest.importorskip("megatron.core", reason="the Megatron specs need the megatron extra")

# what a user's script imports of Megatron, before or after devshim
MEGATRON_IMPORTS = """
import megatron.core.tensor_parallel
import megatron.core.models.gpt
import megatron.core.optimizer
import megatron.core.transformer.transformer_config
"""

PROBE = """
import importlib, json, sys
FIRST = sys.argv[1] == "megatron"
if FIRST:
{megatron_imports}
    import megatron.core.tensor_parallel.random as random_module
    import megatron.core.utils as utils_module
    stale = {{"_get_cuda_rng_state": random_module._get_cuda_rng_state,
              "_set_cuda_rng_state": random_module._set_cuda_rng_state,
              "is_te_min_version": utils_module.is_te_min_version}}
import devshim_core.auto  # noqa
{megatron_imports_flat}
import devshim_core
info = devshim_core.active_session().as_dict()
left, replaced = [], []
if FIRST:
    homes = {{"_get_cuda_rng_state": random_module, "_set_cuda_rng_state": random_module,
             "is_te_min_version": utils_module}}
    replaced = sorted(name for name, old in stale.items() if getattr(homes[name], name) is not old)
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and module is not None:
            left += [f"{{name}}.{{attr}}" for attr, value in vars(module).items()
                     if any(value is old for old in stale.values())]
print("PROBE " + json.dumps({{
    "megatron": info["integrations"].get("megatron"),
    "patches": sorted(f"{{p['set']}}:{{p['name']}}:{{p['target']}}" for p in info["patches"]
                      if p["set"].startswith("megatron")),
    "stale_references": left,
    "replaced": replaced,
}}))
"""


def run(code: str, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVSHIM_")}
    env.update(DEVSHIM_PLUGIN="cpu_reference", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("PROBE "))
    return json.loads(line[len("PROBE "):])


def test_megatron_imported_before_devshim_gets_the_same_patches_and_no_stale_reference():
    code = PROBE.format(megatron_imports=textwrap.indent(MEGATRON_IMPORTS, "    "),
                        megatron_imports_flat=MEGATRON_IMPORTS)
    after, before = run(code, "devshim"), run(code, "megatron")
    assert after["megatron"].startswith("applied"), after
    assert before["megatron"] == "applied (megatron was imported first: import-time references were rebound)"
    assert len(after["patches"]) >= 20, after["patches"]
    assert before["patches"] == after["patches"]
    # the three functions were replaced, and every module-level copy of them (`from x import f`) follows
    assert before["replaced"] == ["_get_cuda_rng_state", "_set_cuda_rng_state", "is_te_min_version"]
    assert before["stale_references"] == []


def test_every_cuda_only_extension_is_blocked_with_its_reason_and_the_provided_ones_import():
    code = textwrap.dedent(f"""
        import importlib, json
        import devshim_core.auto  # noqa
        blocked = {{}}
        for name in {sorted(BLOCKED)!r}:
            try:
                importlib.import_module(name)
                blocked[name] = "imported"
            except ImportError as error:
                blocked[name] = str(error)
        wgrad = importlib.import_module("fused_weight_gradient_mlp_cuda")
        invariant = importlib.import_module({BATCH_INVARIANT!r})
        try:
            invariant.enable_batch_invariant_mode()
            refused = ""
        except Exception as error:
            refused = f"{{type(error).__name__}}: {{error}}"
        print("PROBE " + json.dumps({{"blocked": blocked,
                                      "wgrad": sorted(n for n in vars(wgrad) if n.startswith("wgrad_gemm")),
                                      "invariant_enabled": invariant.is_batch_invariant_mode_enabled(),
                                      "refused": refused}}))
    """)
    probe = run(code)
    for name, why in BLOCKED.items():
        if name in softmax_modules.MODULE_NAMES:  # provided on cpu_reference's masked_softmax (blocked without one)
            assert probe["blocked"][name] == "imported", name
        else:
            assert probe["blocked"][name] == f"No module named '{name}' ({why})", name
    assert probe["wgrad"] == ["wgrad_gemm_accum_fp16", "wgrad_gemm_accum_fp32"]
    assert probe["invariant_enabled"] is False
    assert probe["refused"].startswith("ConfigError: --batch-invariant-mode needs megatron-core's triton kernels")


def test_a_megatron_deepspeed_style_fork_gets_no_megatron_core_patches_and_compression_fails_only_when_called(
        tmp_path):
    """A test double of Megatron-DeepSpeed's layout: a regular ``megatron`` package with its own ``megatron/core``
    (package_info 0.2.0) beside a ``training.py`` module, first on the path, as its checkout is."""
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    for name in ("__init__.py", "training.py", "core/__init__.py"):
        (tmp_path / "megatron" / name).write_text("")
    (tmp_path / "megatron" / "core" / "package_info.py").write_text('__version__ = "0.2.0"\n')
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import json
        import devshim_core.auto  # noqa
        import megatron.core, megatron.training
        import devshim_core
        info = devshim_core.active_session().as_dict()
        from deepspeed.compression.compress import init_compression, redundancy_clean  # imported, never called
        try:
            init_compression(None, None)
            called = "returned"
        except Exception as error:
            called = f"{{type(error).__name__}}: {{error}}"
        print("PROBE " + json.dumps({{"megatron": info["integrations"].get("megatron"),
                                      "core": megatron.core.__file__,
                                      "sets": sorted({{p["set"] for p in info["patches"]
                                                      if p["set"].startswith("megatron")}}),
                                      "called": called}}))
    """)
    probe = run(code)
    assert probe["core"].startswith(str(tmp_path))  # the fork's megatron.core, not the installed one
    assert probe["megatron"].startswith("Megatron-DeepSpeed recognised: its megatron.core fork gets no megatron-core "
                                        "patches"), probe
    assert probe["sets"] == ["megatron-extension-modules"], probe  # only the CUDA-only imports are answered
    assert probe["called"].startswith('ConfigError: compression training ("compression_training" in the DeepSpeed '
                                      'config) was removed in DeepSpeed 0.19'), probe
