"""Spec: the patch registry. Declared patches are applied all or nothing, idempotently, for the versions they
were written for (their set's and each patch's own), reverted exactly, and reported with target, reason, detail
and version range.

Every test patches throwaway modules registered in ``sys.modules`` under unique names, through its own
:class:`PatchRegistry` (the process-wide ``REGISTRY`` belongs to ``devshim_core.auto``).
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import itertools
import sys
import types

import pytest

from devshim_core.errors import PatchError
from devshim_core.patching import (
    PatchRegistry,
    PatchSet,
    ProvideModules,
    RebindReferences,
    Requirement,
    SetAttribute,
    release,
    resolve_target,
    version_in_range,
)

DEVICE = object()  # patches receive the device facade; these ones only pass it along
_counter = itertools.count()
PLUGGY = metadata.version("pluggy")
PLUGGY_MAJOR = release(PLUGGY)[0]


@pytest.fixture
def make_module():
    """``make_module(name_suffix, **attrs)``: a module in ``sys.modules`` for the duration of the test."""
    created: list[str] = []

    def make(suffix: str = "", **attrs: object) -> types.ModuleType:
        name = f"devshim_patch_target_{next(_counter)}{suffix}"
        module = types.ModuleType(name)
        vars(module).update(attrs)
        sys.modules[name] = module
        created.append(name)
        return module

    yield make
    for name in created:
        sys.modules.pop(name, None)


@pytest.fixture
def registry():
    registry = PatchRegistry()
    yield registry
    registry.revert_all()


def original():
    return "original"


def replacement():
    return "replacement"


def replace_with(new):
    return lambda old, device: new


def patch_set(*patches, name="test-set", requires=()) -> PatchSet:
    return PatchSet(name=name, requires=requires, patches=patches, reason="exercise the registry")


def set_attribute(target: str, make, name: str = "swap", requires=(), creates: bool = False) -> SetAttribute:
    return SetAttribute(name=name, target=target, make=make, reason=f"why {name} exists", requires=requires,
                        creates=creates)


# -- applying and reverting ----------------------------------------------------------------------


def test_declaring_a_patch_set_changes_nothing(make_module, registry):
    module = make_module(f=original)
    patch_set(set_attribute(f"{module.__name__}:f", replace_with(replacement)))
    assert module.f is original
    assert registry.report() == []


def test_applying_sets_the_attribute_to_what_make_builds_from_the_original_and_the_device(make_module, registry):
    module = make_module(f=original)
    seen = []

    def make(old, device):
        seen.append((old, device))
        return replacement

    registry.apply(patch_set(set_attribute(f"{module.__name__}:f", make)), DEVICE)
    assert module.f is replacement
    assert seen == [(original, DEVICE)]
    assert registry.is_applied("test-set")


def test_reverting_restores_the_very_same_original_object(make_module, registry):
    module = make_module(f=original)
    registry.apply(patch_set(set_attribute(f"{module.__name__}:f", replace_with(replacement))), DEVICE)
    assert registry.revert("test-set") is True
    assert module.f is original
    assert not registry.is_applied("test-set") and registry.report() == []
    assert registry.revert("test-set") is False  # nothing left to revert


def test_an_attribute_declared_as_created_is_created_and_removed_again(make_module, registry):
    module = make_module()
    seen = []
    registry.apply(patch_set(set_attribute(f"{module.__name__}:added",
                                           lambda old, device: seen.append(old) or replacement, creates=True)),
                   DEVICE)
    assert module.added is replacement and seen == [None]
    registry.revert("test-set")
    assert not hasattr(module, "added")


def test_a_nested_target_patches_a_class_attribute(make_module, registry):
    class Engine:
        def step(self):
            return "original step"

    module = make_module(Engine=Engine)
    registry.apply(patch_set(set_attribute(f"{module.__name__}:Engine.step",
                                           lambda old, device: lambda self: f"patched {old(self)}")), DEVICE)
    assert Engine().step() == "patched original step"
    registry.revert_all()
    assert Engine().step() == "original step"


def test_patching_an_inherited_method_wraps_the_inherited_one_and_revert_removes_the_override(make_module,
                                                                                             registry):
    class Base:
        def step(self):
            return "base step"

    class Child(Base):
        pass

    module = make_module(Child=Child)
    registry.apply(patch_set(set_attribute(f"{module.__name__}:Child.step",
                                           lambda old, device: lambda self: f"wrapped {old(self)}")), DEVICE)
    assert Child().step() == "wrapped base step"
    assert Base().step() == "base step"
    registry.revert_all()
    assert "step" not in vars(Child)
    assert Child().step() == "base step"


def test_applying_an_applied_set_again_does_nothing(make_module, registry):
    module = make_module(f=original)
    calls = []
    declared = patch_set(set_attribute(f"{module.__name__}:f", lambda old, device: calls.append(old) or replacement))
    first = registry.apply(declared, DEVICE)
    second = registry.apply(declared, DEVICE)
    assert second is first
    assert calls == [original]
    registry.revert("test-set")
    assert module.f is original  # not "replacement": the second apply did not stack on the first


def test_revert_all_undoes_every_set_in_reverse_order(make_module, registry):
    module = make_module(f=original)
    registry.apply(patch_set(set_attribute(f"{module.__name__}:f", replace_with(replacement)), name="first"),
                   DEVICE)
    registry.apply(patch_set(set_attribute(f"{module.__name__}:f", replace_with(print)), name="second"), DEVICE)
    assert module.f is print
    registry.revert_all()
    assert module.f is original
    assert registry.report() == []


# -- all or nothing --------------------------------------------------------------------------------


def test_a_failing_patch_reverts_the_patches_of_its_set_already_applied(make_module, registry):
    module = make_module(f=original, g=original)

    def broken(old, device):
        raise RuntimeError("cannot build the replacement")

    declared = patch_set(set_attribute(f"{module.__name__}:f", replace_with(replacement), name="first"),
                         set_attribute(f"{module.__name__}:g", broken, name="second"))
    with pytest.raises(PatchError) as excinfo:
        registry.apply(declared, DEVICE)
    assert str(excinfo.value) == (f"patch 'second' ({module.__name__}:g) of set 'test-set' failed: RuntimeError: "
                                  "cannot build the replacement. Nothing of this set was left applied.")
    assert isinstance(excinfo.value.__cause__, RuntimeError)
    assert module.f is original and module.g is original
    assert not registry.is_applied("test-set") and registry.report() == []


def test_a_patch_whose_target_is_missing_fails_the_set_too(make_module, registry):
    module = make_module(f=original)
    declared = patch_set(set_attribute(f"{module.__name__}:f", replace_with(replacement), name="first"),
                         set_attribute(f"{module.__name__}:NoSuchClass.attr", replace_with(1), name="second"))
    with pytest.raises(PatchError, match=r"patch 'second' .* failed: AttributeError: .*NoSuchClass"):
        registry.apply(declared, DEVICE)
    assert module.f is original


def test_a_target_that_moved_in_a_new_release_names_the_target_and_the_installed_version_and_applies_nothing(
        make_module, registry):
    """A test double of a framework module whose function was renamed by its next release."""
    framework = make_module(kept=original, step_v2=original)  # the release renamed step to step_v2
    declared = patch_set(set_attribute(f"{framework.__name__}:kept", replace_with(replacement), name="first"),
                         set_attribute(f"{framework.__name__}:step", replace_with(replacement), name="moved"),
                         requires=(Requirement("pluggy", f">={PLUGGY_MAJOR}"),))
    with pytest.raises(PatchError) as excinfo:
        registry.apply(declared, DEVICE)
    assert str(excinfo.value) == (
        f"patch 'moved' ({framework.__name__}:step) of set 'test-set' failed: AttributeError: {framework.__name__} "
        f"has no attribute 'step': the target moved or was removed (pluggy {PLUGGY} installed, for "
        f">={PLUGGY_MAJOR}). Nothing of this set was left applied.")
    assert framework.kept is original and framework.step_v2 is original and not hasattr(framework, "step")
    assert not registry.is_applied("test-set") and registry.report() == []


def test_a_gated_patch_for_other_releases_is_left_out_and_reported_while_its_set_applies(make_module, registry):
    """A fix for a bug only some releases in the set's range have: gate=True leaves it out elsewhere, named."""
    module = make_module(f=original, g=original, h=original)
    other = Requirement("pluggy", f"<{PLUGGY_MAJOR}", gate=True)
    this = Requirement("pluggy", f">={PLUGGY_MAJOR}", gate=True)
    declared = patch_set(set_attribute(f"{module.__name__}:f", replace_with(replacement), name="always"),
                         set_attribute(f"{module.__name__}:g", replace_with(replacement), name="old-bug",
                                       requires=(other,)),
                         set_attribute(f"{module.__name__}:h", replace_with(replacement), name="this-bug",
                                       requires=(this,)))
    assert registry.check(declared) == []  # a gate is never a reason to refuse the set
    registry.apply(declared, DEVICE)
    assert (module.f, module.g, module.h) == (replacement, original, replacement)
    assert [row["name"] for row in registry.report()] == ["always", "this-bug"]
    [skipped] = registry.disabled_report()
    assert skipped["set"] == "test-set" and skipped["patch"] == "old-bug"
    assert skipped["reason"] == (f"not for the installed version: patch 'old-bug' ({module.__name__}:g) supports "
                                 f"pluggy <{PLUGGY_MAJOR}, but pluggy {PLUGGY} is installed")
    ungated = patch_set(set_attribute(f"{module.__name__}:g", replace_with(replacement), name="old-bug",
                                      requires=(Requirement("pluggy", f"<{PLUGGY_MAJOR}"),)), name="strict-set")
    with pytest.raises(PatchError, match="supports pluggy"):  # without the gate the set is refused, as before
        registry.apply(ungated, DEVICE)


