"""Spec: ``devshim check SCRIPT...`` lists every CUDA-only construct of a script with file:line:col and says, for
each, that the CUDA redirect serves it or what the user must change; the script is parsed, never run.

Exit status 0: everything runs; 1: something cannot run; 2: a path could not be checked (the others still are).
What the redirect serves comes from ``cuda_redirect.coverage``, the redirect's own tables.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
from plugin_fixtures import DEVSHIM_SCRIPT, PROJECT_DIR, clean_env, run

from devshim_core.cli import main
from devshim_core.cuda_check import Target, check_paths, rules
from devshim_core.integrations.cuda_redirect import coverage

NPU = Target(plugin="ascend", device_type="npu", backend="hccl", visible_devices_env="ASCEND_RT_VISIBLE_DEVICES")
GUIDE = PROJECT_DIR / "docs" / "cuda-scripts.md"

# DeepSpeed's getting-started tutorial, as written for CUDA
GETTING_STARTED = """\
import argparse
import deepspeed
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
torch.cuda.set_device(args.local_rank)
dist.init_process_group('nccl')
model = Net()
model.cuda()
engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
for x, y in loader:
    x = x.to(engine.local_rank)
    loss = engine(x, y.to(engine.local_rank))
    engine.backward(loss)
    engine.step()
"""

CANNOT_RUN = """\
import torch
from torch.utils.cpp_extension import CUDAExtension

