"""``devshim compare [options] -- COMMAND ...``: run the user's command twice and compare the runs layer by layer.

The first run is the job as it is (the selected plugin's device); the second, the reference, is the same command
on the host CPU (``--reference host``: ``DEVSHIM_PLUGIN=cpu_reference``) or on the same device with every kernel the
plugin serves replaced by devshim's reference kernels (``--reference kernels``: ``DEVSHIM_REFERENCE_KERNELS=1``).
Both runs get ``DEVSHIM_AUTO=1`` (an unmodified script and any launcher's workers activate devshim) and the
``DEVSHIM_COMPARE_*`` settings of the recorder; a launcher (torchrun, deepspeed) passes them to every rank, and
each rank is paired with the same rank of the reference. The seeds and data are the script's own, the same in both
runs.

Exit status: 0 the runs agree within tolerance, 1 they diverge (or a dump is incomplete), 2 the comparison could
not be made (a run failed, timed out, or recorded nothing): usable in CI.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from devshim_core.compare import names
from devshim_core.compare.names import DEFAULT_SAMPLE

REFERENCES = {"host": "the host CPU (cpu_reference)",
              "kernels": "the same device, every plugin kernel replaced by devshim's reference kernels"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=3, metavar="N",
                        help="optimizer steps to record; each process stops after them (0: the whole run; default 3)")
    parser.add_argument("--reference", choices=sorted(REFERENCES), default="host",
                        help="host: the host CPU through cpu_reference (default); kernels: the same device with "
                             "devshim's reference kernels")
    parser.add_argument("--sample", type=int, default=DEFAULT_SAMPLE, metavar="K",
                        help=f"elements sampled per tensor (default {DEFAULT_SAMPLE})")
    parser.add_argument("--full", default="", metavar="PATTERNS",
                        help="comma-separated module-name patterns (fnmatch) whose tensors are dumped whole")
    parser.add_argument("--out", type=Path, default=Path("devshim-compare"), metavar="DIR",
                        help="where the dumps, compare.json and compare.html go (default ./devshim-compare)")
    parser.add_argument("--reference-from", type=Path, metavar="DIR",
                        help="reuse the reference run of an earlier compare's --out DIR (same command, --steps and "
                             "--reference) instead of running it again: one reference for several runs under test")
    parser.add_argument("--timeout", type=float, default=3600.0, metavar="SECONDS",
                        help="the most each run may take (default 3600)")
    # not "command": the CLI's subcommand is stored under that name
    parser.add_argument("to_run", nargs=argparse.REMAINDER, metavar="COMMAND",
                        help="-- then the command that runs the script")


class RunFailed(Exception):
    pass


def _run(name: str, command: list[str], env: dict[str, str], log: Path, timeout: float) -> None:
    """Run ``command`` in a session of its own (a timeout kills the launcher and every rank), its output in
    ``log``; a failure or timeout raises :class:`RunFailed` with the log's end."""
    print(f"devshim compare: {name} run: {' '.join(command)}", file=sys.stderr, flush=True)
    started = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise RunFailed(f"the {name} run took more than {timeout:g} s and was stopped; its output is in {log}"
                            ) from None
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise RunFailed(f"the {name} run exited with status {code}; the end of its output ({log}):\n{tail}")
    print(f"devshim compare: {name} run done in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)


def environments(args: argparse.Namespace, base: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The two runs' environments: the user's, plus DEVSHIM_AUTO and the recorder's settings; the reference's
    also selects the host CPU or the reference kernels."""
    common = dict(base, DEVSHIM_AUTO="1", **{names.STEPS: str(args.steps), names.SAMPLE: str(args.sample)})
    if args.full:
        common[names.FULL] = args.full
    out = args.out.resolve()
    run = dict(common, **{names.DIR: str(out / "run")})
    reference = dict(common, **{names.DIR: str(out / "reference")})
    if args.reference == "host":
        reference["DEVSHIM_PLUGIN"] = "cpu_reference"
        reference.pop("DEVSHIM_EMULATE", None)  # the host CPU needs no emulated device
    else:
        reference[names.REFERENCE_KERNELS] = "1"
    return run, reference


def reused_reference(earlier: Path, command: list[str], args: argparse.Namespace) -> Path:
    """The reference run of an earlier compare, if it ran this command with these settings (``compare.json``)."""
    reference, settings_file = earlier / "reference", earlier / "compare.json"
    if not settings_file.exists() or not reference.is_dir():
        raise FileNotFoundError(f"--reference-from {earlier}: no earlier compare there (it has no compare.json and "
                                "reference/ directory)")
    import json

    earlier_settings = json.loads(settings_file.read_text())["settings"]
    wanted = {"command": command, "steps": args.steps, "reference": args.reference, "sample": args.sample,
              "full": args.full}
    different = [key for key, value in wanted.items() if earlier_settings.get(key) != value]
    if different:
        raise ValueError(f"--reference-from {earlier}: its reference ran with other {', '.join(different)} "
                         f"({', '.join(f'{k}={earlier_settings.get(k)!r}' for k in different)}); run it again")
    return reference


def main(args: argparse.Namespace) -> int:
    command = args.to_run[1:] if args.to_run[:1] == ["--"] else args.to_run
    if not command:
        print("devshim compare: give the command after --, e.g. devshim compare -- python train.py", file=sys.stderr)
        return 2
    if args.steps < 0 or args.sample < 1:
        print("devshim compare: --steps takes 0 or more, --sample 1 or more", file=sys.stderr)
        return 2
    out = args.out.resolve()
    for name in ("run", "reference"):
        if (out / name).exists() and any((out / name).iterdir()):
            print(f"devshim compare: {out / name} is not empty; remove it or choose another --out", file=sys.stderr)
            return 2
    out.mkdir(parents=True, exist_ok=True)
    run_env, reference_env = environments(args, dict(os.environ))
    from devshim_core.compare import report  # torch: only once there is something to compare
    try:
        _run("device", command, run_env, out / "run.log", args.timeout)
        if args.reference_from is None:
            _run("reference", command, reference_env, out / "reference.log", args.timeout)
            reference = out / "reference"
        else:
            reference = reused_reference(args.reference_from.resolve(), command, args)
        comparisons = report.compare_runs(out / "run", reference)
    except (RunFailed, FileNotFoundError, ValueError) as exc:
        print(f"devshim compare: {exc}", file=sys.stderr)
        return 2
    run_name = f"the selected device (DEVSHIM_PLUGIN={os.environ.get('DEVSHIM_PLUGIN') or 'as selected'})"
    settings = {"command": command, "steps": args.steps, "reference": args.reference, "sample": args.sample,
                "full": args.full}
    print(report.terminal(comparisons, run_name, REFERENCES[args.reference]))
    json_path, html_path = report.write(comparisons, out, settings, run_name, REFERENCES[args.reference])
    print(f"devshim compare: {json_path} and {html_path}", file=sys.stderr)
    return 1 if report.diverged(comparisons) else 0
