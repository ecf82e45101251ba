"""Faults at devshim's DeepSpeed integration, and what the user sees instead of a compiler run, a clobbered file or
code devshim was not written for.

- **An op devshim does not serve.** Every op builder DeepSpeed has (its CUDA builders and those of every accelerator
  package under ``deepspeed.ops.op_builder``, walked from DeepSpeed itself) is either served by devshim or refused
  with an error naming DeepSpeed's own op and builder (``'fused_lamb' (FusedLambBuilder)``) and saying what to use
  instead, through each path a user reaches it by: ``get_accelerator().create_op_builder``, a real engine with
  ``"optimizer": {"type": "Lamb"}``, a builder class imported from its own module (DeepCompile's), and a script that
  imported DeepSpeed before devshim. Nothing is compiled.
- **A symlink at a swap path.** ZeRO-Infinity's NVMe offload (a real engine) and the ``aio_handle`` API its swappers
  call find a symlink where a swap file goes: the write (or read) is refused with an error naming the path and saying
  it is a symlink and what to do, and the file the link points to is left as it was, also when only the native
  engine's ``O_NOFOLLOW`` stands in the way.
- **A version that lies.** A ``deepspeed`` package whose code says 0.9.0 or 0.25.0 shadows the installed 0.19.8
  (whose metadata is all ``importlib.metadata`` sees): ``import devshim_core.auto; import deepspeed`` is refused
  naming the version that runs, whether the package is on the path from the start or put there after devshim
  activated. Conversely, metadata that says 0.15.4 over the installed 0.19.8 code does not refuse it: the code wins.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import json
import os
import pkgutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

# isort: off
import devshim_core.auto  # noqa: F401  (activates devshim in this pytest process, before deepspeed)
import deepspeed

# isort: on
import pytest
import torch
import torch.utils.cpp_extension
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.op_builder.builder import OpBuilder
from devshim_kernels import file_io

from devshim_core.integrations.deepspeed import aio as devshim_aio
from devshim_core.integrations.deepspeed.op_builders import NotImplementedBuilder
from devshim_core.integrations.deepspeed.op_builders.base import DevshimOpBuilder
from devshim_core.integrations.deepspeed.ops import FusedAdamOp

MiB = 1 << 20
NEVER_COMPILED = "devshim never JIT-compiles DeepSpeed ops"


# -- an op devshim does not serve --------------------------------------------------------------------------------


def deepspeed_builders() -> dict[str, type]:
    """Every op builder class DeepSpeed defines, by class name, from DeepSpeed's own modules: the CUDA builders its
    ``op_builder`` package binds, then those of each accelerator's package (``cpu``, ``npu``, ``xpu``, ...)."""
    package = importlib.import_module("deepspeed.ops.op_builder")
    found: dict[str, type] = {}
    # CUDA's modules first, then the accelerators' packages: where a class name repeats, CUDA's names the op
    infos = sorted(pkgutil.iter_modules(package.__path__), key=lambda info: (info.ispkg, info.name))
    modules = [importlib.import_module(f"{package.__name__}.{info.name}") for info in infos if info.name != "all_ops"]
    for module in modules:
        for name, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, OpBuilder) and "NAME" in vars(value)
                    and value.__module__.startswith(package.__name__)):
                found.setdefault(name, value)
    return found


