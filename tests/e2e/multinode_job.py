"""``examples/train_gpt.py`` unchanged, plus what each rank's launcher handed it: the job of ``test_multinode.py``.

The multi-node specs need to see the variables every rank was started with (devshim's switches, a
``.deepspeed_env`` marker, what DeepSpeed's runner exports, the launcher's rank variables), which train_gpt.py
does not report. This script runs train_gpt.py as ``__main__`` (same arguments, same report) and then each rank
writes ``env-rank<RANK>.json`` beside ``--report``: the selected variables of the environment it started with.
Every rank of these specs runs on the one test machine, so the files land in one directory.

Under ``mpirun`` no launcher sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR or MASTER_PORT; DeepSpeed's MPI
discovery (``deepspeed.comm.comm.mpi_discovery``, what ``deepspeed.init_distributed(auto_mpi_discovery=True)``
runs, through mpi4py) sets them here first, on the port in DEVSHIM_TEST_MPI_PORT instead of its fixed default,
and with the master address on loopback: its own pick, the first address of ``hostname -I``, is the machine's
network interface, which these single-machine specs never use. train_gpt.py's ``deepspeed.init_distributed()``
then finds the variables set and initializes from them.
"""

import devshim_core.auto  # noqa: F401, I001 - first: the only line a DeepSpeed script adds

import json
import os
import runpy
import sys
from pathlib import Path

TRAIN_GPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
# what a launcher, DeepSpeed's runner (EXPORT_ENVS and the accelerator's export_envs()) or a .deepspeed_env sets
RECORDED_PREFIXES = ("DEVSHIM", "OMP", "KMP", "PYTHON", "UCX", "MLFLOW", "MV2", "GLOO", "MASTER_", "CROSS_", "OMPI_")
RECORDED = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "ROLE_RANK", "TORCHELASTIC_RUN_ID",
                      "TORCH_EXTENSIONS_DIR"})  # set for every launcher, exported by none: shows a fresh login
LAUNCH_ENV = {k: v for k, v in os.environ.items() if k in RECORDED or k.startswith(RECORDED_PREFIXES)}


def discover_mpi_world() -> None:
    from deepspeed.comm.comm import mpi_discovery

    mpi_discovery(distributed_port=int(os.environ["DEVSHIM_TEST_MPI_PORT"]), verbose=False)
    os.environ["MASTER_ADDR"] = "127.0.0.1"


def main() -> None:
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ:
        discover_mpi_world()
    report = Path(sys.argv[sys.argv.index("--report") + 1])
    sys.argv[0] = str(TRAIN_GPT)
    runpy.run_path(str(TRAIN_GPT), run_name="__main__")
    facts = {"launch_env": LAUNCH_ENV, "rank": int(os.environ["RANK"]), "local_rank": int(os.environ["LOCAL_RANK"])}
    report.with_name(f"env-rank{facts['rank']}.json").write_text(json.dumps(facts, indent=2))


if __name__ == "__main__":
    main()
