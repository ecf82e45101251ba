"""Every ``DEVSHIM_*`` environment variable, declared once: its kind, default, allowed values and one line of doc.

The user guide's table of switches is generated from :data:`SWITCHES` (``devshim settings --markdown``; CI fails when
the committed table is stale). At activation :func:`check_environment` refuses a bad value of any declared variable,
naming it and what it allows, and warns about a ``DEVSHIM_*`` name that is declared nowhere, naming the nearest one:
a misspelled switch must not be ignored in silence. Variables read outside devshim-core (the CPU plugin's, the
kernels', the emulator's) are declared here too, so that one table lists them all; their readers parse them.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from devshim_core import log
from devshim_core.env_values import FALSE, TRUE
from devshim_core.errors import ConfigError

PREFIX = "DEVSHIM_"
BOOLEAN = "1 or 0 (also true/false, yes/no, on/off)"


def _bool(raw: str) -> bool:
    return raw.strip().lower() in TRUE | FALSE


def _count(raw: str) -> bool:
    return raw.strip().isdigit() and int(raw) >= 1


def _indices(raw: str) -> bool:
    return all(item.strip().isdigit() for item in raw.split(",") if item.strip())


def _patch_names(raw: str) -> bool:
    """``set[:patch],...``: names of integrations, patch sets (which may contain ``:``, ``.`` and ``-``) and patches."""
    return all(item.strip() and all(part.strip() and not any(c.isspace() for c in part.strip())
                                    for part in item.split(":"))
               for item in raw.split(",") if item.strip())


def _anything(raw: str) -> bool:
    return True


# checked where Settings.from_env parses it (settings.py), with a message of its own, before check_environment runs
PARSED = _anything


@dataclass(frozen=True)
class Switch:
    """One ``DEVSHIM_*`` variable. ``takes`` says in words what a value may be; ``valid`` checks a non-empty value;
    ``read_by`` names who parses it (the distribution or module), for the docs."""

    name: str
    takes: str
    default: str
    doc: str
    valid: Callable[[str], bool] = _anything
    read_by: str = "devshim-core"


SWITCHES: tuple[Switch, ...] = (
    # -- activation and selection
    Switch("DEVSHIM_AUTO", BOOLEAN, "0", "activate devshim in every process that imports torch, when it does "
           "(launchers, spawned workers)", _bool),
    Switch("DEVSHIM_PLUGIN", "a plugin name, or name@distribution", "unset", "force one plugin (the only one then "
           "loaded and detected); name@distribution picks one of two distributions registering that name", PARSED),
    Switch("DEVSHIM_DISABLED_PLUGINS", "comma-separated plugin names", "unset", "never load these plugins", PARSED),
    Switch("DEVSHIM_DISABLE_PLUGIN_AUTOLOAD", BOOLEAN, "0", "load only the plugins named in DEVSHIM_PLUGINS (plus a "
           "forced one)", _bool),
    Switch("DEVSHIM_PLUGINS", "comma-separated plugin names", "unset", "the plugins loaded when "
           "DEVSHIM_DISABLE_PLUGIN_AUTOLOAD=1; each must be installed", PARSED),
    Switch("DEVSHIM_REQUIRE_DEVICE", "a torch device type (npu, cuda, tpu, cpu, ...)", "unset", "the job must run on "
           "this device type: selecting another is an error; a match also silences the fallback line", PARSED),
    Switch("DEVSHIM_DETECT_TIMEOUT", "seconds (0: no limit)", "10", "how long each plugin's detection may take before "
           "it is passed over as timed out", PARSED),
    # -- what is patched
    Switch("DEVSHIM_DISABLE", "comma-separated integration, patch-set or set:patch names", "unset", "turn off an "
           "integration, a patch set or one patch (`devshim patches` lists their names), e.g. "
           "megatron-core:fused-attention", _patch_names),
    Switch("DEVSHIM_PATCH_DEEPSPEED", BOOLEAN, "1", "0: do not patch DeepSpeed (an alias of DEVSHIM_DISABLE=deepspeed)",
           _bool),
    Switch("DEVSHIM_PATCH_MEGATRON", BOOLEAN, "1", "0: do not patch Megatron (an alias of DEVSHIM_DISABLE=megatron)",
           _bool),
    Switch("DEVSHIM_REDIRECT_CUDA", BOOLEAN, "1", "0: do not redirect torch.cuda.*, 'cuda' devices and nccl to the "
           "selected device (an alias of DEVSHIM_DISABLE=cuda-redirect); never applied on a CUDA device", _bool),
    Switch("DEVSHIM_PATCH_DISTRIBUTED", BOOLEAN, "1", "0: leave torch.distributed as it is (no exit callback, "
           "shared-memory collectives, named timeouts or plugin agreement)", _bool),
    Switch("DEVSHIM_SHARED_MEMORY_COLLECTIVES", BOOLEAN, "1", "0: keep gloo's TCP transport for CPU "
           "collectives between ranks of one host (set it alike on every rank)", _bool),
    Switch("DEVSHIM_CUDA_FACADE", BOOLEAN, "0", "on a CUDA device, route DeepSpeed through devshim's accelerator and "
           "op builders instead of standing aside", _bool),
    Switch("DEVSHIM_MIGRATION_LOG", "a file path; {rank} in it is replaced by the rank", "unset", "append one JSON "
           "line per call site the CUDA redirect served, modified or refused, per environment translation and per "
           "blocked import (the CUDA redirect then uses its Python wrappers); without {rank}, .rankN is appended where "
           "RANK or LOCAL_RANK is set; `devshim check --log PATH` merges it with the scan (docs/cuda-scripts.md)"),
    Switch("DEVSHIM_LOG_LEVEL", "debug, info, warning or error", "info", "how much devshim logs on stderr (logger "
           "'devshim'); debug shows every patch applied and every kernel dispatch decision",
           lambda raw: raw.strip().lower() in log.LEVELS),
    # -- devshim compare (docs/compare.md); `devshim compare` sets them for its two runs
    Switch("DEVSHIM_COMPARE_DIR", "a directory", "unset", "record this run for `devshim compare`: every module's "
           "outputs and gradients and every optimizer step, sampled, into a rank<N> folder per rank"),
    Switch("DEVSHIM_COMPARE_STEPS", "an integer, 0 or more", "0", "with DEVSHIM_COMPARE_DIR, stop each process at the "
           "first forward after this many optimizer steps (0: record the whole run)",
           lambda raw: raw.strip().isdigit()),
    Switch("DEVSHIM_COMPARE_SAMPLE", "a positive integer", "4096", "with DEVSHIM_COMPARE_DIR, the elements sampled "
           "per tensor (evenly spaced, the same in every run)", _count),
    Switch("DEVSHIM_COMPARE_FULL", "comma-separated module-name patterns (fnmatch)", "unset", "with "
           "DEVSHIM_COMPARE_DIR, the modules whose tensors are recorded whole"),
    Switch("DEVSHIM_REFERENCE_KERNELS", BOOLEAN, "0", "run devshim-kernels' reference ops in place of every kernel "
           "the plugin serves, on the same device (`devshim compare --reference kernels`)", _bool),
    # -- devices
    Switch("DEVSHIM_CPU_DEVICE_COUNT", "a positive integer", "the launcher's local world size, else 1", "how many "
           "ranks the CPU device offers per host", _count, "devshim-cpu-reference"),
    Switch("DEVSHIM_CPU_VISIBLE_DEVICES", "comma-separated device indices", "unset", "the CPU device slots a rank "
           "sees (set by launchers, like CUDA_VISIBLE_DEVICES)", _indices, "devshim-cpu-reference"),
    Switch("DEVSHIM_VISIBLE_DEVICES", "comma-separated device indices", "unset", "the visible-devices variable of a "
           "plugin that declares none", _indices),
    Switch("DEVSHIM_KERNELS_NATIVE", f"{BOOLEAN}, or generic", "1", "0: run devshim-kernels' Adam, rms_norm and "
           "swiglu on PyTorch's kernels; generic: the Adam's portable C loop",
           lambda raw: _bool(raw) or raw.strip().lower() == "generic", "devshim-kernels"),
    Switch("DEVSHIM_REQUIRE_NATIVE", BOOLEAN, "0", "for devshim's own test suite (CI sets it): a native library that "
           "did not build fails the run instead of skipping tests", _bool, "devshim's tests"),
    # -- emulation
    Switch("DEVSHIM_EMULATE", "an emulated vendor's name", "unset", "run on devshim's emulated device with a simulated "
           "vendor SDK (docs/emulation.md)", read_by="devshim-emulation"),
    Switch("DEVSHIM_EMULATE_DEVICES", "a device count from 1 to 64", "8", "emulated devices per node", _count,
           "devshim-emulation"),
    Switch("DEVSHIM_EMULATE_FAULTY_DEVICES", "comma-separated device indices", "unset", "emulated devices whose set-up "
           "fails, for testing fault handling", _indices, "devshim-emulation"),
    Switch("DEVSHIM_CACHE_DIR", "a directory", "~/.cache/devshim", "where the emulated device is built (private to "
           "the user, mode 0700; refused if another user owns or can write to it or a directory above it)",
           read_by="devshim-emulation"),
    # -- the examples
    Switch("DEVSHIM_EXAMPLE_WITHOUT_DEVSHIM", BOOLEAN, "0", "examples/train_gpt.py: run without `import "
           "devshim_core.auto` (the benchmarks' peer runs)", _bool, "examples/train_gpt.py"),
    Switch("DEVSHIM_EXAMPLE_IMPORT_DEEPSPEED_FIRST", BOOLEAN, "0", "examples/train_gpt.py: import deepspeed before "
           "devshim", _bool, "examples/train_gpt.py"),
)

BY_NAME: dict[str, Switch] = {switch.name: switch for switch in SWITCHES}


def nearest(name: str, known: list[str] | tuple[str, ...]) -> str | None:
    """The known name closest to ``name`` (a misspelling's likely meaning), or ``None``."""
    found = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return found[0] if found else None


def check_environment(environ: Mapping[str, str]) -> list[str]:
    """Raise :class:`ConfigError` for the first declared variable whose value is not valid (those Settings parses
    are checked there); return one warning per ``DEVSHIM_*`` variable that is declared nowhere."""
    warnings = []
    for name, raw in environ.items():
        if not name.startswith(PREFIX):
            continue
        switch = BY_NAME.get(name)
        if switch is None:
            guess = nearest(name, list(BY_NAME))
            hint = f" (did you mean {guess}?)" if guess else " (`devshim settings` lists them)"
            warnings.append(f"{name} is not a devshim setting{hint}; it is ignored.")
            continue
        if raw.strip() and not switch.valid(raw):
            if switch.takes == BOOLEAN:  # the wording of every boolean's error (env_values.parse_bool)
                raise ConfigError(f"{name}={raw!r} is not a boolean: use 1 or 0 (also accepted: true/false, yes/no, "
                                  "on/off).")
            raise ConfigError(f"{name}={raw!r} is not valid: {name} takes {switch.takes}.")
    return warnings


def markdown() -> str:
    """The user guide's table of switches."""
    rows = ["| variable | takes | default | effect | read by |", "| --- | --- | --- | --- | --- |"]
    for switch in SWITCHES:
        rows.append(f"| `{switch.name}` | {switch.takes} | {switch.default} | {switch.doc} | {switch.read_by} |")
    return "\n".join(rows)


def text() -> str:
    """The switches for a terminal: name, default and effect, and the values each takes."""
    lines = []
    for switch in SWITCHES:
        lines.append(f"{switch.name} (default {switch.default}; read by {switch.read_by})")
        lines.append(f"    {switch.doc}; takes {switch.takes}")
    return "\n".join(lines)