BUILDERS = deepspeed_builders()
SERVED = {"AsyncIOBuilder", "CPUAdamBuilder", "FusedAdamBuilder", "PackbitsBuilder"}  # PackbitsBuilder: until 0.19.6
TO_THE_BACKEND = {"ShareMemCommBuilder", "CCLCommBuilder"}  # collectives run on the plugin's backend instead
# what the refusal must tell the user to do, for the ops a training config switches on
ADVICE = {
    "FusedLambBuilder": '"AdamW"',
    "FusedLionBuilder": '"AdamW"',
    "CPUAdagradBuilder": "offload_optimizer",
    "InferenceBuilder": "replace_with_kernel_inject=False",
    "QuantizerBuilder": "zero_quantized_weights",
    "RandomLTDBuilder": '"random_ltd": {"enabled": false}',
    "DeepCompileBuilder": '"deepcompile": false',
    "GDSBuilder": '"use_gds": false',
    "EvoformerAttnBuilder": "PyTorch attention",
    "SparseAttnBuilder": "dense attention",
}


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """A JIT build fails the test instead of running."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a DeepSpeed op was JIT-compiled")

    for name in ("load", "load_inline"):
        monkeypatch.setattr(torch.utils.cpp_extension, name, refuse)


def test_deepspeeds_builders_are_walked_from_deepspeed_itself():
    assert {"FusedLambBuilder", "EvoformerAttnBuilder", "InferenceBuilder", "QuantizerBuilder", "RandomLTDBuilder",
            "TransformerBuilder", "CPUAdagradBuilder"} <= set(BUILDERS)  # CUDA's and the accelerators' (cpu_adagrad)
    assert len(BUILDERS) >= 20


@pytest.mark.parametrize("class_name", sorted(BUILDERS))
def test_every_deepspeed_op_is_served_or_refused_naming_itself_and_what_to_do(class_name, no_compiler):
    op_name = BUILDERS[class_name].NAME
    builder = get_accelerator().create_op_builder(class_name)
    if class_name in TO_THE_BACKEND:
        assert builder is None
        return
    assert isinstance(builder, DevshimOpBuilder)
    assert builder.name == op_name  # what ds_report and __compatible_ops__ show
    if class_name in SERVED:
        assert not isinstance(builder, NotImplementedBuilder) and builder.is_compatible() is True
        return
    assert isinstance(builder, NotImplementedBuilder) and builder.is_compatible() is False
    for load in (builder.load, builder.jit_load):
        with pytest.raises(RuntimeError) as refused:
            load()
        message = str(refused.value)
        named = repr(op_name) if class_name == "NotImplementedBuilder" else f"{op_name!r} ({class_name})"
        assert message.startswith(f"DeepSpeed op {named} is not available through devshim plugin 'cpu_reference': "
                                  "devshim has no implementation of it; "), message
        assert message.endswith(NEVER_COMPILED + "."), message
        assert ADVICE.get(class_name, "") in message, message
    assert getattr(deepspeed.ops.op_builder, class_name, builder.__class__) is builder.__class__


def test_lamb_in_the_config_of_a_real_engine_is_refused_naming_fused_lamb_and_the_optimizers_to_use(
        one_rank, no_compiler) -> None:
    config = {"train_batch_size": 2, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}
    with pytest.raises(RuntimeError) as refused:
        deepspeed.initialize(model=torch.nn.Linear(4, 4), config=config)
    message = str(refused.value)
    assert "DeepSpeed op 'fused_lamb' (FusedLambBuilder) is not available" in message
    assert 'the "Lamb" optimizer (FusedLamb) needs it: use "optimizer": {"type": "Adam"} or "AdamW"' in message


def test_a_builder_class_imported_from_its_own_module_is_refused_by_name_or_served_never_compiled(no_compiler):
    # deepspeed.compile.util imports DeepCompileBuilder from deepspeed.ops.op_builder.dc, past the accelerator
    DeepCompileBuilder = pytest.importorskip("deepspeed.compile.util").DeepCompileBuilder

    assert DeepCompileBuilder.__module__ == "deepspeed.ops.op_builder.dc"  # DeepSpeed's CUDA class itself
    with pytest.raises(RuntimeError, match=r"'dc' \(DeepCompileBuilder\) .*\"deepcompile\": false.*never JIT"):
        DeepCompileBuilder().load()
    cuda_fused_adam = importlib.import_module("deepspeed.ops.op_builder.fused_adam").FusedAdamBuilder
    assert isinstance(cuda_fused_adam().load(), FusedAdamOp)  # an op devshim serves: devshim's, by the same name


def run_python(code: str, *, pythonpath: Path | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEVSHIM_PLUGIN": "cpu_reference"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_a_script_that_imported_deepspeed_first_gets_each_ops_own_refusal():
    """DeepSpeed's CPU accelerator answers every op it lacks with one NotImplementedBuilder class, bound under each
    builder's name: devshim rebinds each name to that op's own refusal."""
    result = run_python("""
        import json
        import deepspeed
        import devshim_core.auto
        import deepspeed.ops.lamb.fused_lamb as fused_lamb
        messages = {}
        for where, builder in (("lamb", fused_lamb.FusedLambBuilder), ("op_builder",
                               deepspeed.ops.op_builder.EvoformerAttnBuilder)):
            try:
                builder().load()
            except RuntimeError as exc:
                messages[where] = str(exc)
        print(json.dumps(messages))
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    messages = json.loads(result.stdout.strip().splitlines()[-1])
    assert "DeepSpeed op 'fused_lamb' (FusedLambBuilder) is not available" in messages["lamb"]
    assert "DeepSpeed op 'evoformer_attn' (EvoformerAttnBuilder) is not available" in messages["op_builder"]


