"""Spec: ``devshim check SCRIPT...`` lists every CUDA-only construct of a script with file:line:col and says, for
each, that the CUDA redirect serves it or what the user must change; the script is parsed, never run.

What the user sees must be what happens when the script runs under devshim: an import of a module devshim blocks
raises (unsupported) unless an except clause takes a fallback (blocked), and a guard whose except clause re-raises is
no guard; a module devshim provides imports (provided). The specs below run such scripts under ``import
devshim_core.auto`` and compare. A finding on code behind a flag carries the flag's condition ("if reached");
``--only problems`` prints only the review and unsupported findings.

Exit status 0: everything runs; 1: something cannot run; 2: a path could not be checked (the others still are).
What the redirect serves comes from ``cuda_redirect.coverage``, the redirect's own tables; what devshim blocks from
``megatron.extension_modules.BLOCKED``, the blocker's own table. The third-party scripts of docs/cuda-scripts.md are
checked against the counts recorded there when their checkouts are named (DEEPSPEED_EXAMPLES_PATH,
MEGATRON_LM_PATH, MEGATRON_DEEPSPEED_PATH; skipped otherwise).
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest
from plugin_fixtures import DEVSHIM_SCRIPT, PROJECT_DIR, PYTHON, clean_env, run

from devshim_core.cli import main
from devshim_core.cuda_check import Target, check_paths, find_target, rules
from devshim_core.integrations.cuda_redirect import coverage
from devshim_core.integrations.megatron import extension_modules

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
    assert out.rstrip().endswith("1 file scanned: 5 redirected, 0 provided, 0 blocked, 0 review, 0 unsupported "
                                 "-- can run through devshim")


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
    "d = 'cuda:{}'.format(args.gpu)": "'cuda:{}'.format(args.gpu)",
    "torch.device('cuda:{}'.format(args.gpu))": "torch.device('cuda:{}'.format(args.gpu))",
}


@pytest.mark.parametrize("line", REDIRECTED)
def test_served_by_the_redirect(tmp_path, line):
    category, construct, message = only(tmp_path, f"import torch\n{line}\n")
    assert (category, construct) == ("redirected", REDIRECTED[line])
    assert "npu" in message or "profiler" in message


def test_a_module_devshim_provides_imports(tmp_path):
    assert only(tmp_path, "import fused_weight_gradient_mlp_cuda\n") == (
        "provided", "import fused_weight_gradient_mlp_cuda", rules.PROVIDED["fused_weight_gradient_mlp_cuda"])


# torch.load's map_location naming CUDA: the redirect's torch.load puts the tensors on the selected device (before
# issue 28 it raised TypeError under devshim, and devshim check called it redirected all the same)
MAP_LOCATION = {
    "torch.load(f, map_location='cuda')": "torch.load(..., map_location='cuda')",
    "torch.load(f, map_location='cuda:{}'.format(rank))": "torch.load(..., map_location='cuda:{}'.format(rank))",
    "torch.load(f, map_location=f'cuda:{rank}')": "torch.load(..., map_location=f'cuda:{rank}')",
    "torch.load(f, 'cuda:0')": "torch.load(..., 'cuda:0')",
    "torch.load(f, map_location={'cuda:1': 'cuda:0'})": "torch.load(..., map_location={'cuda:1': 'cuda:0'})",
}


@pytest.mark.parametrize("line", MAP_LOCATION)
def test_a_checkpoint_mapped_to_cuda_loads_on_the_device(tmp_path, line):
    assert only(tmp_path, f"import torch\n{line}\n") == ("redirected", MAP_LOCATION[line],
                                                         "torch.load puts the checkpoint's tensors on npu")


# the fused-softmax extensions are in the blocker's table for plugins without a masked_softmax kernel; devshim check
# reports what a plugin with one gets (all of devshim's own have one): provided
ONLY_BLOCKED = set(extension_modules.BLOCKED) - set(rules.PROVIDED)


@pytest.mark.parametrize("module", sorted(ONLY_BLOCKED))
def test_an_unguarded_import_of_a_module_devshim_blocks_cannot_run(tmp_path, module):
    category, construct, message = only(tmp_path, f"import {module}\n")
    assert (category, construct) == ("unsupported", f"import {module}")
    assert message.startswith(f"devshim blocks {module} off CUDA, so this import raises ModuleNotFoundError; ")


@pytest.mark.parametrize("module", sorted(ONLY_BLOCKED))
def test_a_guarded_import_of_a_module_devshim_blocks_takes_its_fallback(tmp_path, module):
    assert findings(tmp_path, f"""\
        try:
            import {module}
        except ImportError:
            {module} = None
        """) == [(2, "blocked", f"import {module}", rules.BLOCKED_FALLBACK_MESSAGE.format(top=module, line=3))]


def test_without_megatron_devshim_neither_provides_nor_blocks(tmp_path):
    """devshim's Megatron integration installs nothing where Megatron is not importable: a CUDA build of apex installed
    there imports, and fails when called; so a guarded import is for review, as for any CUDA-only package."""
    no_megatron = Target(plugin="ascend", device_type="npu", backend="hccl", megatron=False)
    assert findings(tmp_path, """\
        import fused_weight_gradient_mlp_cuda
        from apex.normalization import FusedLayerNorm
        try:
            import amp_C
        except ImportError:
            amp_C = None
        """, no_megatron) == [
        (1, "unsupported", "import fused_weight_gradient_mlp_cuda",
         rules.NOT_PROVIDED_MESSAGE.format(module="fused_weight_gradient_mlp_cuda")),
        (2, "unsupported", "import apex.normalization", rules.ADVICE["apex.normalization"]),
        (4, "review", "import amp_C", rules.GUARDED_IMPORT_MESSAGE.format(why=rules.ADVICE["amp_C"]))]


def test_the_target_says_whether_megatron_is_importable_without_importing_it():
    pytest.importorskip("megatron.core", reason="the test environment's megatron-core is the one to find")
    modules = set(sys.modules)
    assert find_target({}).megatron is True
    assert not any(name == "megatron" or name.startswith("megatron.") for name in set(sys.modules) - modules)


@pytest.mark.parametrize("switch", ["DEVSHIM_PATCH_MEGATRON=0", "DEVSHIM_DISABLE=megatron",
                                    "DEVSHIM_DISABLE=megatron-extension-modules", "DEVSHIM_REDIRECT_CUDA=0"])
def test_with_the_megatron_integration_switched_off_devshim_neither_provides_nor_blocks(switch):
    """The Megatron integration needs the redirect; either off, nothing is provided or blocked."""
    name, _, value = switch.partition("=")
    assert find_target({name: value}).megatron is False


def test_apex_is_blocked_whole_and_each_part_says_what_to_use_instead(tmp_path):
    assert findings(tmp_path, """\
        from apex.normalization import FusedLayerNorm
        from apex.multi_tensor_apply import multi_tensor_applier
        import apex
        """) == [
        (1, "unsupported", "import apex.normalization",
         "devshim blocks apex off CUDA, so this import raises ModuleNotFoundError; apex's fused norms are CUDA-only; "
         "use torch.nn.LayerNorm or torch.nn.RMSNorm"),
        (2, "unsupported", "import apex.multi_tensor_apply",
         "devshim blocks apex off CUDA, so this import raises ModuleNotFoundError; apex's multi_tensor_applier is "
         "CUDA-only; use torch's _foreach_* ops"),
        (3, "unsupported", "import apex", "devshim blocks apex off CUDA, so this import raises ModuleNotFoundError; "
         "apex's kernels are CUDA-only; use the torch equivalents")]


def test_a_reported_import_is_not_reported_again_at_every_use(tmp_path):
    assert findings(tmp_path, """\
        from apex.normalization.fused_layer_norm import FusedRMSNorm
        import fused_weight_gradient_mlp_cuda as wgrad
        norm = FusedRMSNorm(64)
        wgrad.wgrad_gemm_accum_fp32(x, g, main_grad)
        """) == [(1, "unsupported", "import apex.normalization.fused_layer_norm",
                  rules.BLOCKED_IMPORT_MESSAGE.format(top="apex", reraised="",
                                                      advice=rules.ADVICE["apex.normalization"])),
                 (2, "provided", "import fused_weight_gradient_mlp_cuda",
                  rules.PROVIDED["fused_weight_gradient_mlp_cuda"])]


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
    "torch.cuda.list_gpu_processes()": ("torch.cuda.list_gpu_processes",
                                        "torch.cuda.list_gpu_processes is not redirected; check"),
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


def test_a_guarded_import_of_another_cuda_only_package_is_for_review(tmp_path):
    """devshim does not block triton: where it is installed the import succeeds and its CUDA-only code runs."""
    assert findings(tmp_path, """\
        try:
            import triton
        except ImportError:
            triton = None
        """) == [(2, "review", "import triton", rules.GUARDED_IMPORT_MESSAGE.format(why=rules.ADVICE["triton"]))]


NO_FALLBACK = {
    "raise": "raise RuntimeError('this model needs flash-attn')",
    "bare raise": "raise",
    "sys.exit": "sys.exit('install flash-attn')",
    "exit": "exit(1)",
    "message, then raise": "print('flash-attn is missing'); raise",
}


@pytest.mark.parametrize("handler", NO_FALLBACK)
def test_a_guard_whose_except_clause_reraises_or_exits_cannot_run(tmp_path, handler):
    assert findings(tmp_path, f"""\
        import sys
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            {NO_FALLBACK[handler]}
        """) == [(3, "unsupported", "import flash_attn", rules.BLOCKED_IMPORT_MESSAGE.format(
                  top="flash_attn", reraised=rules.BLOCKED_RERAISED.format(line=4),
                  advice=rules.ADVICE["flash_attn"]))]


def test_a_package_devshim_does_not_block_with_a_reraising_guard_cannot_run(tmp_path):
    """Megatron-LM's ssm/triton_cache_manager.py: the import error is re-raised with a message of its own."""
    assert findings(tmp_path, """\
        try:
            from triton.runtime.cache import FileCacheManager
        except ImportError:
            raise ImportError("triton is required by the Mamba model but cannot be imported")
        """) == [(2, "unsupported", "import triton.runtime.cache",
                  rules.RERAISED_MESSAGE.format(advice=rules.ADVICE["triton"], line=3))]


