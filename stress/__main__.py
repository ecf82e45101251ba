"""The exit stress loop: many short 2-rank ``torchrun`` jobs, counting ranks that abort after succeeding.

    python -m stress [--jobs 200] [--parallel 2] [--control 0] [--out stress/results.json]

Each job trains ``examples/train_gpt.py`` for ``--steps`` steps on the ``cpu_reference`` plugin (or
``--emulate ascend``), ZeRO-2, and ends as the script ends: ``all_gather_object``, ``barrier``,
``destroy_process_group``. A job *aborted* if a rank printed "terminate called" or died of SIGABRT; *failed* if
it exited non-zero otherwise. ``--control N`` also runs N jobs with devshim's exit patch reverted
(``--without-settle``), interleaved with the others, so one run shows both rates on the same machine load.
``--parallel`` jobs run at once: 2 jobs of 2 ranks keep both cores of a CI machine busy, as CI does.
Exit status: 1 if any job with the patch aborted or failed.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from bench.common import environment_without_devshim, free_port

JOB = Path(__file__).with_name("exit_job.py")
TIMEOUT_S = 300
ABORT_MARKER = "terminate called"


@dataclass
class Outcome:
    arm: str  # "patched" or "control"
    returncode: int | None
    aborted: bool
    seconds: float
    tail: str  # the last lines of stderr when the job did not succeed

    @property
    def succeeded(self) -> bool:
        return self.returncode == 0 and not self.aborted


def run_one(arm: str, steps: int, emulate: str | None) -> Outcome:
    env = environment_without_devshim() | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if emulate:
        env |= {"DEVSHIM_EMULATE": emulate, "DEVSHIM_EMULATE_DEVICES": "2", "DEVSHIM_PLUGIN": emulate}
    else:
        env |= {"DEVSHIM_PLUGIN": "cpu_reference", "DEVSHIM_CPU_DEVICE_COUNT": "2"}
    torchrun = Path(sys.executable).with_name("torchrun")
    with tempfile.TemporaryDirectory(prefix="devshim-stress-") as workdir:
        env["TORCH_EXTENSIONS_DIR"] = str(Path(workdir) / "torch_extensions")
        command = [str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                   "--master-port", str(free_port()), str(JOB), "--steps", str(steps),
                   *(["--without-settle"] if arm == "control" else [])]
        start = time.monotonic()
        try:
            done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
            returncode, stderr = done.returncode, done.stderr
        except subprocess.TimeoutExpired as exc:
            returncode, stderr = None, (exc.stderr or b"").decode(errors="replace")
    aborted = ABORT_MARKER in stderr or "(SIGABRT)" in stderr
    tail = "" if returncode == 0 and not aborted else "\n".join(stderr.splitlines()[-60:])
    return Outcome(arm, returncode, aborted, time.monotonic() - start, tail)


def summary(outcomes: list[Outcome], arm: str) -> dict[str, int]:
    mine = [o for o in outcomes if o.arm == arm]
    return {"jobs": len(mine), "aborted": sum(o.aborted for o in mine),
            "failed_otherwise": sum(not o.succeeded and not o.aborted for o in mine)}


def _binomial_cdf(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def abort_rate_interval(aborted: int, jobs: int) -> tuple[float, float]:
    """The exact (Clopper-Pearson) 95% interval of an arm's abort rate, by bisection on the binomial CDF."""
    def solve(target: Callable[[float], float]) -> float:
        low, high = 0.0, 1.0
        for _ in range(60):
            mid = (low + high) / 2
            low, high = (mid, high) if target(mid) > 0 else (low, mid)
        return (low + high) / 2

    lower = 0.0 if aborted == 0 else solve(lambda p: 0.025 - (1 - _binomial_cdf(aborted - 1, jobs, p)))
    upper = 1.0 if aborted == jobs else solve(lambda p: _binomial_cdf(aborted, jobs, p) - 0.025)
    return lower, upper


def fisher_one_sided(patched: dict[str, int], control: dict[str, int]) -> float:
    """P(the patched arm has at most its aborts | the total), if the callback changed nothing (hypergeometric)."""
    total = patched["aborted"] + control["aborted"]
    jobs = patched["jobs"] + control["jobs"]
    return sum(math.comb(patched["jobs"], k) * math.comb(control["jobs"], total - k)
               for k in range(patched["aborted"] + 1) if total - k <= control["jobs"]) / math.comb(jobs, total)


def statistics(patched: dict[str, int], control: dict[str, int]) -> dict[str, object]:
    result: dict[str, object] = {"patched_abort_rate_95": abort_rate_interval(patched["aborted"], patched["jobs"])}
    if control["jobs"]:
        result["control_abort_rate_95"] = abort_rate_interval(control["aborted"], control["jobs"])
        result["fisher_one_sided_p"] = fisher_one_sided(patched, control)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stress", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200, help="jobs with devshim's exit patch (default 200)")
    parser.add_argument("--control", type=int, default=0, help="jobs with the patch reverted (default 0)")
    parser.add_argument("--parallel", type=int, default=2, help="jobs at once (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per job (default 3)")
    parser.add_argument("--emulate", choices=("ascend", "sophgo"), help="run on an emulated vendor device")
    parser.add_argument("--out", type=Path, help="write every outcome and the summary here (JSON)")
    parser.add_argument("--summarize", type=Path, metavar="RESULTS",
                        help="recompute the statistics of a results file and print them; runs nothing")
    args = parser.parse_args(argv)
    if args.summarize:
        recorded = json.loads(args.summarize.read_text())
        print(json.dumps(statistics(recorded["patched"], recorded["control"])))
        return 0
    # the control jobs spread evenly through the run, so both arms see the same machine load
    arms = ["patched"] * args.jobs
    for i in range(args.control):
        arms.insert(round((i + 0.5) * len(arms) / args.control), "control")
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        outcomes = []
        for done, outcome in enumerate(pool.map(lambda arm: run_one(arm, args.steps, args.emulate), arms), 1):
            outcomes.append(outcome)
            if not outcome.succeeded:
                print(f"job {done} ({outcome.arm}): exit {outcome.returncode}, aborted={outcome.aborted}\n"
                      f"{outcome.tail}", file=sys.stderr)
            if done % 20 == 0:
                print(f"{done}/{len(arms)} jobs, {time.monotonic() - start:.0f} s", file=sys.stderr)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": round(time.monotonic() - start),
        "parallel": args.parallel, "steps": args.steps, "device": args.emulate or "cpu_reference",
        "versions": {"python": platform.python_version(), "torch": metadata.version("torch"),
                     "deepspeed": metadata.version("deepspeed")},
        "patched": summary(outcomes, "patched"), "control": summary(outcomes, "control"),
        "outcomes": [asdict(o) for o in outcomes],
    }
    result["statistics"] = statistics(result["patched"], result["control"])
    print(json.dumps({k: v for k, v in result.items() if k != "outcomes"}))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    patched = result["patched"]
    return 1 if patched["aborted"] or patched["failed_otherwise"] else 0


if __name__ == "__main__":
    sys.exit(main())