# -- a symlink at a swap path -----------------------------------------------------------------------------------------


PRECIOUS = b"the file a swap-path symlink points to; not swap data\n" * 100


@pytest.fixture
def precious(tmp_path: Path) -> Iterator[Path]:
    """A file that must come out of each test as it went in, whatever a symlink to it invites."""
    path = tmp_path / "precious.bin"
    path.write_bytes(PRECIOUS)
    yield path
    assert path.read_bytes() == PRECIOUS, "the symlink's target was written through"


def assert_names_the_symlink(error: BaseException, link: Path, precious: Path) -> None:
    message = str(error)
    assert str(link) in message and f"symbolic link (to {str(precious)!r})" in message, message
    assert "never follows one" in message and "Remove the link" in message, message


@pytest.fixture
def handle():
    return deepspeed.ops.op_builder.AsyncIOBuilder().load().aio_handle(MiB, 8, False, True, 1)


@pytest.mark.parametrize("write", ["sync_pwrite", "async_pwrite", "pwrite+validate"])
def test_a_write_to_a_symlinked_swap_path_is_refused_and_its_target_untouched(handle, tmp_path, precious, write):
    link = tmp_path / "param.tensor.swp"
    link.symlink_to(precious)
    data = torch.zeros(8192, dtype=torch.uint8)
    with pytest.raises(OSError) as refused:
        if write == "sync_pwrite":
            handle.sync_pwrite(data, str(link))
        elif write == "async_pwrite":
            handle.async_pwrite(data, str(link))
            handle.wait()
        else:
            handle.pwrite(data, str(link), True, False)
    assert_names_the_symlink(refused.value, link, precious)
    assert handle.sync_pwrite(data, str(tmp_path / "ok.swp")) == 1  # the handle is still usable


def test_a_read_from_a_symlinked_swap_path_is_refused(handle, tmp_path, precious):
    link = tmp_path / "param.tensor.swp"
    link.symlink_to(precious)
    buffer = torch.zeros(len(PRECIOUS), dtype=torch.uint8)
    with pytest.raises(OSError) as refused:
        handle.sync_pread(buffer, str(link))
    assert_names_the_symlink(refused.value, link, precious)
    assert not buffer.any()  # nothing was read through the link


@pytest.mark.parametrize("read", [False, True], ids=["write", "read"])
def test_the_native_engine_itself_never_follows_a_symlink(handle, tmp_path, precious, monkeypatch, read):
    """The handle's check by name happens before the open; the open itself (O_NOFOLLOW) is what holds if the path
    becomes a link in between, so it is tested with that check out of the way, and with a dangling link (a write
    would otherwise create the file the link names)."""
    monkeypatch.setattr(devshim_aio, "_symlink_refusal", lambda path, read: None)
    link = tmp_path / "param.tensor.swp"
    link.symlink_to(precious)
    with pytest.raises(OSError) as refused:
        handle.sync_pread(torch.zeros(16, dtype=torch.uint8), str(link)) if read else \
            handle.sync_pwrite(torch.zeros(16, dtype=torch.uint8), str(link))
    assert_names_the_symlink(refused.value, link, precious)
    dangling = tmp_path / "dangling.swp"
    dangling.symlink_to(tmp_path / "created-through-the-link")
    engine = file_io.AsyncFileIO(1, 4096)
    try:
        with pytest.raises(OSError, match="symbolic link"):
            engine.submit(False, torch.zeros(16, dtype=torch.uint8), dangling)
    finally:
        engine.close()
    assert not (tmp_path / "created-through-the-link").exists()


def zero_infinity(nvme: Path) -> deepspeed.DeepSpeedEngine:
    """ZeRO-3 with the optimizer state offloaded to NVMe files under ``nvme``: a 512x512 weight is big enough
    (1 MiB) for DeepSpeed to swap it, and its initial fp32 copy is written to its swap file at initialisation."""
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}}}
    torch.manual_seed(0)
    engine, _, _, _ = deepspeed.initialize(model=torch.nn.Linear(512, 512, bias=False), config=config)
    return engine


