"""Declared patches: each names its target, the versions it is valid for and why it exists.

Patches are grouped in patch sets (:class:`PatchSet`), applied all-or-nothing, idempotently, reversibly,
and recorded in the process-wide :data:`REGISTRY` that ``devshim info`` lists. A set's ``requires`` and
each patch's own ``requires`` are checked before anything changes: one unmet requirement refuses the
whole set, except a patch's *gate* (``Requirement(gate=True)``), which leaves that patch out, reported: a fix
for a bug only some releases in the set's range have. Declaring a patch changes nothing; only
:meth:`PatchRegistry.apply` does, and only ``devshim_core.auto`` calls it.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from devshim_core import import_hooks, log
from devshim_core.distributions import installed_version
from devshim_core.errors import PatchError

if TYPE_CHECKING:
    from devshim_core.device import Device

Undo = Callable[[], None]
logger = log.logger("patching")

# -- version ranges ----------------------------------------------------------------------------

_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*([0-9][0-9A-Za-z.+-]*)\s*$")


def release(version: str) -> tuple[int, ...]:
    """The numeric release part of a version string: '0.19.8+cpu' -> (0, 19, 8)."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = re.match(r"\d+", piece)
        if not digits:
            break
        parts.append(int(digits.group()))
        if digits.group() != piece:  # '0rc1': pre-release of this number, stop here
            break
    return tuple(parts)


def _cmp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    width = max(len(a), len(b))
    a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
    return (a > b) - (a < b)


