"""``devshim info`` and ``devshim plugins``: what was detected, what was chosen and why, what was patched, and the
host under it all. ``devshim check``: which CUDA-only constructs of a script the redirect serves, and what the user
must change. ``devshim --version``: the installed devshim distributions."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import json
import platform
import sys
from typing import Any

from devshim_core import api, cuda_check, host_report, switches
from devshim_core.cuda_check import report as check_report
from devshim_core.distributions import installed_version, name_and_version
from devshim_core.errors import ConfigError, DevshimError
from devshim_core.plugins import ENTRY_POINT_GROUP, discover
from devshim_core.selection import select
from devshim_core.settings import Settings

CORE = "devshim-core"


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def distribution_versions() -> list[str]:
    """One line per installed devshim distribution: devshim-core first, then every other ``devshim-*`` distribution
    and every distribution that registers a devshim plugin (a third party's), with the plugins it registers."""
    seen: dict[str, str] = {}
    for dist in metadata.distributions():
        name, version = name_and_version(dist)
        if not name or _normalized(name) in seen:  # the first on sys.path is the one imported
            continue
        plugins = sorted(ep.name for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP)
        if not plugins and not _normalized(name).startswith("devshim-"):
            continue
        line = f"{name} {version or 'unknown version'}"
        if plugins:
            line += f" (plugin{'s' if len(plugins) > 1 else ''} {', '.join(plugins)})"
        seen[_normalized(name)] = line
    core = seen.pop(CORE, f"{CORE} {installed_version(CORE) or 'not installed (run from a source tree)'}")
    return [core, *(seen[key] for key in sorted(seen))]


class _VersionAction(argparse.Action):
    """``--version``: print, exit 0, before a sub-command is required; reads metadata only (no torch import)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print("\n".join(distribution_versions()))
        parser.exit(0)


def _versions() -> dict[str, str | None]:
    return {
        "python": platform.python_version(),
        "devshim-core": installed_version("devshim-core"),
        "torch": installed_version("torch"),
        "deepspeed": installed_version("deepspeed"),
        "megatron-core": installed_version("megatron-core"),
    }


def _supported() -> dict[str, str]:
    """The framework versions devshim's integrations support, as their records declare them (torch aside)."""
    from devshim_core.integrations import table

    return {i.framework.distribution: i.framework.spec for i in table.load()
            if i.framework is not None and i.framework.distribution != "torch"}


def plugins_report() -> dict[str, Any]:
    """Discovery and selection only: nothing is patched."""
    settings = Settings.from_env()
    registry = discover(settings)
    report: dict[str, Any] = {"plugins": [r.as_dict() for r in registry], "selected": None, "reason": None,
                              "patches": []}
    try:
        selection = select(registry, settings)
    except DevshimError as exc:
        report["reason"] = str(exc)
    else:
        report["selected"], report["reason"] = selection.plugin.name, selection.reason
    return report


def info_report() -> dict[str, Any]:
    """Activate devshim as ``import devshim_core.auto`` would, import the patched frameworks, report it all."""
    from devshim_core.session import activate  # imports torch: not for --version

    report: dict[str, Any] = {"versions": _versions(), "supported": _supported()}
    try:
        session = activate()
    except ConfigError:
        raise  # a setting the user must change (or a tool emulation needs): say so alone, exit status 2
    except DevshimError as exc:
        report.update(plugins_report())
        report.update({"selected": None, "reason": str(exc), "error": str(exc), "host": host_report.collect()})
        return report
    if session.integrations.get("deepspeed", "").startswith("armed"):
        importlib.import_module("deepspeed")  # fires the armed patches, so the report shows what a script gets
    report.update(api.activate().as_dict())  # the session activated above, as it stands now
    report["host"] = host_report.collect(session)
    report["environment"] = host_report.environment(session)
    return report


def _print_plugins(plugins: list[dict[str, Any]]) -> None:
    for p in plugins:
        mark = "+" if p["available"] else "-"
        origin = f"{p['distribution']} {p['version']}" if p["distribution"] else p["entry_point"]
        device = f"{p['device_type']} x{p['device_count']}, priority {p['priority']}" if p["device_type"] else ""
        print(f"  {mark} {p['name']:<16} {origin:<32} {device}")
        print(f"      {p['reason']}")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _print_host(host: dict[str, Any]) -> None:
    print("host:")
    system = host["os"]
    print(f"  {'os':<14} {system['system']} {system['kernel']} {system['machine']}"
          + (f", {system['distro']}" if system["distro"] else ""))
    cpus = host["cpus"]
    usable = f" ({cpus['usable']} usable by this process)" if cpus["usable"] not in (None, cpus["count"]) else ""
    print(f"  {'cpus':<14} {cpus['count'] or 'unknown'}{usable}")
    memory = host["memory"]
    print(f"  {'memory':<14} " + (f"{_size(memory['total'])} total" + (
        f", {_size(memory['available'])} available" if "available" in memory else "") if memory else "unknown"))
    shm = host["shm"]
    if shm["absent"]:
        print(f"  {shm['path']:<14} absent")
    else:
        warning = (" (small: shared-memory collectives and DataLoader workers need more; in a container, raise "
                   "docker's --shm-size)") if shm["small"] else ""
        print(f"  {shm['path']:<14} {_size(shm['size'])}, {_size(shm['free'])} free{warning}")
    for key, label in (("c_compiler", "C compiler"), ("cxx_compiler", "C++ compiler")):
        found = host[key]
        print(f"  {label:<14} " + (f"{found['path']}: {found['version']}" if found else "none on PATH"))
    ninja = host["ninja"]
    ninja_sources = [s for s in (ninja["binary"], ninja["python_package"] and
                                 f"Python package ninja {ninja['python_package']}") if s]
    print(f"  {'ninja':<14} {', '.join(ninja_sources) if ninja_sources else 'none (pip install ninja)'}")
    emulator = host["emulator"]
    state = emulator["state"]
    where = emulator["library"] or emulator["directory"] or emulator["cache_root"] or "devshim-emulation"
    note = {"missing": " (the first DEVSHIM_EMULATE run builds it, about a minute)",
            "building": " (another process is compiling it now)",
            "not installed": " (DEVSHIM_EMULATE needs it: pip install ./emulation)"}.get(state, "")
    if emulator.get("error"):
        note = f" ({emulator['error']})"
    print(f"  {'emulator':<14} {state}: {where}{note}")
    runtime = host["runtime"]
    if runtime is not None:
        if runtime["error"]:
            read = f"error: {runtime['error']}"
        else:
            read = ", ".join(f"{k} {v}" for k, v in runtime["versions"].items()) or "none read by the plugin"
        print(f"  {'runtime':<14} ({runtime['plugin']}) {read}")


def _print_environment(environment: dict[str, Any]) -> None:
    print(f"environment (the job's CUDA/NCCL settings on the {environment['plugin']} device):")
    if not environment["translations"]:
        print("  none set")
    for translation in environment["translations"]:
        print(f"  {translation['summary']}")


def _print_info(report: dict[str, Any]) -> None:
    if report.get("emulation"):
        print(f"!! {report['emulation']}")
    print("versions:")
    for name, version in report["versions"].items():
        supported = report.get("supported", {}).get(name)
        print(f"  {name:<14} {version or 'not installed'}" + (f"  (devshim supports {supported})" if supported else ""))
    if "host" in report:
        _print_host(report["host"])
    print("plugins:")
    _print_plugins(report["plugins"])
    print(f"selected: {report['selected'] or 'none'}")
    print(f"  why: {report['reason']}")
    if "device" in report:
        d = report["device"]
        print(f"device: {d['device_type']} x{d['device_count']} ({d['name']}), backend {d['backend']}, "
              f"dtypes {', '.join(d['supported_dtypes'])}")
        kernels = [k for group in ("optimizer_kernels", "attention_kernels") for k, ok in d[group].items() if ok]
        print(f"  kernels: {', '.join(kernels) or 'none'}")
        for area, source in d["kernel_sources"].items():
            if source:
                print(f"  {area} kernels from {source}")
        offload = d["offload_io"]
        print(f"  offload file I/O (NVMe offload): {offload['source'] or ('yes' if offload['file_io'] else 'none')}")
    if report.get("environment") is not None:
        _print_environment(report["environment"])
    if "integrations" in report:
        print("integrations:")
        for name, status in report["integrations"].items():
            print(f"  {name:<14} {status}")
    print("patches:")
    if not report["patches"]:
        print("  none")
    for p in report["patches"]:
        print(f"  [{p['set']}] {p['name']}: {p['target']} -- {p['detail']}")
        print(f"      why: {p['reason']}")
    for d in report.get("disabled", []):
        print(f"  [{d['set']}] {d['patch'] or '(the whole set)'}: not applied, {d['reason']}")


def _print_integrations(as_json: bool) -> int:
    """The table the session walks, third parties' included; nothing is activated or applied."""
    from devshim_core.integrations import table

    rows = [integration.describe() for integration in table.load()]
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        print(f"{row['name']}: {row['reason']}")
        details = [f"framework {row['framework']}" if row["framework"] else "",
                   f"needs {', '.join(row['needs'])}" if row["needs"] else "",
                   f"fires on import of {', '.join(row['triggers'])}" if row["triggers"] else "",
                   f"patch sets {', '.join(row['patch_sets'])}" if row["patch_sets"] else ""]
        print("    " + "; ".join(d for d in details if d))
    return 0


def check(paths: list[str], as_json: bool, only: str | None = None, logs: list[str] | None = None) -> int:
    """Scan without activating: 0 everything runs, 1 something cannot run, 2 a path (or a log) could not be read.
    ``only`` prints one category's findings, or ``problems`` (review and unsupported); the status is the same.
    ``logs``: migration logs (DEVSHIM_MIGRATION_LOG) to mark each finding ran or never ran."""
    result = cuda_check.check_paths(paths, cuda_check.find_target())
    if logs:
        cuda_check.merge_logs(result, logs)
    if as_json:
        check_report.render_json(result, only=only)
    else:
        check_report.render_text(result, only=only)
    check_report.render_errors(result)
    return result.exit_status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="devshim", description=__doc__)
    parser.add_argument("--version", action=_VersionAction,
                        help="print the version of devshim-core and of each installed devshim distribution, and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("info", "activate as `import devshim_core.auto` would and report everything"),
                            ("plugins", "list the installed plugins and which one would be selected")):
        command = sub.add_parser(name, help=help_text)
        command.add_argument("--json", action="store_true", help="machine-readable output")
    command = sub.add_parser("patches", help="activate, import the installed frameworks, list every patch applied")
    command.add_argument("--markdown", action="store_true", help="as the Markdown table in docs/patches.md")
    command = sub.add_parser("integrations", help="the integrations devshim installs, in order, without applying any")
    command.add_argument("--json", action="store_true", help="machine-readable output")
    command = sub.add_parser("settings", help="every DEVSHIM_* variable: what it takes, its default and effect")
    command.add_argument("--markdown", action="store_true", help="as the table in docs/user-guide.md")
    command = sub.add_parser("check", help="list a script's CUDA-only constructs: redirected, or what to change")
    command.add_argument("paths", nargs="+", metavar="PATH", help="Python files, or directories scanned for *.py")
    command.add_argument("--json", action="store_true", help="the findings as a JSON list")
    command.add_argument("--only", choices=check_report.ONLY_CHOICES, metavar="WHAT",
                         help="print only the findings that need you ('problems': review and unsupported) or one "
                              f"category ({', '.join(check_report.ONLY_CHOICES[1:])}); counts and status are the same")
    command.add_argument("--log", action="append", metavar="PATH", dest="logs",
                         help="a migration log written by DEVSHIM_MIGRATION_LOG (repeat for each rank's): mark each "
                              "finding ran or never ran, and list what ran with no finding")
    command = sub.add_parser("compare", help="run a script on this device and on a reference, compare them layer "
                                             "by layer: devshim compare [options] -- python train.py ...")
    from devshim_core.compare import runner

    runner.add_arguments(command)
    args = parser.parse_args(argv)
    if args.command == "compare":
        return runner.main(args)
    try:
        if args.command == "check":
            return check(args.paths, args.json, args.only, args.logs)
        if args.command == "integrations":
            return _print_integrations(args.json)
        if args.command == "settings":
            print(switches.markdown() if args.markdown else switches.text())
            return 0
        if args.command == "patches":
            from devshim_core.patch_table import collect, markdown

            rows = collect()
            print(markdown(rows) if args.markdown else json.dumps(rows, indent=2, default=str))
            return 0
        report = info_report() if args.command == "info" else plugins_report()
    except DevshimError as exc:  # configuration errors: say what to fix, no traceback
        print(f"devshim: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(report, sys.stdout, indent=2, default=str)
        print()
    elif args.command == "info":
        _print_info(report)
    else:
        _print_plugins(report["plugins"])
        print(f"selected: {report['selected'] or 'none'}\n  why: {report['reason']}")
    return 0 if report["selected"] else 1