def test_zero_infinity_nvme_offload_refuses_a_symlink_at_its_swap_file(one_rank, tmp_path, precious, monkeypatch):
    from deepspeed.runtime.zero.partition_parameters import Init

    first_id = Init.param_id  # swap files are named after the ZeRO-3 parameter ids, counted per process
    zero_infinity(tmp_path / "learn")  # where DeepSpeed puts its swap files, from DeepSpeed itself
    swap_files = sorted(p.relative_to(tmp_path / "learn") for p in (tmp_path / "learn").rglob("*.swp"))
    assert swap_files, "DeepSpeed swapped nothing: the spec would prove nothing"
    nvme = tmp_path / "nvme"
    for relative in swap_files:
        (nvme / relative).parent.mkdir(parents=True, exist_ok=True)
        (nvme / relative).symlink_to(precious)
    monkeypatch.setattr(Init, "param_id", first_id)  # the same ids again: the same swap paths, now symlinks
    with pytest.raises(OSError) as refused:
        zero_infinity(nvme)
    link = Path(refused.value.filename)
    assert link.relative_to(nvme) in swap_files
    assert_names_the_symlink(refused.value, link, precious)


# -- a version that lies ------------------------------------------------------------------------------------------


def shadowing_deepspeed(root: Path, version: str) -> Path:
    """A source tree of a ``deepspeed`` package whose code says ``version`` (its ``git_version_info.py``; no
    ``version.txt``, no metadata): imported first, it runs instead of the installed DeepSpeed. Its ``__init__``
    imports the accelerator first, as DeepSpeed's does, then reads its version."""
    package = root / "deepspeed"
    (package / "accelerator").mkdir(parents=True)
    (package / "__init__.py").write_text("from deepspeed.accelerator import real_accelerator\n"
                                         "from deepspeed.git_version_info import version as __version__\n"
                                         "print('the shadowing deepspeed ran to its end')\n")
    (package / "git_version_info.py").write_text(f"version = '{version}'\ngit_hash = '[none]'\n")
    (package / "accelerator" / "__init__.py").write_text("")
    (package / "accelerator" / "real_accelerator.py").write_text("ds_accelerator = None\n")
    return root


REFUSED = """
    import sys
    from devshim_core.errors import PatchError
    try:
        {statements}
    except PatchError as exc:
        print(exc)
    else:
        raise SystemExit("a deepspeed devshim does not support was patched")
"""


@pytest.mark.parametrize("version", ["0.9.0", "0.25.0"])
def test_a_deepspeed_on_the_path_whose_code_says_an_unsupported_version_is_refused(tmp_path, version):
    installed = importlib.metadata.version("deepspeed")
    source = shadowing_deepspeed(tmp_path / "src", version)
    result = run_python(REFUSED.format(statements="import devshim_core.auto; import deepspeed"), pythonpath=source)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.strip() == (
        f"devshim's DeepSpeed integration cannot run: the deepspeed package that runs, {source / 'deepspeed'}, is "
        f"deepspeed {version} (its own code says so; the installed distribution's metadata says {installed}, and the "
        "code wins), and devshim supports deepspeed>=0.16,<0.20. "
        f"Take {source} off sys.path/PYTHONPATH (the installed deepspeed {installed} then runs), or set "
        "DEVSHIM_PATCH_DEEPSPEED=0 to run without devshim's DeepSpeed integration.")


def test_a_deepspeed_put_on_the_path_after_devshim_activated_is_refused_when_it_imports(tmp_path):
    """At activation ``import deepspeed`` would load the installed 0.19.8; the script then puts a 0.25.0 source tree
    first on ``sys.path``. Its code's version is read when its accelerator module is imported (before DeepSpeed has
    read its own version), and the import fails there, before the package runs to its end."""
    source = shadowing_deepspeed(tmp_path / "src", "0.25.0")
    result = run_python(REFUSED.format(statements=f"""import devshim_core.auto
        assert devshim_core.auto.session.integrations["deepspeed"].startswith("armed"), \\
            devshim_core.auto.session.integrations
        sys.path.insert(0, {str(source)!r})
        import deepspeed"""))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert f"the deepspeed package that runs, {source / 'deepspeed'}, is deepspeed 0.25.0" in result.stdout
    assert "ran to its end" not in result.stdout


def test_metadata_that_says_an_unsupported_version_does_not_refuse_the_supported_code_that_runs(tmp_path):
    installed = importlib.metadata.version("deepspeed")
    info = tmp_path / "deepspeed-0.15.4.dist-info"  # found first by importlib.metadata; the code is the installed
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.15.4\n")
    (info / "RECORD").write_text("")
    result = run_python("""
        import importlib.metadata
        import devshim_core.auto
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        print(importlib.metadata.version("deepspeed"), deepspeed.__version__, type(get_accelerator()).__name__)
    """, pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-3:] == ["0.15.4", installed, "DevshimAccelerator"]
