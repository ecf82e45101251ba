"""Spec: the CUDA-only modules devshim blocks for Megatron (apex, transformer_engine, flash_attn, the fused-softmax
extensions, ...) fail to import with devshim's reason, but a probe (``importlib.util.find_spec``, as transformers
checks what is installed) answers None, as it does for any module that is not there, so that transformers works.

Each case runs in a fresh interpreter (``import devshim_core.auto`` is process-wide) with megatron-core installed,
so devshim's ``megatron-extension-modules`` set is applied. Decided for a blocked module that IS installed: a probe
finds it on disk (the later finders answer for it), and importing it still raises with the reason, without
running any of its code; with distribution metadata, as pip installs it, transformers then runs on its own
attention and names the reason only when asked for flash-attention.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from e2e.platforms import ASCEND, CPU, Platform, build_emulator  # pytest puts tests/ (no __init__.py) on sys.path

from devshim_core.cuda_check.rules import PROVIDED
from devshim_core.integrations.megatron.extension_modules import BLOCKED

# the fused-softmax extensions are in the blocker's table for plugins without a masked_softmax kernel; cpu_reference
# has one, so they are provided there (and probed below as provided)
ONLY_BLOCKED = sorted(set(BLOCKED) - set(PROVIDED))

pytest.importorskip("megatron.core", reason="the blocked modules are the Megatron integration's: megatron extra")
pytest.importorskip("transformers", reason="transformers is in requirements-dev.txt")

EXTENSION_SET = "megatron-extension-modules"


def run(code: str, platform: Platform = CPU, path: Path | None = None) -> dict:
    """Run ``code`` in a fresh interpreter on ``platform``; it prints one ``PROBE <json>`` line."""
    if platform.emulated:
        build_emulator()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVSHIM_")}
    env.update(platform.job_env({"DEVSHIM_PLUGIN": platform.plugin, "PYTHONWARNINGS": "ignore",
                                 "OMP_NUM_THREADS": "1"}))
    prelude = "import sys\n" + (f"sys.path.insert(0, {str(path)!r})\n" if path else "")
    done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("PROBE "))
    return json.loads(line[len("PROBE "):])


def not_installed(name: str) -> str:
    return f"No module named '{name}' ({BLOCKED[name]})"


# -- not installed: probes answer None, imports raise with the reason ----------------------------------------------

PROBES_AND_IMPORTS = f"""
import importlib, importlib.util, json, pkgutil, threading, warnings
import devshim_core.auto  # noqa
import devshim_core

def raised(call):
    try:
        call()
    except ModuleNotFoundError as error:
        return [str(error), error.name]
    except BaseException as error:  # anything else is wrong: reported as such
        return [f"{{type(error).__name__}}: {{error}}", None]
    return "no error"

def statement(text):
    return lambda: exec(text, {{}})

result = {{"applied": [p["set"] for p in devshim_core.active_session().as_dict()["patches"]]}}
for name in {[*sorted(PROVIDED), "grouped_gemm"]!r}:
    spec = importlib.util.find_spec(name)  # raised ValueError ("__spec__ is None") for a bare stand-in module
    result["provided " + name] = [spec is not None and spec.name == name, raised(statement(f"import {{name}}"))]
for name in {ONLY_BLOCKED!r}:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # pkgutil.find_loader: deprecated in 3.12
        find_loader = pkgutil.find_loader(name) if hasattr(pkgutil, "find_loader") else None
    result[name] = {{
        "find_spec": repr(importlib.util.find_spec(name)),
        "find_loader": repr(find_loader),
        # the stdlib contract: a submodule's probe imports its parent, which raises when the parent is missing
        "find_spec_of_a_submodule": raised(lambda: importlib.util.find_spec(name + ".sub")),
        "import": raised(statement(f"import {{name}}")),
        "import_submodule": raised(statement(f"import {{name}}.sub")),
        "from_import": raised(statement(f"from {{name}} import something")),
        "import_module": raised(lambda: importlib.import_module(name)),
        "dunder_import": raised(lambda: __import__(name)),
        "in_sys_modules": name in sys.modules,
    }}

# the answer depends on each thread's own stack: probes and imports of one name interleaved on 4 threads
answers = []
def worker():
    for _ in range(200):
        answers.append(importlib.util.find_spec("flash_attn") is None)
        answers.append(raised(statement("import flash_attn"))[1] == "flash_attn")