def test_a_raise_the_except_clause_only_sometimes_takes_is_a_fallback(tmp_path):
    category, construct, _ = only(tmp_path, """\
        try:
            import amp_C
        except ImportError:
            if strict:
                raise
            amp_C = None
        """)
    assert (category, construct) == ("blocked", "import amp_C")


def test_the_first_except_clause_that_catches_the_import_error_decides(tmp_path):
    assert only(tmp_path, """\
        try:
            import amp_C
        except ModuleNotFoundError:
            amp_C = None
        except ImportError:
            raise
        """)[0] == "blocked"
    assert only(tmp_path, """\
        try:
            import amp_C
        except ValueError:
            amp_C = None
        """)[0] == "unsupported"


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
    "import apex\napex.amp.initialize(model)": ("unsupported", "import apex"),
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


# -- code behind a flag -----------------------------------------------------------------------------

BEHIND_A_FLAG = {
    "if args.use_flash_attn:\n    import flash_attn": "args.use_flash_attn",
    "if not args.no_apex:\n    pass\nelse:\n    import flash_attn": "args.no_apex",
    "if args.local_rank == -1:\n    pass\nelse:\n    import flash_attn": "args.local_rank != -1",
    "if args.gpu is None:\n    pass\nelif args.fast:\n    import flash_attn": "args.gpu is not None and args.fast",
    "if config.get('flash'):\n    import flash_attn": "config.get('flash')",
    "if os.environ.get('USE_FLASH'):\n    import flash_attn": "os.environ.get('USE_FLASH')",
    "if 'USE_FLASH' in os.environ:\n    import flash_attn": "'USE_FLASH' in os.environ",
    "if HAVE_FLASH:\n    import flash_attn": "HAVE_FLASH",
    "if get_args().flash or args.fast:\n    import flash_attn": "(get_args().flash or args.fast)",
    "if get_accelerator().device_name() == 'cuda':\n    import flash_attn": "get_accelerator().device_name() == 'cuda'",
    "if args.model:\n    if args.flash:\n        import flash_attn": "args.model and args.flash",
    "f = importlib.import_module('flash_attn') if args.flash else None": "args.flash",
}