def test_a_failed_set_can_be_applied_later_once_its_problem_is_gone(make_module, registry):
    module = make_module(f=original)
    declared = patch_set(set_attribute(f"{module.__name__}:Later.attr", replace_with(replacement)))
    with pytest.raises(PatchError):
        registry.apply(declared, DEVICE)
    module.Later = type("Later", (), {"attr": None})
    registry.apply(declared, DEVICE)
    assert module.Later.attr is replacement


def test_a_target_must_name_module_and_attribute():
    with pytest.raises(ValueError, match=r"must look like 'package.module:attribute'"):
        resolve_target("json.dumps")
    owner, attr = resolve_target("json:JSONDecoder.decode")
    assert (owner.__name__, attr) == ("JSONDecoder", "decode")


# -- version gating --------------------------------------------------------------------------------


def test_a_set_for_versions_that_are_not_installed_is_refused_with_a_clear_message_and_changes_nothing(
        make_module, registry):
    module = make_module(f=original)
    made = []
    declared = patch_set(set_attribute(f"{module.__name__}:f", lambda old, device: made.append(old) or replacement),
                         requires=(Requirement("pluggy", f"<{PLUGGY_MAJOR}"),))
    with pytest.raises(PatchError) as excinfo:
        registry.apply(declared, DEVICE)
    assert str(excinfo.value) == (f"cannot apply devshim's 'test-set' patches: pluggy {PLUGGY} is installed, but "
                                  f"this patch set supports <{PLUGGY_MAJOR}.")
    assert made == [] and module.f is original