def version_in_range(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies ``spec`` (comma-separated clauses such as '>=0.19,<0.20')."""
    have = release(version)
    for clause in spec.split(","):
        match = _CLAUSE.match(clause)
        if not match:
            raise ValueError(f"bad version clause {clause!r} in {spec!r}")
        op, bound = match.group(1), release(match.group(2))
        c = _cmp(have, bound)
        ok = {">=": c >= 0, "<=": c <= 0, "==": c == 0, "!=": c != 0, ">": c > 0, "<": c < 0}[op]
        if not ok:
            return False
    return True


@dataclass(frozen=True)
class Requirement:
    """A distribution and the version range a patch set (or one patch) was written and tested for.

    ``running``, when given, reads the version of the code actually imported (without importing anything) and
    returns ``None`` when it cannot tell: a source checkout on ``sys.path`` runs code that the installed
    distribution's metadata does not describe.
    """

    distribution: str
    spec: str
    running: Callable[[], str | None] | None = field(default=None, compare=False, repr=False)
    # on a patch: outside the range the patch is left out (and reported), instead of refusing its set
    gate: bool = field(default=False, repr=False)

    def installed(self) -> str | None:
        return (self.running and self.running()) or installed_version(self.distribution)

    def problem(self) -> str | None:
        version = self.installed()
        if version is None:
            return f"{self.distribution} is not installed"
        if not version_in_range(version, self.spec):
            return f"{self.distribution} {version} is installed, but this patch set supports {self.spec}"
        return None

    def problem_for_patch(self, patch: Patch) -> str | None:
        """Like :meth:`problem`, for a requirement of one patch: names the patch, the range and what is installed."""
        version = self.installed()
        if version is not None and version_in_range(version, self.spec):
            return None
        installed = "is not installed" if version is None else f"{version} is installed"
        return (f"patch {patch.name!r} ({patch.target_description()}) supports {self.distribution} {self.spec}, "
                f"but {self.distribution} {installed}")


# -- patches -----------------------------------------------------------------------------------


def resolve_target(target: str) -> tuple[Any, str]:
    """'pkg.mod:Cls.attr' -> (the object holding the attribute, 'attr'). Imports ``pkg.mod``."""
    module_name, _, path = target.partition(":")
    if not path:
        raise ValueError(f"patch target {target!r} must look like 'package.module:attribute'")
    owner: Any = importlib.import_module(module_name)
    *parents, attr = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, attr


_MISSING = object()


class Patch(ABC):
    """One change to the running program, with how to undo it.

    ``requires``: the versions this patch was written for, checked with its set's before anything is applied
    (a plugin's patches form a set without ``requires`` of its own, so a vendor patch is version-gated here).
    """

    name: str
    reason: str
    requires: tuple[Requirement, ...] = ()

    @abstractmethod
    def target_description(self) -> str: ...

    @abstractmethod
    def apply(self, device: Device) -> tuple[Undo, str]:
        """Make the change; return how to undo it and a one-line account of what was done."""


@dataclass(frozen=True)
class SetAttribute(Patch):
    """Replace ``target`` with ``make(original, device)``. For a class, an attribute inherited from a base counts,
    and revert removes the override.

    A target that does not exist fails the set, naming it: the function a patch wraps has usually moved in a
    new release, and wrapping nothing would change nothing. ``creates=True`` declares a patch that adds the
    attribute (``original`` is then ``None``) and removes it on revert.
    """

    name: str
    target: str
    make: Callable[[Any, Device], Any]
    reason: str
    requires: tuple[Requirement, ...] = ()  # after the required fields: positional declarations keep working
    creates: bool = False

    def target_description(self) -> str:
        return self.target

    def apply(self, device: Device) -> tuple[Undo, str]:
        owner, attr = resolve_target(self.target)
        original = owner.__dict__.get(attr, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, attr)
        current = original
        if original is _MISSING and isinstance(owner, type):  # inherited: make() wraps what lookups find
            current = getattr(owner, attr, _MISSING)
        if current is _MISSING and not self.creates:
            raise AttributeError(f"{getattr(owner, '__name__', owner)!s} has no attribute {attr!r}: the target "
                                 "moved or was removed")
        replacement = self.make(None if current is _MISSING else current, device)
        setattr(owner, attr, replacement)

        def undo() -> None:
            if original is _MISSING:
                if attr in getattr(owner, "__dict__", {}):
                    delattr(owner, attr)
            else:
                setattr(owner, attr, original)

        return undo, f"{self.target} set"


@dataclass(frozen=True)
class SetAttributes(Patch):
    """Replace several attributes of one object at once: ``make(originals, device)`` receives
    ``{name: original or None}`` for ``names`` and returns ``{name: replacement}`` (a name it leaves out is
    not touched). One patch, one report row: ``torch.cuda`` gets forty names from one source of truth."""

    name: str
    target: str  # 'package.module' or 'package.module:Class'
    names: tuple[str, ...]
    make: Callable[[dict[str, Any], Device], dict[str, Any]]
    reason: str
    requires: tuple[Requirement, ...] = ()

    def target_description(self) -> str:
        return f"{self.target.replace(':', '.')}.{{{', '.join(sorted(self.names))}}}"

    def apply(self, device: Device) -> tuple[Undo, str]:
        module_name, _, path = self.target.partition(":")
        owner: Any = importlib.import_module(module_name)
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part)
        own = owner.__dict__ if isinstance(owner, type) else vars(owner)
        originals = {n: own.get(n, getattr(owner, n, None) if isinstance(owner, type) else None) for n in self.names}
        saved = {n: own.get(n, _MISSING) for n in self.names}
        replacements = self.make(originals, device)
        for attr, value in replacements.items():
            setattr(owner, attr, value)

        def undo() -> None:
            for attr in replacements:
                if saved[attr] is _MISSING:
                    if attr in owner.__dict__:
                        delattr(owner, attr)
                else:
                    setattr(owner, attr, saved[attr])

        return undo, f"{len(replacements)} of {len(self.names)} names set"


@dataclass(frozen=True)
class SetEnvironment(Patch):
    """Set environment variables a framework insists on, unless the user set them (theirs win)."""

    name: str
    values: Mapping[str, str]
    reason: str
    requires: tuple[Requirement, ...] = ()

    def target_description(self) -> str:
        return "os.environ: " + ", ".join(f"{k}={v}" for k, v in self.values.items())

    def apply(self, device: Device) -> tuple[Undo, str]:
        added = {k: v for k, v in self.values.items() if k not in os.environ}
        os.environ.update(added)

        def undo() -> None:
            for key, value in added.items():
                if os.environ.get(key) == value:
                    del os.environ[key]

        kept = sorted(set(self.values) - set(added))
        return undo, f"set {', '.join(sorted(added)) or 'nothing'}" + (f"; kept the user's {', '.join(kept)}" if kept
                                                                         else "")


@dataclass(frozen=True)
class RunAtExit(Patch):
    """Register ``make(device)`` with :mod:`atexit`; undo unregisters it.

    atexit runs its callbacks last-registered first, so one registered when devshim activates (the first line
    of a script) runs after the script's own and the frameworks' exit callbacks, and before finalization.
    """

    name: str
    make: Callable[[Device], Callable[[], None]]
    reason: str
    requires: tuple[Requirement, ...] = ()

    def target_description(self) -> str:
        return "atexit (interpreter exit, before finalization)"

    def apply(self, device: Device) -> tuple[Undo, str]:
        callback = self.make(device)
        atexit.register(callback)
        return (lambda: atexit.unregister(callback)), f"registered {getattr(callback, '__qualname__', callback)}"


def _code_of(owner: Any, name: str) -> Any:
    return getattr(getattr(owner, name, None), "__code__", None)


class _BlockingFinder(importlib.abc.MetaPathFinder):
    """Make ``import name`` fail as "not installed" (ModuleNotFoundError), with a reason; a probe gets None.

    Raising from find_spec is how the reason reaches the ImportError, but ``importlib.util.find_spec`` must answer
    None for a module that is not there (transformers probes flash_attn, apex, ... that way): the finder raises only
    when the import machinery is loading the name, and returns None to a probe (:meth:`_asked_to_load`). A probe then
    goes on to the later finders, so a blocked module that is installed is found by it, as installed; importing it
    still raises. The answer depends on the calling thread's own stack: no state is shared between threads.
    """

    # The import machinery's frames (importlib._bootstrap is the frozen _frozen_importlib; CPython 3.10-3.13): every
    # meta-path finder is asked from _find_spec. The import statement, importlib.import_module and __import__ reach
    # it through _find_and_load_unlocked, importlib.reload calls it itself; importlib.util.find_spec (pkgutil, runpy
    # and every "is it installed?" check go through it) and importlib.find_loader call it to probe.
    _FIND_SPEC = _code_of(importlib._bootstrap, "_find_spec")
    _LOADING = frozenset({_code_of(importlib._bootstrap, "_find_and_load_unlocked"), _code_of(importlib, "reload")})

    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        reason = self.names.get(fullname.partition(".")[0])
        if reason is not None and self._asked_to_load():
            from devshim_core import migration_log

            if (log := migration_log.recorder()) is not None:  # DEVSHIM_MIGRATION_LOG: the import, where it was made
                log.blocked_import(fullname, reason)
            raise ModuleNotFoundError(f"No module named {fullname!r} ({reason})", name=fullname)
        return None

    @classmethod
    def _asked_to_load(cls) -> bool:
        """Whether the nearest ``_find_spec`` up this thread's stack was called to load a module, not to probe.
        True also where the machinery is not recognised (another interpreter or layout): raising is the safe side."""
        if cls._FIND_SPEC is None or None in cls._LOADING:
            return True
        frame = sys._getframe(1).f_back  # find_spec's caller: _find_spec, or a finder asking the others (import_hooks)
        while frame is not None and frame.f_code is not cls._FIND_SPEC:
            frame = frame.f_back
        if frame is None:  # find_spec called directly, not through the machinery: a probe
            return False
        return frame.f_back is not None and frame.f_back.f_code in cls._LOADING


class _FallbackFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serve prepared modules for names that no finder before it on ``sys.meta_path`` finds.

    Appended last, it is asked at import time, so a real module that appears later (a checkout put on
    ``sys.path`` after activation) still wins.
    """

    def __init__(self, modules: dict[str, ModuleType]) -> None:
        self.modules = modules

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.modules[spec.name]

    def exec_module(self, module: ModuleType) -> None:
        """The module is built already."""


@dataclass(frozen=True)
class ProvideModules(Patch):
    """Provide stand-in modules and make others unimportable, before a framework imports them.

    ``modules(device)`` returns ``{name: module}`` put into ``sys.modules`` at once, ahead of any real module
    of that name (a name already imported is left alone). ``fallbacks(device)`` returns stand-ins for modules
    that may be missing: each is served only when no other finder finds the name at import time. ``blocked``
    maps top-level module names to why they cannot work here: importing one (or a submodule) raises
    ModuleNotFoundError with that reason, which frameworks already catch to take their fallback, instead of a CUDA
    error or a crash later. A probe is not refused: ``importlib.util.find_spec`` of a blocked name answers None,
    or the spec of a module of that name installed on disk (which still cannot be imported); a submodule's probe
    imports its parent, which raises, as for any missing parent.
    """

    name: str
    modules: Callable[[Device], dict[str, Any]]
    blocked: Mapping[str, str]
    reason: str
    requires: tuple[Requirement, ...] = ()
    fallbacks: Callable[[Device], dict[str, ModuleType]] = lambda device: {}

    def target_description(self) -> str:
        return f"sys.modules: {', '.join(sorted(self.blocked))} blocked" if self.blocked else "sys.modules"

    def apply(self, device: Device) -> tuple[Undo, str]:
        provided = {n: m for n, m in self.modules(device).items() if n not in sys.modules}
        for name, module in provided.items():
            # importlib.util.find_spec of a name in sys.modules returns its __spec__ and raises ValueError when that
            # is None, as a bare ModuleType's is: a library's probe (transformers makes them) must get a spec
            if getattr(module, "__spec__", None) is None:
                module.__spec__ = importlib.machinery.ModuleSpec(
                    name, None, origin="devshim", is_package=hasattr(module, "__path__"))
        sys.modules.update(provided)
        blocking = _BlockingFinder(dict(self.blocked))
        sys.meta_path.insert(0, blocking)
        fallbacks = {n: m for n, m in self.fallbacks(device).items() if n not in sys.modules}
        fallback = _FallbackFinder(fallbacks)
        sys.meta_path.append(fallback)

        def undo() -> None:
            for finder in (blocking, fallback):
                if finder in sys.meta_path:
                    sys.meta_path.remove(finder)
            for name, module in (provided | fallbacks).items():
                if sys.modules.get(name) is module:
                    del sys.modules[name]

        detail = f"provided {', '.join(sorted(provided)) or 'nothing'}"
        if fallbacks:
            detail += f"; fallback for {', '.join(sorted(fallbacks))}"
        return undo, f"{detail}; {len(self.blocked)} blocked"


@dataclass(frozen=True)
class RebindReferences(Patch):
    """Find module-level names under ``scope`` that *are* (by identity) an old object and point them at its
    replacement: ``from x import f`` copies and aliases survive a plain attribute patch otherwise. Undo points every
    name in scope that is the replacement back at the original, those copied by modules imported in between too.

    ``pairs(device)`` returns the (old, new) objects; modules are scanned with ``vars()`` (never
    ``getattr``: module ``__getattr__`` hooks have side effects). ``scope`` is a package name, or ``"*"`` for
    every loaded module outside ``exclude`` (package names).
    """

    name: str
    scope: str
    pairs: Callable[[Device], Iterable[tuple[Any, Any]]]
    reason: str
    requires: tuple[Requirement, ...] = ()
    exclude: tuple[str, ...] = ()

    def target_description(self) -> str:
        return f"{self.scope}.* (stale references)" if self.scope != "*" else "every loaded module (stale references)"

    def namespaces(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """``(name, vars(module))`` of each loaded module in scope."""
        for module_name, module in list(sys.modules.items()):
            if module is None or not self._in_scope(module_name):
                continue
            try:
                namespace = vars(module)
            except TypeError:  # sys.modules may hold objects without a namespace
                continue
            yield module_name, namespace

    def _in_scope(self, module_name: str) -> bool:
        if any(module_name == e or module_name.startswith(e + ".") for e in self.exclude):
            return False
        return self.scope == "*" or module_name == self.scope or module_name.startswith(self.scope + ".")

    def apply(self, device: Device) -> tuple[Undo, str]:
        # values that are not unique objects (None, small ints, interned strings) cannot be matched by identity
        mapping = {id(old): (old, new) for old, new in self.pairs(device)
                   if old is not new and old is not None and not isinstance(old, (bool, int, float, str, bytes))}
        done: list[tuple[Any, str, Any]] = []
        back = {id(new): (new, old) for old, new in mapping.values()}
        homes: set[tuple[str, str]] = set()  # names that held a replacement already: its own module's, a plugin's
        if mapping:
            for module_name, namespace in self.namespaces():
                for key, value in list(namespace.items()):
                    hit = mapping.get(id(value))
                    if hit is not None and hit[0] is value:
                        namespace[key] = hit[1]
                        done.append((namespace, key, value))
                    elif id(value) in back and back[id(value)][0] is value:
                        homes.add((module_name, key))

        def undo() -> None:
            for namespace, key, value in reversed(done):
                namespace[key] = value
            if not back:
                return
            # a module imported while the patch was applied copied the replacement itself (``from x import f``):
            # it gets the original back too, or it would keep devshim's function after deactivation
            for module_name, namespace in self.namespaces():
                for key, value in list(namespace.items()):
                    hit = back.get(id(value))
                    if hit is not None and hit[0] is value and (module_name, key) not in homes:
                        namespace[key] = hit[1]

        return undo, f"{len(done)} references rebound"


def replaced_functions(*targets: str) -> Callable[[Device], list[tuple[Any, Any]]]:
    """``pairs`` for :class:`RebindReferences`: (original, replacement) for each ``'module:attr'`` that a
    :class:`SetAttribute` replaced with a function carrying ``__devshim_original__``."""

    def pairs(device: Device) -> list[tuple[Any, Any]]:
        found = []
        for target in targets:
            module_name, _, attr = target.partition(":")
            new = getattr(sys.modules[module_name], attr)
            found.append((getattr(new, "__devshim_original__", None), new))
        return found

    return pairs


NAME_PATTERN = re.compile(r"^[a-z0-9_]+(?:[.-][a-z0-9_]+)*$")


@dataclass(frozen=True)
class PatchSet:
    """Patches that only make sense together, for the versions in ``requires`` (and each patch's own).

    Names follow one convention, :data:`NAME_PATTERN`: lower-case words joined by ``-`` (a dotted module path such as
    ``torch.distributed`` may lead), the integration's name first (``megatron-core-jit``, ``plugin-ascend``), and no
    ``:``, which separates a set from a patch in ``DEVSHIM_DISABLE=set:patch``."""

    name: str
    requires: tuple[Requirement, ...]
    patches: Sequence[Patch]
    reason: str


@dataclass
class AppliedPatch:
    patch: Patch
    detail: str
    undo: Undo = field(repr=False)


@dataclass
class AppliedPatchSet:
    patch_set: PatchSet
    applied: list[AppliedPatch]
    versions: dict[str, str | None]
    disabled: str | None = None  # why the whole set was left out (DEVSHIM_DISABLE); nothing of it is applied


class PatchRegistry:
    """What is applied in this process, in order; the single place that changes anything.

    Sets and single patches can be disabled by name (:meth:`disable`, from ``DEVSHIM_DISABLE``): a disabled set is
    never applied, and a set one of whose patches is disabled is applied without it. Both are reported
    (:meth:`disabled_report`)."""

    def __init__(self) -> None:
        self._applied: dict[str, AppliedPatchSet] = {}
        self._lock = threading.RLock()
        self._disabled: dict[str, str] = {}  # "set" or "set:patch" -> why
        self._skipped: dict[str, str] = {}  # what was left out, when a set came to be applied -> why
        self._gated: list[tuple[PatchSet, Patch]] = []  # patches left out as written for other releases

    def disable(self, names: Mapping[str, str]) -> None:
        """Leave out the sets and ``set:patch`` entries named (mapping each to why, e.g. ``DEVSHIM_DISABLE=x``) from
        every later :meth:`apply`; replaces what an earlier call disabled."""
        with self._lock:
            self._disabled = dict(names)

    def disabled_report(self) -> list[dict[str, str | None]]:
        """One row per set or patch left out because it was disabled, or (a patch) gated to other versions: ``set``,
        ``patch`` (``None`` for a whole set) and ``reason``."""
        rows: list[dict[str, str | None]] = []
        for key, why in self._skipped.items():
            set_name, _, patch = key.partition("\0")
            rows.append({"set": set_name, "patch": patch or None, "reason": why})
        return rows

    def is_applied(self, name: str) -> bool:
        return name in self._applied

    def applied_sets(self) -> list[AppliedPatchSet]:
        """The applied sets, in the order they were applied."""
        with self._lock:
            return list(self._applied.values())

    def check(self, patch_set: PatchSet) -> list[str]:
        """Every unmet requirement of ``patch_set`` and of its patches, in declaration order."""
        problems = [_unmet(r, patch_set) for r in patch_set.requires]
        for patch in patch_set.patches:
            requires = patch.requires
            # a plugin's declaration is checked here, where a mistake can still be reported as a PatchError
            if not isinstance(requires, (tuple, list)) or not all(isinstance(r, Requirement) for r in requires):
                problems.append(f"patch {patch.name!r} declares requires={requires!r:.120}, which is not a tuple "
                                "of devshim_core.patching.Requirement")
                continue
            problems.extend(_unmet(r, patch_set, patch) for r in requires if not r.gate)
        return [p for p in problems if p]

    def apply_when_imported(self, patch_set: PatchSet, module: str, device: Device) -> bool:
        """Apply ``patch_set`` once ``module`` is imported (now, if it is), if the versions then imported meet
        its requirements; returns False when it was checked now and not applied. A set for other versions
        stays out of the report instead of being refused: it exists for releases the user does not have. The
        versions are checked at import, not before, so that a requirement's ``running`` version can count."""

        def apply_if_supported(imported: Any) -> None:
            if not self.is_applied(patch_set.name) and not self.check(patch_set):
                self.apply(patch_set, device)

        import_hooks.after_import(module, apply_if_supported)
        return not import_hooks.is_imported(module) or self.is_applied(patch_set.name)

    def apply(self, patch_set: PatchSet, device: Device) -> AppliedPatchSet:
        """Apply every patch of ``patch_set`` or none of them. Applying an applied set does nothing."""
        with self._lock:
            if patch_set.name in self._applied:
                return self._applied[patch_set.name]
            why = self._disabled.get(patch_set.name)
            if why is not None:
                self._skipped[patch_set.name] = why
                logger.debug("patch set %s not applied: %s", patch_set.name, why)
                return AppliedPatchSet(patch_set, [], {}, disabled=why)
            patch_set = self._without_gated_patches(self._without_disabled_patches(patch_set))
            problems = self.check(patch_set)
            if problems:
                raise PatchError(f"cannot apply devshim's {patch_set.name!r} patches: {'; '.join(problems)}.")
            applied: list[AppliedPatch] = []
            for patch in patch_set.patches:
                try:
                    undo, detail = patch.apply(device)
                except Exception as exc:
                    for done in reversed(applied):
                        done.undo()
                    raise PatchError(f"patch {patch.name!r} ({patch.target_description()}) of set "
                                     f"{patch_set.name!r} failed: {type(exc).__name__}: {exc}"
                                     f"{_installed_versions(patch_set, patch)}. "
                                     "Nothing of this set was left applied.") from exc
                applied.append(AppliedPatch(patch, detail, undo))
                logger.debug("applied %s:%s (%s): %s", patch_set.name, patch.name, patch.target_description(), detail)
            record = AppliedPatchSet(patch_set, applied,
                                     {r.distribution: r.installed() for r in _requirements(patch_set)})
            self._applied[patch_set.name] = record
            return record

    def _without_disabled_patches(self, patch_set: PatchSet) -> PatchSet:
        return self._leave_out(patch_set, lambda patch: self._disabled.get(f"{patch_set.name}:{patch.name}"))

    def _without_gated_patches(self, patch_set: PatchSet) -> PatchSet:
        def why(patch: Patch) -> str | None:
            requires = patch.requires if isinstance(patch.requires, (tuple, list)) else ()  # check() names the mistake
            gates = [r for r in requires if isinstance(r, Requirement) and r.gate]
            problem = next((problem for r in gates if (problem := _unmet(r, patch_set, patch))), None)
            return None if problem is None else f"not for the installed version: {problem}"

        return self._leave_out(patch_set, why, gated=True)

    def _leave_out(self, patch_set: PatchSet, why_out: Callable[[Patch], str | None], gated: bool = False) -> PatchSet:
        """``patch_set`` without the patches ``why_out`` gives a reason for, each recorded with it (and, ``gated``,
        kept for :meth:`gated_report`)."""
        kept = []
        for patch in patch_set.patches:
            why = why_out(patch)
            if why is None:
                kept.append(patch)
                continue
            self._skipped[f"{patch_set.name}\0{patch.name}"] = why
            if gated:
                self._gated.append((patch_set, patch))
            logger.debug("patch %s:%s not applied: %s", patch_set.name, patch.name, why)
        if len(kept) == len(patch_set.patches):
            return patch_set
        return dataclasses.replace(patch_set, patches=tuple(kept))

    def revert(self, name: str) -> bool:
        with self._lock:
            record = self._applied.pop(name, None)
            if record is None:
                return False
            for done in reversed(record.applied):
                done.undo()
            return True

    def revert_all(self) -> None:
        for name in reversed(list(self._applied)):
            self.revert(name)
        self._skipped.clear()
        self._gated.clear()

    def report(self) -> list[dict[str, Any]]:
        """One row per applied patch. ``requires`` is the range each distribution had to be in for this patch:
        its set's and its own clauses joined (both had to hold); ``versions`` what was installed."""
        rows = []
        for record in self._applied.values():
            for done in record.applied:
                requires = _joined_specs((*record.patch_set.requires, *done.patch.requires))
                rows.append({
                    "set": record.patch_set.name,
                    "name": done.patch.name,
                    "target": done.patch.target_description(),
                    "reason": done.patch.reason,
                    "detail": done.detail,
                    "requires": requires,
                    "versions": {name: record.versions.get(name) for name in requires},
                })
        return rows


    def gated_report(self) -> list[dict[str, Any]]:
        """One row per patch left out because its gate is for other releases, in :meth:`report`'s shape (``detail``
        says so, ``versions`` what is installed): the declarations a table of every patch must still list."""
        rows = []
        for patch_set, patch in self._gated:
            requires = _joined_specs((*patch_set.requires, *patch.requires))
            installed = {r.distribution: r.installed() for r in (*patch_set.requires, *patch.requires)}
            rows.append({"set": patch_set.name, "name": patch.name, "target": patch.target_description(),
                         "reason": patch.reason, "detail": "not applied: written for other releases",
                         "requires": requires, "versions": {name: installed.get(name) for name in requires}})
        return rows


def _unmet(requirement: Requirement, patch_set: PatchSet, patch: Patch | None = None) -> str | None:
    """Why ``requirement`` (of ``patch``, else of the set) is not met, or ``None``."""
    try:
        return requirement.problem() if patch is None else requirement.problem_for_patch(patch)
    except ValueError as exc:  # a malformed range is a mistake of the declaration: refused like an unmet one
        owner = f"patch set {patch_set.name!r}" if patch is None else f"patch {patch.name!r}"
        return f"{owner} declares an invalid version range: {exc}"


def _installed_versions(patch_set: PatchSet, patch: Patch) -> str:
    """' (deepspeed 0.19.8 installed, for >=0.16,<0.20)': a target that moved is usually a new release's doing."""
    requirements = [*patch_set.requires, *patch.requires]
    if not requirements:
        return ""
    parts = [f"{name} {next(r for r in requirements if r.distribution == name).installed() or 'not'} installed, "
             f"for {spec}" for name, spec in _joined_specs(requirements).items()]
    return f" ({'; '.join(parts)})"


def _requirements(patch_set: PatchSet) -> list[Requirement]:
    return [*patch_set.requires, *(r for patch in patch_set.patches for r in patch.requires)]


def _joined_specs(requirements: Iterable[Requirement]) -> dict[str, str]:
    """distribution -> its clauses, comma-joined: a comma means "and" in :func:`version_in_range`. A patch's gate,
    narrower than its set's range, is shown alone: it is the range the patch is for."""
    specs: dict[str, list[str]] = {}
    for r in requirements:
        if r.gate:
            specs[r.distribution] = [r.spec]
        elif r.spec not in specs.setdefault(r.distribution, []):
            specs[r.distribution].append(r.spec)
    return {name: ",".join(clauses) for name, clauses in specs.items()}


REGISTRY = PatchRegistry()