@pytest.mark.parametrize("source", BEHIND_A_FLAG)
def test_a_finding_behind_a_flag_is_marked_with_its_condition(tmp_path, source):
    script = write(tmp_path, "script.py", "import importlib\nimport os\n"
                   "from deepspeed.accelerator import get_accelerator\n" + source + "\n")
    [finding] = [f for f in check_paths([str(script)], NPU).findings if f.category != "review"]  # == 'cuda' is one
    assert (finding.category, finding.construct) == ("unsupported", "import flash_attn")
    assert finding.if_reached == BEHIND_A_FLAG[source]


NOT_A_FLAG = [
    "if torch.cuda.is_available():\n    import flash_attn",
    "if TYPE_CHECKING:\n    import flash_attn",
    "if __name__ == '__main__':\n    import flash_attn",
    "if len(sys.argv) > 1 or isinstance(sys, object):\n    import flash_attn",
]


@pytest.mark.parametrize("source", NOT_A_FLAG)
def test_a_test_of_imported_names_and_constants_is_not_a_flag(tmp_path, source):
    """It answers the same in every run of the script (torch.cuda.is_available() is True through the redirect)."""
    script = write(tmp_path, "script.py", "import sys\nimport torch\nfrom typing import TYPE_CHECKING\n" + source)
    assert [f.if_reached for f in check_paths([str(script)], NPU).findings if f.category == "unsupported"] == [None]


