"""Spec: the redirected ``torch.cuda`` is complete. Every public name of the real ``torch.cuda``, ``torch.cuda.amp``,
``torch.cuda.random`` and ``torch.backends.cuda`` (read with devshim off) exists once the redirect is on, is still a
class where torch's is one, and is exactly one of:

- served: answered on the selected device, accepting every parameter torch's accepts;
- modified: served with a difference that ``coverage.MODIFIED`` states in one line;
- as torch: the very object torch defines (modules, constants, exceptions, calls that work without CUDA);
- refused: calling it raises one devshim error naming ``torch.cuda.<name>`` and what to do (no torch
  "not compiled with CUDA" assertion, no NVML import error).

A name no table decides fails the spec: a new torch forces a decision (``coverage.classify``).

The second spec injects nothing: with torch, deepspeed, megatron.core and transformers imported before devshim
activates (as a script importing them first does), it scans every loaded module, and the classes in it, for an
object devshim replaced still bound under another name: a caller reaching one would run torch's CUDA code and not
the redirect. What may keep the originals is listed in ``EXEMPT``, each with why.

Both run on ``cpu_reference`` in this process; ``tests/emulated/test_cuda_facade_emulated.py`` runs the first on the
emulated ``npu``/``tpu``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devshim_core import session
from devshim_core.integrations.cuda_redirect import coverage
from devshim_core.integrations.cuda_redirect.cuda_module import CudaCallRefused
from devshim_core.patching import REGISTRY, SetAttribute, SetAttributes, resolve_target

ENV = {"DEVSHIM_PLUGIN": "cpu_reference", "DEVSHIM_PATCH_DEEPSPEED": "0", "DEVSHIM_PATCH_MEGATRON": "0"}
FULL_ENV = {"DEVSHIM_PLUGIN": "cpu_reference"}  # every integration: what a training script gets


# -- what torch defines, and what the redirect makes of it ---------------------------------------------------------

def snapshot() -> dict[str, dict[str, Any]]:
    """module -> {public name: object}, for each of ``coverage.FACADE_MODULES`` as it is now."""
    modules = {name: importlib.import_module(name) for name in coverage.FACADE_MODULES}
    return {name: {n: getattr(m, n) for n in coverage.public_names(m)} for name, m in modules.items()}


@contextlib.contextmanager
def devshim_off() -> Iterator[None]:
    """devshim deactivated inside the block; the suite's session (``import devshim_core.auto``), if any, after."""
    had_session = session.current() is not None
    session.deactivate()
    try:
        yield
    finally:
        session.deactivate()
        if had_session:
            session.activate()


@pytest.fixture(scope="module")
def real() -> dict[str, dict[str, Any]]:
    """Every public name as torch defines it (read with devshim off)."""
    with devshim_off():
        return snapshot()


@pytest.fixture
def redirected(real: dict[str, dict[str, Any]]) -> Iterator[dict[str, dict[str, Any]]]:
    with devshim_off():
        session.activate(ENV)
        yield {module: {n: getattr(sys.modules[module], n, MISSING) for n in names}
               for module, names in real.items()}


MISSING = object()


def cases(real: dict[str, dict[str, Any]]) -> Iterator[tuple[str, str, Any, str]]:
    """(module, name, torch's object, kind) for every public name."""
    for module, names in real.items():
        for name, obj in names.items():
            decided = coverage.classify(module, name)
            yield module, name, obj, decided[0] if decided else "unclassified"


# -- signatures -----------------------------------------------------------------------------------------------------

