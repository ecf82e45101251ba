"""Spec: one switch turns off any integration, patch set or single patch: ``DEVSHIM_DISABLE=<set>[:<patch>],...``.

The registry honours it: a disabled set is never applied, a set with a disabled patch is applied without that patch,
and both are reported (``devshim info``: "disabled by DEVSHIM_DISABLE"). The booleans of old stay, as aliases of the
integrations' names. A user bisecting a wrong loss turns patches off one at a time.
"""

from __future__ import annotations

import json
import types

import pytest
from plugin_fixtures import DEVSHIM_SCRIPT, PYTHON, clean_env, run

from devshim_core.patching import PatchRegistry, PatchSet, SetAttribute
from devshim_core.settings import Settings

# -- a job with one wrong patch among several -----------------------------------------------------------------------

calc = types.ModuleType("devshim_test_calc")
calc.scale = lambda x: 2 * x
calc.shift = lambda x: x + 3
calc.square = lambda x: x * x
calc.halve = lambda x: x / 2


def _loss() -> float:
    return calc.halve(calc.square(calc.shift(calc.scale(1.0))))


def _wrap(original, device):  # a correct patch: the same function, counted
    return lambda x: original(x)


PATCHES = PatchSet("calc", (), [
    SetAttribute("scale-wrapper", "devshim_test_calc:scale", _wrap, "counts calls"),
    SetAttribute("shift-wrapper", "devshim_test_calc:shift", _wrap, "counts calls"),
    SetAttribute("square-fast-path", "devshim_test_calc:square", lambda original, device: lambda x: x * x + 1e-3,
                 "a 'fused' square that is off by 1e-3"),
    SetAttribute("halve-wrapper", "devshim_test_calc:halve", _wrap, "counts calls"),
], "a job's patches, one of them wrong")


@pytest.fixture
def calc_module(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "devshim_test_calc", calc)
    return calc


def test_disabling_patches_one_at_a_time_finds_the_wrong_one(calc_module):
    expected = _loss()  # what the job computes without any patch
    registry = PatchRegistry()
    registry.apply(PATCHES, device=None)
    assert _loss() != expected  # the loss is wrong with every patch applied
    registry.revert_all()
    culprits = []
    for patch in PATCHES.patches:
        entry = f"calc:{patch.name}"
        registry.disable(Settings.from_env({"DEVSHIM_DISABLE": entry}).disabled_patches())
        applied = registry.apply(PATCHES, device=None)
        assert [p.patch.name for p in applied.applied] == [p.name for p in PATCHES.patches if p is not patch]
        assert registry.disabled_report() == [{"set": "calc", "patch": patch.name,
                                               "reason": f"disabled by DEVSHIM_DISABLE={entry}"}]
        if _loss() == expected:
            culprits.append(patch.name)
        registry.revert_all()
    assert culprits == ["square-fast-path"]


def test_a_disabled_set_is_not_applied_at_all_and_is_reported(calc_module):
    registry = PatchRegistry()
    registry.disable({"calc": "disabled by DEVSHIM_DISABLE=calc"})
    applied = registry.apply(PATCHES, device=None)
    assert applied.disabled == "disabled by DEVSHIM_DISABLE=calc" and applied.applied == []
    assert not registry.is_applied("calc") and registry.report() == []
    assert registry.disabled_report() == [{"set": "calc", "patch": None, "reason": "disabled by DEVSHIM_DISABLE=calc"}]
    assert _loss() == 12.5


# -- through the environment, in a real activation --------------------------------------------------------------------

FACTORY = """
import json, torch
import devshim_core.auto
try:
    where = str(torch.zeros(1, device="cuda").device)
except Exception as exc:
    where = type(exc).__name__
print(json.dumps(where))
"""


@pytest.mark.parametrize(("disable", "expected"), [("", "cpu"), ("cuda-redirect:factories", "NotImplementedError"),
                                                   ("cuda-redirect", "AssertionError")])
def test_one_patch_of_the_cuda_redirect_can_be_turned_off_by_name(disable, expected):
    """Redirected, a 'cuda' factory makes a CPU tensor; without the factories patch torch refuses the 'cuda' device
    (no CUDA kernel registered), and without the whole redirect torch says it was not compiled with CUDA."""
    env = clean_env(DEVSHIM_PLUGIN="cpu_reference", **({"DEVSHIM_DISABLE": disable} if disable else {}))
    result = run([PYTHON, "-c", FACTORY], env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == expected


def test_devshim_info_reports_what_devshim_disable_turned_off():
    env = clean_env(DEVSHIM_PLUGIN="cpu_reference", DEVSHIM_DISABLE="torch.distributed-timeouts,cuda-redirect:autocast,"
                                                                   "deepspeed")
    result = run([DEVSHIM_SCRIPT, "info", "--json"], env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["disabled"] == [
        {"set": "torch.distributed-timeouts", "patch": None,
         "reason": "disabled by DEVSHIM_DISABLE=torch.distributed-timeouts"},
        {"set": "cuda-redirect", "patch": "autocast", "reason": "disabled by DEVSHIM_DISABLE=cuda-redirect:autocast"},
    ]
    assert report["integrations"]["deepspeed"] == "skipped: DEVSHIM_DISABLE=deepspeed"
    assert not any(row["set"] == "torch.distributed-timeouts" for row in report["patches"])
    assert not any(row["set"] == "cuda-redirect" and row["name"] == "autocast" for row in report["patches"])
    text = run([DEVSHIM_SCRIPT, "info"], env).stdout
    assert "  [cuda-redirect] autocast: not applied, disabled by DEVSHIM_DISABLE=cuda-redirect:autocast" in text


@pytest.mark.parametrize(("variable", "integration"), [("DEVSHIM_PATCH_DEEPSPEED", "deepspeed"),
                                                       ("DEVSHIM_PATCH_MEGATRON", "megatron"),
                                                       ("DEVSHIM_REDIRECT_CUDA", "cuda-redirect")])
def test_the_booleans_of_old_are_aliases_of_the_integrations_names(variable, integration):
    assert Settings.from_env({variable: "0"}).switched_off(integration) == f"{variable}=0"
    assert Settings.from_env({"DEVSHIM_DISABLE": integration}).switched_off(integration) == \
        f"DEVSHIM_DISABLE={integration}"
    assert Settings.from_env({}).switched_off(integration) is None