def test_a_function_called_only_behind_a_flag_is_reached_only_under_it(tmp_path):
    """Megatron-LM's initialize.py calls _initialize_tp_communicators() only if args.tp_comm_overlap."""
    found = check_paths([str(write(tmp_path, "init.py", """\
        def _initialize_tp_communicators():
            try:
                import transformer_engine
            except ImportError:
                raise RuntimeError("tp-comm-overlap needs transformer_engine")

        def _always():
            import flash_attn

        def initialize(args):
            _always()
            if args.tp_comm_overlap:
                _initialize_tp_communicators()
                _always()

        def public_api():
            import xformers

        def _callback():
            import cupy

        register(_callback)
        if args.x:
            public_api()
            _callback()
        """))], NPU).findings
    assert [(f.line, f.if_reached) for f in found] == [
        (3, "_initialize_tp_communicators() is called only if args.tp_comm_overlap"),
        (8, None),  # also called unconditionally
        (17, None),  # public: a library module's callers are elsewhere
        (20, None),  # passed on: called from anywhere
    ]


def test_in_a_script_every_function_called_only_behind_a_flag_is_marked(tmp_path):
    found = check_paths([str(write(tmp_path, "train.py", """\
        def load(path):
            import apex.amp

        if __name__ == "__main__":
            if args.resume:
                load(args.resume)
        """))], NPU).findings
    assert [f.if_reached for f in found] == ["load() is called only if args.resume"]


def test_the_report_marks_what_runs_only_if_reached_and_the_verdict_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DEVSHIM_PLUGIN", "cpu_reference")
    script = write(tmp_path, "train.py", """\
        import torch
        if args.fp16:
            from apex import amp
        torch.cuda.synchronize()
        """)
    assert main(["check", str(script)]) == 1  # it cannot run with --fp16: the status says so
    out = capsys.readouterr().out.splitlines()
    assert out[2] == (f"{script}:3:5: unsupported (if reached: args.fp16): import apex.amp -- devshim blocks apex "
                      f"off CUDA, so this import raises ModuleNotFoundError; {rules.ADVICE['apex.amp']}")
    assert out[3].startswith(f"{script}:4:1: redirected: torch.cuda.synchronize -- ")
    assert out[-1] == ("1 file scanned: 1 redirected, 0 provided, 0 blocked, 0 review, 1 unsupported (1 if reached) "
                       "-- cannot run where the unsupported lines marked 'if reached' run: check their conditions")


# -- what needs the user ----------------------------------------------------------------------------

MIXED = """\
import torch
torch.cuda.set_device(0)
try:
    import amp_C
except ImportError:
    amp_C = None
torch.backends.cudnn.benchmark = True
graph = torch.cuda.CUDAGraph()
model.cuda()
"""