def signature_problem(real: Any, new: Any) -> str | None:
    """Why ``new`` does not accept every parameter ``real`` accepts (positionally and by keyword), or None."""
    try:
        theirs = inspect.signature(real)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to compare against
        return None
    try:
        ours = inspect.signature(new)
    except (TypeError, ValueError):
        return f"has no signature; torch's is {theirs}"
    params = list(theirs.parameters.values())
    if isinstance(real, type) and params and params[0].name == "self":
        params = params[1:]
    kinds = inspect.Parameter
    by_position = [p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    only_positional = [p for p in params if p.kind is kinds.POSITIONAL_ONLY]
    by_keyword = {p.name: 0 for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    keyword_only = {p.name: 0 for p in params if p.kind is kinds.KEYWORD_ONLY}
    calls = [((0,) * len(by_position), keyword_only), ((0,) * len(only_positional), by_keyword)]
    if any(p.kind is kinds.VAR_POSITIONAL for p in params):
        calls.append(((0,) * (len(by_position) + 2), keyword_only))
    if any(p.kind is kinds.VAR_KEYWORD for p in params):
        calls.append(((), {**by_keyword, "devshim_extra_keyword": 0}))
    for args, kwargs in calls:
        try:
            ours.bind(*args, **kwargs)
        except TypeError as exc:
            return f"{ours} does not accept what torch's {theirs} does ({exc})"
    return None


# -- spec 1: every public name, classified and answered as classified -----------------------------------------------

def test_every_public_name_of_the_real_modules_is_decided(real):
    undecided = [f"{module}.{name}" for module, name, _, kind in cases(real) if kind == "unclassified"]
    assert not undecided, (
        f"{len(undecided)} public names of torch's CUDA modules are in no table of "
        f"devshim_core/integrations/cuda_redirect/coverage.py: {', '.join(undecided)}. Decide each: serve it "
        "(DEVICE_FUNCTIONS, MODIFIED), leave it as torch's (AS_TORCH) or refuse it (CUDA_ONLY_CALLS)")
    assert sum(1 for _ in cases(real)) > 150  # the four modules were read (torch 2.13: 169 names)


# parameters a served name does not accept as torch's does: each is stated in coverage.MODIFIED, and the spec fails
# once the gap is closed, so that this list stays true
SIGNATURE_GAPS: dict[str, str] = {}  # name -> the problem a plugin's class is known to have (none today)


def test_served_and_modified_names_exist_stay_classes_and_accept_torchs_parameters(real, redirected):
    problems, gaps = [], set()
    for module, name, theirs, kind in cases(real):
        if kind not in ("served", "modified"):
            continue
        ours = redirected[module][name]
        where = f"{module}.{name}"
        if ours is MISSING:
            problems.append(f"{where} is missing")
        elif isinstance(theirs, type) and not isinstance(ours, type):
            problems.append(f"{where} is no longer a class: isinstance(x, {where}) would raise")
        elif callable(theirs) and (problem := signature_problem(theirs, ours)):
            if where in SIGNATURE_GAPS and problem.endswith(SIGNATURE_GAPS[where]):
                gaps.add(where)
            else:
                problems.append(f"{where} {problem}")
    assert not problems, "\n".join(problems)
    # on the plugin that has it (cpu_reference's host event): a closed gap must leave the list
    assert gaps == set(SIGNATURE_GAPS), f"no longer a gap, remove it from SIGNATURE_GAPS: {set(SIGNATURE_GAPS) - gaps}"


def test_names_left_as_torchs_are_torchs_own_objects(real, redirected):
    replaced = [f"{m}.{n}" for m, n, theirs, kind in cases(real)
                if kind == "as torch" and redirected[m][n] is not theirs]
    assert not replaced, f"classified 'as torch' in coverage.py but replaced by the redirect: {replaced}"


def test_refused_names_raise_one_devshim_error_naming_the_call(real, redirected):
    refused = [(m, n, theirs) for m, n, theirs, kind in cases(real) if kind == "refused"]
    assert len(refused) >= 30
    wrong = []
    for module, name, theirs in refused:
        ours = redirected[module][name]
        if isinstance(theirs, type) is not isinstance(ours, type):
            wrong.append(f"{module}.{name}: a class in torch, not under devshim (or the reverse)")
            continue
        if (problem := signature_problem(theirs, ours)) is not None:
            wrong.append(f"{module}.{name} {problem}")
        # plausible arguments: one per required parameter of torch's (an index, a size or a status code: 0)
        with contextlib.suppress(TypeError, ValueError):
            signature = inspect.signature(theirs)
        required = [p for p in signature.parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                    and p.name != "self"]
        with pytest.raises(CudaCallRefused) as raised:
            ours(*[0] * len(required))
        message = str(raised.value)
        if not message.startswith(f"torch.cuda.{name}() cannot run on cpu (devshim plugin cpu_reference"):
            wrong.append(f"{module}.{name}: {message}")
        assert coverage.refused_names()[name] in message  # what to do instead
    assert not wrong, "\n".join(wrong)


def test_refused_classes_are_still_classes_that_nothing_is_an_instance_of(redirected):
    graph = redirected["torch.cuda"]["CUDAGraph"]
    assert isinstance(graph, type) and not isinstance(object(), graph)


# -- spec 2: no stale reference to a replaced object ----------------------------------------------------------------

# where an object devshim replaced may stay bound (fnmatch patterns on module.name), and why
EXEMPT: dict[str, str] = {
    "torch.*": "torch's own modules are left alone (the stale-cuda-references patch excludes them): torch.cuda's "
               "submodules keep the definitions torch.cuda re-exports, which torch calls internally",
    "devshim_core.*": "devshim's own modules keep the originals they wrap and restore",
    "test_*": "the specs' own modules keep Megatron's and torch's originals, to compare devshim's paths with",
    "megatron.core.*.local_multi_tensor_l2_norm": "Megatron's own fallback, defined under this name: devshim's "
                                                  "multi-tensor patch replaces clip_grads.l2_norm_impl, which "
                                                  "Megatron calls",
    "megatron.core.*.local_multi_tensor_scale": "Megatron's own fallback, defined under this name: devshim's "
                                                "multi-tensor patch replaces multi_tensor_scale_impl, which "
                                                "Megatron calls",
    "megatron.core.optimizer.CPUAdam": "torch's Adam, which Megatron's CPU-offload optimizer runs on host tensors "
                                       "by design; devshim's fused Adam replaces the device optimizer only",
}


def _replaced_attributes() -> list[tuple[Any, str]]:
    """(owner, attribute) of every attribute the applied patch sets replaced, as the registry records them."""
    found = []
    for applied in REGISTRY.applied_sets():
        for done in applied.applied:
            patch = done.patch
            if isinstance(patch, SetAttributes):
                module_name, _, path = patch.target.partition(":")
                owner: Any = importlib.import_module(module_name)
                for part in filter(None, path.split(".")):
                    owner = getattr(owner, part)
                found.extend((owner, n) for n in patch.names)
            elif isinstance(patch, SetAttribute):
                found.append(resolve_target(patch.target))
    return found


def stale_references(originals: dict[int, tuple[Any, str]]) -> list[str]:
    """``module.name`` (or ``module.Class.name``) for each binding of an original that ``EXEMPT`` does not cover."""
    found = []
    for module_name, module in list(sys.modules.items()):
        if module is None:
            continue
        try:
            namespace = dict(vars(module))
        except TypeError:
            continue
        for key, value in namespace.items():
            bindings = [(f"{module_name}.{key}", value)]
            if isinstance(value, type) and getattr(value, "__module__", None) == module_name:
                bindings += [(f"{module_name}.{key}.{attr}", inner) for attr, inner in list(vars(value).items())]
            for where, bound in bindings:
                hit = originals.get(id(bound))
                if hit is not None and hit[0] is bound and not any(fnmatch.fnmatchcase(where, p) for p in EXEMPT):
                    found.append(f"{where} (the original of {hit[1]})")
    return found


def test_no_loaded_module_keeps_an_object_the_redirect_replaced():
    for framework in ("torch", "deepspeed", "megatron.core", "transformers"):
        with contextlib.suppress(ImportError):  # what is installed is scanned; torch always is
            importlib.import_module(framework)
    with devshim_off():
        session.activate(FULL_ENV)  # read the registry for what is replaced...
        targets = _replaced_attributes()
        session.deactivate()  # ...and read each original with devshim off
        originals = {}
        for owner, attr in targets:
            value = vars(owner).get(attr)
            if callable(value):  # functions, classes, descriptors: a constant (torch.cuda.default_generators, an
                # empty tuple without CUDA) may be a shared singleton, bound everywhere for other reasons
                originals[id(value)] = (value, f"{getattr(owner, '__name__', owner)}.{attr}")
        session.activate(FULL_ENV)
        assert len(originals) > 100  # the redirect's replacements were found
        stale = stale_references(originals)
    assert not stale, (f"{len(stale)} names still hold an object devshim replaced: {', '.join(stale)}. Rebind them "
                       "(the cuda-redirect set's stale-cuda-references patch) or exempt them in EXEMPT, saying why")


def test_deepspeed_on_device_imported_first_keeps_the_redirect_after_its_block():
    """DeepSpeed's ``OnDevice`` saved ``torch.empty`` at import and puts it back on exit: rebound, its block ends
    with the redirected factory in place, and ``'cuda'`` inside the block reaches the device. In a fresh interpreter,
    so that DeepSpeed really is imported before devshim ever activated (this process may have imported it under the
    suite's session)."""
    pytest.importorskip("deepspeed")
    script = textwrap.dedent("""
        import deepspeed, torch
        from devshim_core import session
        session.activate({"DEVSHIM_PLUGIN": "cpu_reference"})
        redirected_empty = torch.empty
        with deepspeed.OnDevice(dtype=torch.float16, device="cuda"):
            inside = torch.empty(2, device="cuda")
        assert torch.empty is redirected_empty
        assert torch.empty(2, device="cuda").device.type == inside.device.type == "cpu"
        assert inside.dtype == torch.float16
        print("kept")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVSHIM_")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("kept"), done.stderr[-3000:]


def test_the_docs_table_is_generated_from_the_code(monkeypatch):
    """docs/cuda-scripts.md's table is ``docs_support/cuda_table.py``'s output for this torch (devshim off)."""
    repo = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(repo / "docs_support"))  # as when it runs as a script: its helper beside it
    spec = importlib.util.spec_from_file_location("cuda_table", repo / "docs_support" / "cuda_table.py")
    assert spec is not None and spec.loader is not None
    cuda_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cuda_table)
    with devshim_off():
        table = cuda_table.markdown()
    assert "undecided" not in table
    assert table in (repo / "docs" / "cuda-scripts.md").read_text(), (
        "docs/cuda-scripts.md's CUDA facade table is stale: run `python docs_support/cuda_table.py "
        "docs/cuda-scripts.md`")