threads = [threading.Thread(target=worker) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
result["threads"] = [len(answers), answers.count(True)]
print("PROBE " + json.dumps(result))
"""


def test_a_blocked_module_is_none_to_a_probe_and_its_import_raises_with_the_reason():
    probe = run(PROBES_AND_IMPORTS)
    assert EXTENSION_SET in probe["applied"]
    for name in [*PROVIDED, "grouped_gemm"]:  # devshim's stand-ins: a probe finds each, the import works
        assert probe[f"provided {name}"] == [True, "no error"], name
    for name in ONLY_BLOCKED:
        got = probe[name]
        assert got["find_spec"] == "None", name
        assert got["find_loader"] == "None", name
        for way in ("find_spec_of_a_submodule", "import", "import_submodule", "from_import", "import_module",
                    "dunder_import"):
            assert got[way] == [not_installed(name), name], (name, way, got[way])
        assert got["in_sys_modules"] is False, name
    assert probe["threads"] == [1600, 1600]


# -- installed on disk: a probe finds it, the import still raises, and none of its code runs -----------------------

INSTALLED = """
import importlib.util, json
import devshim_core.auto  # noqa
spec = importlib.util.find_spec("flash_attn")
try:
    import flash_attn  # noqa
    error = None
except ModuleNotFoundError as caught:
    error = [str(caught), caught.name]
print("PROBE " + json.dumps({"origin": spec and spec.origin, "error": error,
                             "in_sys_modules": "flash_attn" in sys.modules}))
"""

TRANSFORMERS_BESIDE_INSTALLED = """
import json, torch
import devshim_core.auto  # noqa
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import import_utils

def llama(**attention):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False, **attention)
    return LlamaForCausalLM(config).eval()

logits = llama()(input_ids=torch.arange(8)[None]).logits
try:
    llama(attn_implementation="flash_attention_2")(input_ids=torch.arange(8)[None])
    asked = None
except ModuleNotFoundError as error:
    asked = [str(error), error.name]
print("PROBE " + json.dumps({"attention": llama().config._attn_implementation, "shape": list(logits.shape),
                             "flash_attn_2_available": import_utils.is_flash_attn_2_available(),
                             "flash_attention_2": asked, "in_sys_modules": "flash_attn" in sys.modules}))
"""


def fake_flash_attn(root: Path, metadata: bool) -> Path:
    """A ``flash_attn`` package in ``root`` whose code, if it ever ran, would leave the file EXECUTED beside it."""
    package = root / "flash_attn"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("import os\nopen(os.path.join(os.path.dirname(__file__), '..', 'EXECUTED'), "
                                         "'w').close()\n__version__ = '2.8.3'\n")
    if metadata:  # what pip leaves: transformers reads the version from it instead of importing the package
        info = root / "flash_attn-2.8.3.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flash-attn\nVersion: 2.8.3\n")
        (info / "top_level.txt").write_text("flash_attn\n")
        (info / "RECORD").write_text("flash_attn/__init__.py,,\n")
    return root


@pytest.mark.parametrize("metadata", [True, False], ids=["pip-installed", "bare-directory"])
def test_a_blocked_module_installed_on_disk_is_found_by_a_probe_and_its_import_still_raises(tmp_path, metadata):
    root = fake_flash_attn(tmp_path, metadata)
    probe = run(INSTALLED, path=root)
    assert probe["origin"] == str(root / "flash_attn" / "__init__.py")  # the probe answers what is on disk
    assert probe["error"] == [not_installed("flash_attn"), "flash_attn"]
    assert probe["in_sys_modules"] is False and not (root / "EXECUTED").exists()


def test_transformers_runs_beside_an_installed_blocked_flash_attn_and_names_the_reason_only_when_asked(tmp_path):
    # found with its metadata, as installed (the CUDA redirect answers torch.cuda.is_available() True), but
    # transformers' default attention is sdpa; asking for flash-attention imports it, which raises with the reason
    root = fake_flash_attn(tmp_path, metadata=True)
    probe = run(TRANSFORMERS_BESIDE_INSTALLED, path=root)
    assert probe["attention"] == "sdpa" and probe["shape"] == [1, 8, 64]
    assert probe["flash_attention_2"] == [not_installed("flash_attn"), "flash_attn"]
    assert probe["in_sys_modules"] is False
    assert not (root / "EXECUTED").exists()


# -- transformers: the model modules import and a tiny GPT-2 / Llama run a forward pass --------------------------

FORWARD = """
import importlib.util, json, torch
import devshim_core.auto  # noqa
from devshim_core import active_session
import transformers.models.gpt2.modeling_gpt2  # noqa: probes flash_attn and friends at import
import transformers.models.llama.modeling_llama  # noqa
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

kind = active_session().device_type
device = torch.device(kind) if kind == "cpu" else torch.device(kind, 0)
models = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                               bos_token_id=63, eos_token_id=63, use_cache=False)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=16, use_cache=False)),
}
ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
result = {"device": str(device), "flash_attn_probe": repr(importlib.util.find_spec("flash_attn"))}
for name, make in models.items():
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():
        host = model(input_ids=ids).logits
        logits = model.to(device)(input_ids=ids.to(device)).logits
    result[name] = {"device": str(logits.device), "shape": list(logits.shape),
                    "finite": bool(torch.isfinite(logits).all()),
                    "difference_from_host": (logits.cpu() - host).abs().max().item()}
print("PROBE " + json.dumps(result))
"""


@pytest.mark.parametrize("platform", [CPU, ASCEND], ids=["cpu", "npu"])
def test_transformers_gpt2_and_llama_import_and_run_a_forward_pass(platform):
    probe = run(FORWARD, platform)
    assert probe["flash_attn_probe"] == "None"
    for name in ("gpt2", "llama"):
        got = probe[name]
        assert got["device"] == platform.device_of_rank(0) and got["shape"] == [2, 10, 64], got
        assert got["finite"], name
        assert got["difference_from_host"] <= 1e-5, (name, got)  # fp32: the same kernels, on the host or emulated