def test_only_problems_prints_what_needs_the_user_and_counts_everything(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DEVSHIM_PLUGIN", "cpu_reference")
    script = write(tmp_path, "train.py", MIXED)
    assert main(["check", "--only", "problems", str(script)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[1] for line in out[2:-1]] == ["review", "unsupported"]
    assert out[-1] == ("1 file scanned, only problems shown: 2 redirected, 0 provided, 1 blocked, 1 review, "
                       "1 unsupported -- cannot run until the unsupported constructs are changed")
    assert main(["check", "--only", "problems", "--json", str(script)]) == 1
    assert [f["line"] for f in json.loads(capsys.readouterr().out)] == [7, 8]


def test_only_one_category(tmp_path, capsys):
    script = write(tmp_path, "train.py", MIXED)
    # the status is the script's, not the view's
    assert main(["check", "--only", "blocked", "--json", str(script)]) == 1
    assert [(f["line"], f["category"]) for f in json.loads(capsys.readouterr().out)] == [(4, "blocked")]


def test_only_takes_problems_or_a_category(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["check", "--only", "errors", str(write(tmp_path, "t.py", MIXED))])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --only: invalid choice: 'errors'" in err
    assert all(choice in err for choice in ("problems", *rules.CATEGORIES))


# -- what the check says is what happens --------------------------------------------------------------

# each script: what devshim check says of it, and what it does under `import devshim_core.auto` ("ran" to its end, or
# the exception that stopped it; None: the exception is torch's own business, any will do)
SAYS_AND_DOES: dict[str, tuple[str, str | None]] = {
    **{f"import {m}": ("provided", "ran") for m in sorted(rules.PROVIDED)},
    **{f"import {m}": ("unsupported", "ModuleNotFoundError") for m in sorted(ONLY_BLOCKED)},
    **{f"try:\n    import {m}\nexcept ImportError:\n    {m} = None\nassert {m} is None": ("blocked", "ran")
       for m in sorted(ONLY_BLOCKED)},
    "from apex.normalization import FusedLayerNorm": ("unsupported", "ModuleNotFoundError"),
    "try:\n    import flash_attn\nexcept ImportError:\n    raise RuntimeError('needs flash-attn')": (
        "unsupported", "RuntimeError"),
    "import sys\ntry:\n    import amp_C\nexcept ImportError:\n    sys.exit('needs apex')": (
        "unsupported", "SystemExit"),
    "flag = False\nif flag:\n    import apex": ("unsupported (if reached)", "ran"),
    **{f"import torch\ntorch.cuda.{name}{args}": ("unsupported", None) for name, args in {
        "memory._record_memory_history": "()", "memory._snapshot": "()", "memory._dump_snapshot": "('snap.pickle')",
        "memory.memory_snapshot": "()", "memory_snapshot": "()", "check_error": "(0)", "get_allocator_backend": "()",
        "set_per_process_memory_fraction": "(0.5)", "memory_usage": "()", "temperature": "()", "power_draw": "()",
        "clock_rate": "()"}.items()},
    "import io, torch\nb = io.BytesIO()\ntorch.save(torch.ones(2), b)\nb.seek(0)\n"
    "assert torch.load(b, map_location='cuda:{}'.format(0)).sum() == 2": ("redirected", "ran"),
}

RUNNER = """\
import devshim_core.auto  # noqa: F401  (the first line, as in a user's script)
import json, runpy, sys
outcomes = []
for path in sys.argv[1:]:
    try:
        runpy.run_path(path)
        outcomes.append("ran")
    except BaseException as exc:  # SystemExit included: sys.exit() in an except clause stops the script
        outcomes.append(type(exc).__name__)
print(json.dumps(outcomes))
"""


def test_what_devshim_check_says_of_an_import_or_a_call_is_what_happens_under_devshim(tmp_path):
    """One interpreter under devshim runs every script (Megatron importable: devshim provides and blocks then)."""
    pytest.importorskip("megatron.core", reason="devshim provides and blocks modules when Megatron is importable")
    scripts = [write(tmp_path, f"s{i}.py", source) for i, source in enumerate(SAYS_AND_DOES)]
    said = {}
    for source, script in zip(SAYS_AND_DOES, scripts, strict=True):
        found = check_paths([str(script)], NPU).findings
        said[source] = " ".join(sorted({f.category + (" (if reached)" if f.if_reached else "") for f in found}))
    assert said == {source: says for source, (says, _) in SAYS_AND_DOES.items()}
    result = run([PYTHON, "-c", RUNNER, *scripts], clean_env(DEVSHIM_PLUGIN="cpu_reference"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    did = dict(zip(SAYS_AND_DOES, json.loads(result.stdout.splitlines()[-1]), strict=True))
    assert did == {source: does if does is not None else did[source] for source, (_, does) in SAYS_AND_DOES.items()}
    assert all(did[source] != "ran" for source, (_, does) in SAYS_AND_DOES.items() if does is None)


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
    assert out.splitlines()[-1].startswith("2 files scanned: 1 redirected, 0 provided, 0 blocked, 0 review, "
                                           "1 unsupported")


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
         "message": coverage.UNSERVED_CUDA["CUDAGraph"], "if_reached": None},
        {"path": str(script), "line": 5, "col": 7, "category": "unsupported",
         "construct": "torch.utils.cpp_extension.CUDAExtension", "message": rules.CUDA_EXTENSION_MESSAGE,
         "if_reached": None},
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
    """docs/cuda-scripts.md shows a script and the output of `devshim check` on it, all of it and only the problems;
    they must not drift. (Megatron importable: the example's guarded apex import is blocked.)"""
    pytest.importorskip("megatron.core", reason="the guide's output is the one with megatron-core installed")
    guide = GUIDE.read_text()
    script = re.search(r"```python\n(.*?)```", guide, re.S).group(1)  # the first python block: the example
    write(tmp_path, "train.py", script)
    shown = re.findall(r"```\n\$ DEVSHIM_EMULATE=ascend devshim check (.*?)train\.py\n(.*?)```", guide, re.S)
    assert [options for options, _ in shown] == ["", "--only problems "]
    for options, output in shown:
        result = run([DEVSHIM_SCRIPT, "check", *options.split(), "train.py"], clean_env(DEVSHIM_EMULATE="ascend"),
                     cwd=tmp_path)
        assert result.returncode == 1, result.stderr
        assert result.stdout == output, options


# -- third-party scripts ----------------------------------------------------------------------------

# the checkouts docs/cuda-scripts.md's table was recorded on: (variable, what, a file it must contain)
CHECKOUTS = {
    "DeepSpeedExamples": ("DEEPSPEED_EXAMPLES_PATH",
                          "deepspeedai/DeepSpeedExamples at commit 45b4b7156c8794a3452a5a7d03dbd8d797068569",
                          "training/cifar/cifar10_deepspeed.py"),
    "Megatron-LM": ("MEGATRON_LM_PATH", "NVIDIA/Megatron-LM at tag core_v0.16.1", "pretrain_gpt.py"),
    "Megatron-DeepSpeed": ("MEGATRON_DEEPSPEED_PATH",
                           "deepspeedai/Megatron-DeepSpeed at commit bcedecd1ff788d4d363f3365fd396053a08d65be",
                           "megatron/training.py"),
}
_ROW = re.compile(r"^\| ([\w-]+) \| `([^`]+)` \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| "
                  r"(\d+)(?: \((\d+) if reached\))? \|", re.M)


def recorded_counts(checkout: str) -> dict[str, tuple[int, ...]]:
    """docs/cuda-scripts.md's table for ``checkout``: script -> (redirected, provided, blocked, review, unsupported,
    unsupported if reached)."""
    return {m[2]: tuple(int(n or 0) for n in m.groups()[2:]) for m in _ROW.finditer(GUIDE.read_text())
            if m[1] == checkout}


@pytest.mark.parametrize("checkout", CHECKOUTS)
def test_the_third_party_scripts_get_the_findings_the_guide_records(checkout):
    """docs/cuda-scripts.md records, per script, the findings devshim check makes and how many were verified
    correct by reading the script; a change in the check's rules that moves one must move the table with it."""
    from e2e.third_party import checkout as checkout_path  # pytest puts tests/ on sys.path

    variable, what, marker = CHECKOUTS[checkout]
    recorded = recorded_counts(checkout)
    assert len(recorded) == 5, f"the guide's table should list 5 {checkout} scripts, it lists {sorted(recorded)}"
    root = checkout_path(variable, what, marker)  # skipped, with the reason, when the variable is unset
    start = time.monotonic()
    counted = {}
    for script in recorded:
        result = check_paths([str(root / script)], NPU)
        assert not result.errors, result.errors
        counts = [sum(1 for f in result.findings if f.category == c) for c in rules.CATEGORIES]
        unreached = sum(1 for f in result.findings if f.category == "unsupported" and f.if_reached)
        counted[script] = (*counts, unreached)
    assert counted == recorded, f"{checkout} at {root}: is it {what}?"
    assert time.monotonic() - start < 10  # static: parsing only