graph = torch.cuda.CUDAGraph()
ext = CUDAExtension("fused", ["fused.cpp", "fused_kernel.cu"])
"""


def write(directory: Path, name: str, source: str) -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def findings(tmp_path: Path, source: str, target: Target = NPU) -> list[tuple[int, str, str, str]]:
    """(line, category, construct, message) of each finding in ``source``."""
    result = check_paths([str(write(tmp_path, "script.py", source))], target)
    assert not result.errors
    return [(f.line, f.category, f.construct, f.message) for f in result.findings]


def only(tmp_path: Path, source: str, target: Target = NPU) -> tuple[str, str, str]:
    """The one finding of ``source``: (category, construct, message)."""
    found = findings(tmp_path, source, target)
    assert len(found) == 1, found
    return found[0][1:]


# -- whole scripts ----------------------------------------------------------------------------------


def test_a_cuda_written_deepspeed_script_runs_entirely_through_the_redirect(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DEVSHIM_PLUGIN", "cpu_reference")
    script = write(tmp_path, "train.py", GETTING_STARTED)
    assert main(["check", str(script)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("redirect target: cpu (plugin cpu_reference)\nCUDA redirect: on")
    lines = [line for line in out.splitlines() if line.startswith(str(script))]
    assert [line.split(": ")[1] for line in lines] == ["redirected"] * 5
    assert [line.split(":")[1] for line in lines] == ["9", "10", "12", "15", "16"]
    assert f"{script}:9:1: redirected: torch.cuda.set_device -- answered by cpu's device module" in lines
    assert f"{script}:10:25: redirected: dist.init_process_group('nccl') -- backend 'nccl' becomes 'gloo' on cpu" \
        in lines
    assert "model.cuda()" in lines[2] and ".to(engine.local_rank)" in lines[3]
    assert out.rstrip().endswith("1 file scanned: 5 redirected, 0 provided, 0 review, 0 unsupported -- can run "
                                 "through devshim")


def test_cuda_graphs_and_a_cuda_extension_cannot_run_and_say_where(tmp_path, capsys):
    script = write(tmp_path, "graphs.py", CANNOT_RUN)
    assert main(["check", str(script)]) == 1
    out = capsys.readouterr().out
    assert f"{script}:4:9: unsupported: torch.cuda.CUDAGraph -- {coverage.UNSERVED_CUDA['CUDAGraph']}" in out
    assert f"{script}:5:7: unsupported: torch.utils.cpp_extension.CUDAExtension -- builds CUDA sources" in out
    assert "cannot run until the unsupported constructs are changed" in out


def test_the_script_is_parsed_never_imported(tmp_path, capsys):
    witness = tmp_path / "imported"
    script = write(tmp_path, "explodes.py", f"""\
        import pathlib
        pathlib.Path({str(witness)!r}).write_text("ran")
        raise SystemExit("imported!")
        import torch
        torch.cuda.synchronize()
        """)
    assert main(["check", str(script)]) == 0
    assert not witness.exists()
    assert f"{script}:5:1: redirected: torch.cuda.synchronize" in capsys.readouterr().out


def test_comments_docstrings_and_messages_are_not_reported(tmp_path):
    assert findings(tmp_path, '''\
        """Runs on 'cuda' with torch.cuda.CUDAGraph and import flash_attn."""
        import torch

        def step():
            """cuda"""
            # torch.cuda.CUDAGraph() and x.cuda() and 'cuda'
            print("moving the model to cuda")
            return "nccl is fast"  # device='cuda'
        ''') == []


# -- categories -------------------------------------------------------------------------------------

REDIRECTED = {
    "torch.cuda.manual_seed(1)": "torch.cuda.manual_seed",
    "x.cuda()": "x.cuda()",
    "model.cuda(non_blocking=True)": "model.cuda()",
    "x.to('cuda')": "x.to('cuda')",
    "x.to(local_rank)": ".to(local_rank)",
    "x.to(0)": ".to(0)",
    "torch.zeros(2, device='cuda')": "torch.zeros(..., device='cuda')",
    "torch.ones(2, device='cuda:1')": "torch.ones(..., device='cuda:1')",
    "torch.empty(2, device=args.local_rank)": "torch.empty(..., device=args.local_rank)",
    "make(device='cuda')": "make(device='cuda')",
    "torch.device('cuda', i)": "torch.device('cuda', ...)",
    "d = f'cuda:{rank}'": "f'cuda:{rank}'",
    "d = 'cuda:' + str(rank)": "'cuda:' + str(rank)",
    "device = 'cuda'": "'cuda'",
    "t = torch.cuda.FloatTensor(3)": "torch.cuda.FloatTensor",
    "x.type('torch.cuda.HalfTensor')": "x.type('torch.cuda.HalfTensor')",
    "with torch.cuda.amp.autocast(): pass": "torch.cuda.amp.autocast",
    "scaler = torch.cuda.amp.GradScaler()": "torch.cuda.amp.GradScaler",
    "with torch.autocast('cuda'): pass": "torch.autocast('cuda')",
    "with torch.amp.autocast(device_type='cuda'): pass": "torch.amp.autocast(device_type='cuda')",
    "scaler = torch.amp.GradScaler('cuda')": "torch.amp.GradScaler('cuda')",
    "torch.distributed.init_process_group(backend='nccl')": "torch.distributed.init_process_group(backend='nccl')",
    "torch.distributed.new_group(ranks, backend='nccl')": "torch.distributed.new_group(..., backend='nccl')",
    "torch.distributed.init_process_group(torch.distributed.Backend.NCCL)": "torch.distributed.Backend.NCCL",
    "torch.cuda.nvtx.range_push('fwd')": "torch.cuda.nvtx.range_push",
    "torch.cuda.get_device_properties(0).total_memory": "torch.cuda.get_device_properties",
    "state = torch.cuda.random.get_rng_state()": "torch.cuda.random.get_rng_state",
}


@pytest.mark.parametrize("line", REDIRECTED)
def test_served_by_the_redirect(tmp_path, line):
    category, construct, message = only(tmp_path, f"import torch\n{line}\n")
    assert (category, construct) == ("redirected", REDIRECTED[line])
    assert "npu" in message or "profiler" in message


@pytest.mark.parametrize("module", sorted(rules.PROVIDED_BY_MEGATRON_INTEGRATION))
def test_cuda_extensions_the_megatron_integration_provides(tmp_path, module):
    assert only(tmp_path, f"import {module}\n") == ("provided", f"import {module}", rules.PROVIDED_MESSAGE)


def test_a_provided_name_is_reported_at_its_import_not_at_every_use(tmp_path):
    assert findings(tmp_path, """\
        from apex.normalization.fused_layer_norm import FusedRMSNorm
        import fused_layer_norm_cuda as fln
        norm = FusedRMSNorm(64)
        fln.forward(x)
        """) == [(1, "provided", "import apex.normalization.fused_layer_norm", rules.PROVIDED_MESSAGE),
                 (2, "provided", "import fused_layer_norm_cuda", rules.PROVIDED_MESSAGE)]


REVIEW = {
    "if x.is_cuda: pass": ("x.is_cuda", ".is_cuda is False for tensors on npu"),
    "if x.device.type == 'cuda': pass": ("x.device.type == 'cuda'", "do not report this CUDA name"),
    "if device == 'cuda': pass": ("device == 'cuda'", "(npu, 'hccl')"),
    "if 'cuda' in str(device): pass": ("'cuda' in str(device)", "check which branch runs"),
    "if dist.get_backend() == 'nccl': pass": ("dist.get_backend() == 'nccl'", "check which branch runs"),
    "torch.backends.cudnn.benchmark = True": ("torch.backends.cudnn.benchmark", "no effect off CUDA"),
    "torch.backends.cuda.matmul.allow_tf32 = True": ("torch.backends.cuda.matmul.allow_tf32", "no effect off CUDA"),
    "os.environ['CUDA_VISIBLE_DEVICES'] = '0'": ("os.environ['CUDA_VISIBLE_DEVICES']",
                                                 "does not restrict npu; use ASCEND_RT_VISIBLE_DEVICES"),
    "os.environ.get('NCCL_DEBUG')": ("os.environ.get('NCCL_DEBUG')", "NCCL variables do not steer 'hccl'"),
    "os.environ['CUDA_DEVICE_MAX_CONNECTIONS'] = '1'": ("os.environ['CUDA_DEVICE_MAX_CONNECTIONS']",
                                                        "no effect on npu"),
    "torch.cuda.caching_allocator_alloc(8)": ("torch.cuda.caching_allocator_alloc",
                                              "torch.cuda.caching_allocator_alloc is not redirected; check"),
    "if torch.version.cuda: pass": ("torch.version.cuda", "None without a CUDA build"),
}


@pytest.mark.parametrize("line", REVIEW)
def test_runs_but_answers_differently_so_the_user_should_look(tmp_path, line):
    source = f"import os\nimport torch\nimport torch.distributed as dist\n{line}\n"
    category, construct, message = only(tmp_path, source)
    assert (category, construct) == ("review", REVIEW[line][0])
    assert REVIEW[line][1] in message


def test_without_a_selectable_plugin_the_visible_devices_advice_names_an_example(tmp_path):
    _, _, message = only(tmp_path, "import os\nos.environ['CUDA_VISIBLE_DEVICES'] = '0'\n", Target(reason="none"))
    assert message == ("CUDA_VISIBLE_DEVICES does not restrict the selected device; use the plugin's "
                       "visible-devices variable (ASCEND_RT_VISIBLE_DEVICES for ascend)")


UNSUPPORTED_IMPORTS = {
    "import transformer_engine.pytorch as te": "import transformer_engine.pytorch",
    "from flash_attn import flash_attn_func": "import flash_attn",
    "import triton.language as tl": "import triton.language",
    "import cupy": "import cupy",
    "import pynvml": "import pynvml",
    "from apex import amp": "import apex.amp",
    "from apex.parallel import DistributedDataParallel": "import apex.parallel",
    "from apex.contrib.optimizers import distributed_fused_adam": "import apex.contrib.optimizers",
    "import xformers.ops": "import xformers.ops",
    "import bitsandbytes as bnb": "import bitsandbytes",
    "from torch.cuda import jiterator": "import torch.cuda.jiterator",
    "amp_C = importlib.import_module('flash_attn')": "import flash_attn",
}


@pytest.mark.parametrize("line", UNSUPPORTED_IMPORTS)
def test_cuda_only_packages_cannot_run(tmp_path, line):
    category, construct, message = only(tmp_path, f"import importlib\n{line}\n")
    assert (category, construct) == ("unsupported", UNSUPPORTED_IMPORTS[line])
    assert "CUDA" in message or "GPU" in message or "NVIDIA" in message


def test_a_guarded_import_runs_on_its_fallback_and_is_for_review(tmp_path):
    assert findings(tmp_path, """\
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            flash_attn_func = None
        """) == [(2, "review", "import flash_attn", rules.GUARDED_IMPORT_MESSAGE.format(
                  why=rules.UNSUPPORTED_MODULES["flash_attn"]))]


@pytest.mark.parametrize("call", [
    "load('k', sources=['k.cpp', 'k_kernel.cu'])",
    "load('k', ['k.cpp', 'k_kernel.cuh'])",
    "load_inline('k', cpp_sources=cpp, cuda_sources=cu)",
    "load('k', sources=srcs, with_cuda=True)",
])
def test_building_cuda_sources_cannot_run(tmp_path, call):
    category, construct, message = only(tmp_path, f"from torch.utils.cpp_extension import load, load_inline\n{call}\n")
    assert category == "unsupported" and construct.endswith("(... CUDA sources ...)")
    assert message == rules.CUDA_EXTENSION_MESSAGE


def test_building_cpp_only_extensions_is_not_reported(tmp_path):
    assert findings(tmp_path, """\
        from torch.utils.cpp_extension import CppExtension, load
        load('k', sources=['k.cpp'])
        CppExtension('k', ['k.cpp'])
        """) == []


# -- the redirect's own tables ----------------------------------------------------------------------


def test_every_unserved_cuda_name_cannot_run_with_the_redirects_message(tmp_path):
    source = "import torch\n" + "".join(f"torch.cuda.{name}\n" for name in coverage.UNSERVED_CUDA)
    assert findings(tmp_path, source) == [(n, "unsupported", f"torch.cuda.{name}", message)
                                          for n, (name, message) in enumerate(coverage.UNSERVED_CUDA.items(), 2)]


def test_every_name_the_redirect_serves_is_redirected(tmp_path):
    names = [*coverage.DEVICE_FUNCTIONS, *coverage.INTERNALS, *coverage.TENSOR_TYPES,
             *(f"amp.{n}" for n in coverage.AMP_NAMES), *(f"nvtx.{n}" for n in coverage.NVTX_FUNCTIONS)]
    found = findings(tmp_path, "import torch\n" + "".join(f"torch.cuda.{name}()\n" for name in names))
    assert [(f[1], f[2]) for f in found] == [("redirected", f"torch.cuda.{name}") for name in names]


# -- names resolved through imports -----------------------------------------------------------------

ALIASES = {
    "import torch as th\nth.cuda.synchronize()": ("redirected", "torch.cuda.synchronize"),
    "from torch import cuda\ncuda.manual_seed_all(0)": ("redirected", "torch.cuda.manual_seed_all"),
    "from torch.cuda import FloatTensor\nFloatTensor(3)": ("redirected", "torch.cuda.FloatTensor"),
    "from torch.cuda.amp import autocast\nwith autocast(): pass": ("redirected", "torch.cuda.amp.autocast"),
    "import torch.distributed as dist\ndist.new_group(backend='nccl')": ("redirected",
                                                                       "dist.new_group(backend='nccl')"),
    "from torch.cuda import CUDAGraph as Graph\nGraph()": ("unsupported", "torch.cuda.CUDAGraph"),
    "import torch.cuda\ntorch.cuda.make_graphed_callables(m, x)": ("unsupported", "torch.cuda.make_graphed_callables"),
    "from torch.backends import cudnn\ncudnn.deterministic = True": ("review", "torch.backends.cudnn.deterministic"),
    "import apex\napex.amp.initialize(model)": ("unsupported", "apex.amp.initialize"),
}


@pytest.mark.parametrize("source", ALIASES)
def test_names_are_resolved_through_the_scripts_imports(tmp_path, source):
    assert only(tmp_path, source)[:2] == ALIASES[source]


def test_names_that_merely_look_like_torch_are_not_reported(tmp_path):
    assert findings(tmp_path, """\
        import mylib as torch_utils
        cuda = object()
        cuda.synchronize()
        torch_utils.cuda.CUDAGraph()
        x.to(dtype)
        """) == []


def test_columns_count_characters_not_bytes(tmp_path):
    result = check_paths([str(write(tmp_path, "u.py", "import torch\nname = 'ü'; torch.cuda.synchronize()\n"))], NPU)
    assert (result.findings[0].line, result.findings[0].col) == (2, 13)


# -- paths, errors and output -----------------------------------------------------------------------


def test_a_directory_is_scanned_recursively_for_python_files(tmp_path, capsys):
    write(tmp_path, "proj/train.py", "import torch\ntorch.cuda.synchronize()\n")
    write(tmp_path, "proj/model/layers.py", "import flash_attn\n")
    write(tmp_path, "proj/notes.txt", "torch.cuda.CUDAGraph()\n")
    write(tmp_path, "proj/.venv/lib/site.py", "import flash_attn\n")
    assert main(["check", str(tmp_path / "proj")]) == 1
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines()[2:-1]] == [
        str(tmp_path / "proj/model/layers.py"), str(tmp_path / "proj/train.py")]
    assert out.splitlines()[-1].startswith("2 files scanned: 1 redirected, 0 provided, 0 review, 1 unsupported")


def test_an_unparsable_or_missing_file_is_a_usage_error_and_the_others_are_still_scanned(tmp_path, capsys):
    broken = write(tmp_path, "broken.py", "def f(:\n    pass\n")
    good = write(tmp_path, "good.py", CANNOT_RUN)
    missing = tmp_path / "missing.py"
    assert main(["check", str(broken), str(missing), str(good)]) == 2
    captured = capsys.readouterr()
    assert f"{good}:4:9: unsupported: torch.cuda.CUDAGraph" in captured.out
    assert captured.err.splitlines() == [f"devshim check: {broken}:1:7: cannot parse: invalid syntax",
                                         f"devshim check: {missing}: no such file or directory"]


def test_json_lists_the_findings(tmp_path, capsys):
    script = write(tmp_path, "graphs.py", CANNOT_RUN)
    assert main(["check", "--json", str(script)]) == 1
    assert json.loads(capsys.readouterr().out) == [
        {"path": str(script), "line": 4, "col": 9, "category": "unsupported", "construct": "torch.cuda.CUDAGraph",
         "message": coverage.UNSERVED_CUDA["CUDAGraph"]},
        {"path": str(script), "line": 5, "col": 7, "category": "unsupported",
         "construct": "torch.utils.cpp_extension.CUDAExtension", "message": rules.CUDA_EXTENSION_MESSAGE},
    ]


def test_turning_the_redirect_off_makes_what_it_serves_unsupported(tmp_path, capsys, monkeypatch):
    script = write(tmp_path, "train.py", GETTING_STARTED)
    monkeypatch.setenv("DEVSHIM_REDIRECT_CUDA", "0")
    assert main(["check", "--json", str(script)]) == 1
    found = json.loads(capsys.readouterr().out)
    assert len(found) == 5
    assert {(f["category"], f["message"]) for f in found} == {
        ("unsupported", "DEVSHIM_REDIRECT_CUDA=0 turns the redirect off")}
    assert main(["check", str(script)]) == 1
    assert "CUDA redirect: OFF" in capsys.readouterr().out


def test_a_redirect_switch_that_is_not_a_boolean_is_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DEVSHIM_REDIRECT_CUDA", "maybe")
    assert main(["check", str(write(tmp_path, "t.py", GETTING_STARTED))]) == 2
    assert "DEVSHIM_REDIRECT_CUDA='maybe' is not a boolean" in capsys.readouterr().err


def test_without_a_selectable_plugin_the_script_is_still_scanned(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DEVSHIM_PLUGIN", "nvidia")
    assert main(["check", str(write(tmp_path, "t.py", GETTING_STARTED))]) == 0
    out = capsys.readouterr().out
    assert out.startswith("redirect target: unknown (DEVSHIM_PLUGIN names 'nvidia', which is not an installed")
    assert "answered by the selected device's device module" in out


def test_the_guides_example_is_what_the_installed_command_prints(tmp_path):
    """docs/cuda-scripts.md shows a script and the output of `devshim check` on it; they must not drift."""
    guide = GUIDE.read_text()
    script = re.search(r"```python\n(.*?)```", guide, re.S).group(1)  # the first python block: the example
    command, output = re.search(r"```\n\$ (DEVSHIM_EMULATE=ascend devshim check train\.py)\n(.*?)```", guide,
                                re.S).groups()
    write(tmp_path, "train.py", script)
    result = run([DEVSHIM_SCRIPT, "check", "train.py"], clean_env(DEVSHIM_EMULATE="ascend"), cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stdout == output, command