def test_a_set_applied_when_its_module_is_imported_waits_for_that_import(module_name, registry, tmp_path,
                                                                         monkeypatch):
    (tmp_path / f"{module_name}.py").write_text("def f():\n    return 'original'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    declared = patch_set(set_attribute(f"{module_name}:f", replace_with(replacement)))

    assert registry.apply_when_imported(declared, module_name, DEVICE) is True
    assert not registry.is_applied(declared.name)
    assert importlib.import_module(module_name).f is replacement
    assert registry.is_applied(declared.name)


def test_a_set_for_other_versions_is_not_applied_when_its_module_is_imported_and_is_not_refused(make_module,
                                                                                               registry):
    module = make_module(f=original)
    declared = patch_set(set_attribute(f"{module.__name__}:f", replace_with(replacement)),
                         requires=(Requirement("pluggy", f"<{PLUGGY_MAJOR}"),))

    assert registry.apply_when_imported(declared, module.__name__, DEVICE) is False
    assert module.f is original and not registry.is_applied(declared.name)


def test_the_version_of_the_code_imported_counts_over_the_installed_distributions(make_module, registry):
    """A source checkout on sys.path (``running``) runs another version than the installed metadata says."""
    assert Requirement("pluggy", f">={PLUGGY_MAJOR + 1}", running=lambda: f"{PLUGGY_MAJOR + 1}.0").problem() is None
    assert Requirement("pluggy", f"<{PLUGGY_MAJOR}", running=lambda: f"{PLUGGY_MAJOR - 1}.5").problem() is None
    unknown = Requirement("pluggy", f">={PLUGGY_MAJOR + 1}", running=lambda: None)  # falls back to the metadata
    assert unknown.problem() == f"pluggy {PLUGGY} is installed, but this patch set supports >={PLUGGY_MAJOR + 1}"

    module = make_module(f=original)
    declared = patch_set(set_attribute(f"{module.__name__}:f", replace_with(replacement)),
                         requires=(Requirement("pluggy", f"<{PLUGGY_MAJOR}", running=lambda: "0.1"),))
    assert registry.apply_when_imported(declared, module.__name__, DEVICE) is True
    assert module.f is replacement


def test_a_set_for_a_distribution_that_is_not_installed_is_refused(make_module, registry):
    module = make_module(f=original)
    declared = patch_set(set_attribute(f"{module.__name__}:f", replace_with(replacement)),
                         requires=(Requirement("devshim-no-such-distribution", ">=1"),))
    with pytest.raises(PatchError, match=r"devshim-no-such-distribution is not installed"):
        registry.apply(declared, DEVICE)


def test_every_unmet_requirement_is_named_at_once(registry):
    declared = patch_set(requires=(Requirement("pluggy", f">={PLUGGY_MAJOR + 1}"),
                                   Requirement("devshim-no-such-distribution", ">=1")))
    assert registry.check(declared) == [
        f"pluggy {PLUGGY} is installed, but this patch set supports >={PLUGGY_MAJOR + 1}",
        "devshim-no-such-distribution is not installed",
    ]


def test_a_set_for_the_installed_version_applies_and_its_report_lists_target_reason_detail_and_versions(
        make_module, registry):
    module = make_module(f=original)
    declared = patch_set(set_attribute(f"{module.__name__}:f", replace_with(replacement)),
                         requires=(Requirement("pluggy", f">={PLUGGY_MAJOR},<{PLUGGY_MAJOR + 1}"),))
    registry.apply(declared, DEVICE)
    assert registry.report() == [{
        "set": "test-set",
        "name": "swap",
        "target": f"{module.__name__}:f",
        "reason": "why swap exists",
        "detail": f"{module.__name__}:f set",
        "requires": {"pluggy": f">={PLUGGY_MAJOR},<{PLUGGY_MAJOR + 1}"},
        "versions": {"pluggy": PLUGGY},
    }]


# -- version gating of single patches ----------------------------------------------------------------


def test_a_patch_declared_without_requires_supports_every_version_and_its_fields_keep_their_order():
    positional = SetAttribute("swap", "json:dumps", replace_with(replacement), "why swap exists")
    assert positional.requires == ()
    assert positional == SetAttribute(name="swap", target="json:dumps", make=positional.make,
                                      reason="why swap exists")
    rebind = RebindReferences("rebind", "json", lambda device: [], "why rebind exists")
    assert rebind.requires == ()


def test_a_patch_for_the_installed_version_applies_and_its_report_row_shows_its_range_with_its_sets(
        make_module, registry):
    module = make_module(f=original, g=original)
    declared = patch_set(
        set_attribute(f"{module.__name__}:f", replace_with(replacement), name="plain"),
        set_attribute(f"{module.__name__}:g", replace_with(replacement), name="gated",
                      requires=(Requirement("pluggy", f"<{PLUGGY_MAJOR + 1}"), Requirement("pytest", ">=7"))),
        requires=(Requirement("pluggy", f">={PLUGGY_MAJOR}"),))
    registry.apply(declared, DEVICE)
    assert (module.f, module.g) == (replacement, replacement)
    plain, gated = registry.report()
    assert (plain["requires"], plain["versions"]) == ({"pluggy": f">={PLUGGY_MAJOR}"}, {"pluggy": PLUGGY})
    # both ranges had to hold for the gated patch: its row joins the clauses ("," is "and")
    assert gated["requires"] == {"pluggy": f">={PLUGGY_MAJOR},<{PLUGGY_MAJOR + 1}", "pytest": ">=7"}
    assert gated["versions"] == {"pluggy": PLUGGY, "pytest": pytest.__version__}
    assert version_in_range(PLUGGY, gated["requires"]["pluggy"])


def test_a_patch_for_versions_that_are_not_installed_refuses_its_whole_set_and_names_patch_range_and_version(
        make_module, registry):
    module = make_module(f=original, g=original)
    made = []
    declared = patch_set(
        set_attribute(f"{module.__name__}:f", lambda old, device: made.append("f") or replacement, name="first"),
        set_attribute(f"{module.__name__}:g", lambda old, device: made.append("g") or replacement, name="second",
                      requires=(Requirement("pluggy", f"<{PLUGGY_MAJOR}"),)))
    with pytest.raises(PatchError) as excinfo:
        registry.apply(declared, DEVICE)
    assert str(excinfo.value) == (f"cannot apply devshim's 'test-set' patches: patch 'second' ({module.__name__}:g) "
                                  f"supports pluggy <{PLUGGY_MAJOR}, but pluggy {PLUGGY} is installed.")
    assert made == []  # refused before anything was built: the in-range first patch was not applied either
    assert (module.f, module.g) == (original, original)
    assert not registry.is_applied("test-set") and registry.report() == []


def test_a_patch_for_a_distribution_that_is_not_installed_refuses_its_whole_set(make_module, registry):
    module = make_module(f=original)
    declared = patch_set(RebindReferences(name="rebind", scope=module.__name__,
                                          pairs=lambda device: [(original, replacement)], reason="r",
                                          requires=(Requirement("devshim-no-such-distribution", ">=1"),)))
    with pytest.raises(PatchError) as excinfo:
        registry.apply(declared, DEVICE)
    assert str(excinfo.value) == (f"cannot apply devshim's 'test-set' patches: patch 'rebind' ({module.__name__}.* "
                                  "(stale references)) supports devshim-no-such-distribution >=1, but "
                                  "devshim-no-such-distribution is not installed.")
    assert module.f is original and registry.report() == []


def test_every_unmet_requirement_of_a_set_and_of_its_patches_is_named_at_once(registry):
    declared = patch_set(set_attribute("json:dumps", replace_with(replacement), name="a",
                                       requires=(Requirement("pluggy", f">={PLUGGY_MAJOR + 1}"),)),
                         set_attribute("json:loads", replace_with(replacement), name="b"),
                         requires=(Requirement("devshim-no-such-distribution", ">=1"),))
    assert registry.check(declared) == [
        "devshim-no-such-distribution is not installed",
        f"patch 'a' (json:dumps) supports pluggy >={PLUGGY_MAJOR + 1}, but pluggy {PLUGGY} is installed",
    ]


@pytest.mark.parametrize(("requires", "complaint"), [
    (Requirement("pluggy", ">=1"), "patch 'swap' declares requires=Requirement(distribution='pluggy', spec='>=1'), "
                                   "which is not a tuple of devshim_core.patching.Requirement"),
    (("pluggy>=1",), "patch 'swap' declares requires=('pluggy>=1',), which is not a tuple of "
                     "devshim_core.patching.Requirement"),
    ((Requirement("pluggy", "1.0"),), "patch 'swap' declares an invalid version range: bad version clause '1.0' "
                                      "in '1.0'"),
])
def test_a_malformed_requires_refuses_the_set_with_a_patch_error_too(make_module, registry, requires, complaint):
    module = make_module(f=original)
    with pytest.raises(PatchError) as excinfo:
        registry.apply(patch_set(set_attribute(f"{module.__name__}:f", replace_with(replacement),
                                               requires=requires)), DEVICE)
    assert str(excinfo.value) == f"cannot apply devshim's 'test-set' patches: {complaint}."
    assert module.f is original


@pytest.mark.parametrize(("version", "spec", "expected"), [
    ("0.19.8", ">=0.19,<0.20", True),
    ("0.19.8+cpu", ">=0.19,<0.20", True),  # local version labels are ignored
    ("0.20.0", ">=0.19,<0.20", False),
    ("0.18.9", ">=0.19,<0.20", False),
    ("2.13.0+cpu", ">=2.4,<3", True),
    ("1.0", "==1.0.0", True),  # missing components are zeros
    ("1.0.1", "==1.0", False),
    ("1.7.0", "!=1.7", False),
    ("1.7.0", " > 1.6 , <= 1.7 ", True),  # blanks around operators and clauses
    ("1.7.0", "<1.7", False),
    ("0.20.0rc1", ">=0.20", True),  # a pre-release counts as its release number
])
def test_version_in_range(version, spec, expected):
    assert version_in_range(version, spec) is expected


@pytest.mark.parametrize("spec", ["~=1.0", "1.0", ">=1.0,", ">=1.*", ""])
def test_a_malformed_version_range_is_an_error_naming_the_clause(spec):
    with pytest.raises(ValueError, match=r"bad version clause"):
        version_in_range("1.0", spec)


@pytest.mark.parametrize(("version", "parts"), [("0.19.8+cpu", (0, 19, 8)), ("2.13.0", (2, 13, 0)),
                                                ("1.0rc1", (1, 0)), ("1.2.post1", (1, 2)), ("3", (3,))])
def test_release_is_the_numeric_part_of_a_version(version, parts):
    assert release(version) == parts


# -- stale references ------------------------------------------------------------------------------


def test_rebinding_replaces_from_imports_and_aliases_by_identity_within_the_scope_and_reverts_them(make_module,
                                                                                                   registry):
    package = make_module(f=original)
    scope = package.__name__
    submodule = types.ModuleType(f"{scope}.user")
    vars(submodule).update(f=original, alias=original, lookalike=lambda: "original", untouched=print)
    sys.modules[submodule.__name__] = submodule
    outside = make_module(f=original)  # another package's copy is not in scope
    try:
        declared = patch_set(
            set_attribute(f"{scope}:f", replace_with(replacement)),
            RebindReferences(name="rebind", scope=scope, pairs=lambda device: [(original, replacement)],
                             reason="`from pkg import f` copied f before the patch"))
        applied = registry.apply(declared, DEVICE)
        assert (submodule.f, submodule.alias) == (replacement, replacement)
        assert submodule.lookalike() == "original" and submodule.untouched is print  # equal is not identical
        assert outside.f is original
        assert [p.detail for p in applied.applied] == [f"{scope}:f set", "2 references rebound"]
        assert registry.report()[1]["target"] == f"{scope}.* (stale references)"

        registry.revert("test-set")
        assert (package.f, submodule.f, submodule.alias) == (original, original, original)
    finally:
        sys.modules.pop(submodule.__name__, None)


def test_a_module_imported_while_applied_gets_the_original_back_on_revert(make_module, registry):
    """``from pkg import f`` run while the set is applied copies the replacement; after revert that copy would keep
    devshim's function in a process that no longer has devshim. Revert points it back at the original."""
    package = make_module(f=original)
    scope = package.__name__
    rebind = RebindReferences(name="rebind", scope=scope, pairs=lambda device: [(original, replacement)], reason="r")
    registry.apply(patch_set(set_attribute(f"{scope}:f", replace_with(replacement)), rebind), DEVICE)
    later = types.ModuleType(f"{scope}.imported_later")
    vars(later).update(f=package.f)  # what `from pkg import f` binds now
    sys.modules[later.__name__] = later
    try:
        assert later.f is replacement
        registry.revert("test-set")
        assert (package.f, later.f) == (original, original)
    finally:
        sys.modules.pop(later.__name__, None)


def test_values_that_are_not_unique_objects_are_never_rebound(make_module, registry):
    module = make_module(none=None, number=1, flag=True, text="cpu")
    declared = patch_set(RebindReferences(name="rebind", scope=module.__name__,
                                          pairs=lambda device: [(None, 0), (1, 2), (True, False), ("cpu", "npu")],
                                          reason="nothing to do"))
    applied = registry.apply(declared, DEVICE)
    assert applied.applied[0].detail == "0 references rebound"
    assert (module.none, module.number, module.flag, module.text) == (None, 1, True, "cpu")


def test_rebinding_never_calls_a_module_getattr_hook(make_module, registry):
    asked = []
    module = make_module(f=original, __getattr__=lambda name: asked.append(name))
    registry.apply(patch_set(RebindReferences(name="rebind", scope=module.__name__,
                                              pairs=lambda device: [(original, replacement)], reason="r")), DEVICE)
    assert module.f is replacement
    assert asked == []


# -- providing modules ---------------------------------------------------------------------------


def provide(fallbacks=lambda device: {}, modules=lambda device: {}, blocked=None) -> PatchSet:
    return patch_set(ProvideModules(name="provide", modules=modules, blocked=blocked or {}, fallbacks=fallbacks,
                                    reason="stand in for what may be missing"))


@pytest.fixture
def module_name():
    name = f"devshim_provided_{next(_counter)}"
    yield name
    sys.modules.pop(name, None)


def test_a_fallback_module_is_imported_when_no_real_module_exists_and_is_gone_after_revert(module_name, registry):
    stand_in = types.ModuleType(module_name, "stand-in")
    registry.apply(provide(fallbacks=lambda device: {module_name: stand_in}), DEVICE)
    assert module_name not in sys.modules  # served on import, not planted
    assert importlib.import_module(module_name) is stand_in

    registry.revert_all()
    assert module_name not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(module_name)


def test_a_real_module_that_appears_on_sys_path_after_activation_wins_over_the_fallback(module_name, registry,
                                                                                       tmp_path, monkeypatch):
    stand_in = types.ModuleType(module_name, "stand-in")
    registry.apply(provide(fallbacks=lambda device: {module_name: stand_in}), DEVICE)
    (tmp_path / f"{module_name}.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()

    assert importlib.import_module(module_name).REAL is True


def test_a_provided_module_is_planted_ahead_of_a_real_one_and_a_blocked_one_fails_as_not_installed(
        module_name, registry, tmp_path, monkeypatch):
    (tmp_path / f"{module_name}.py").write_text("REAL = True\n")
    (tmp_path / f"{module_name}_blocked.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    stand_in = types.ModuleType(module_name, "stand-in")
    registry.apply(provide(modules=lambda device: {module_name: stand_in},
                           blocked={f"{module_name}_blocked": "CUDA-only"}), DEVICE)

    assert importlib.import_module(module_name) is stand_in
    with pytest.raises(ModuleNotFoundError, match="CUDA-only"):
        importlib.import_module(f"{module_name}_blocked")
    registry.revert_all()
    assert importlib.import_module(f"{module_name}_blocked").REAL is True
    sys.modules.pop(f"{module_name}_blocked")
