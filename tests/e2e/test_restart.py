"""Spec: a DeepSpeed job on devshim whose rank is SIGKILLed restarts under ``torchrun --max-restarts 1`` and resumes
from its last complete checkpoint, ending with exactly the losses of a run that was never interrupted.

Every job runs ``restart_job.py`` (``import devshim_core.auto`` first, ZeRO-2, fp32, the data of step k generated
from k alone, a checkpoint after steps 3 and 6 holding {step, losses so far}, ``load_checkpoint`` of ``latest`` on
start) on 2 ranks of the host CPU (``cpu_reference`` plugin, gloo), 8 steps. On torchrun's first attempt
(TORCHELASTIC_RESTART_COUNT=0) the job kills one of its own ranks with SIGKILL at a fixed point; torchrun then
stops the surviving rank and starts both again (attempt 1), which load the checkpoint and train to the end.

The restarted run's full loss list (the checkpoint's losses, then those computed after the resume) EQUALS the
uninterrupted run's, with ``==``, and its final checkpoint holds the same values, tensor for tensor: the run is
fp32 and seeded, has no dropout, a gloo sum over 2 ranks does not depend on order, and the checkpoint holds the
fp32 master weights and Adam moments verbatim.

The jobs use the c10d rendezvous with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so that each attempt's ranks meet in
a fresh TCPStore. The other ways leave attempt 0's keys in a store that attempt 1 reuses: with the static
rendezvous (``--master-addr``/``--master-port``, torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py:66)
or the c10d rendezvous's shared store (dynamic_rendezvous.py:1209), attempt 1's gloo ranks can read a dead
rank's address and fail or hang in ``connectFullMesh``. That is torch's, not devshim's: the same happens to a
plain ``init_process_group("gloo")`` script without devshim.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from stress.chaos import value_differences

from .launch import Job, assert_loss_fell, free_port, run_job
from .platforms import CPU

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed", reason="the end-to-end runs need the deepspeed extra")

JOB = Path(__file__).with_name("restart_job.py")
STEPS = 8
SAVE_EVERY = 3  # checkpoints global_step3 and global_step6
KILL_AFTER_STEP = 5  # between the two checkpoints
KILL_IN_SAVE = 6  # the second checkpoint
# cross-entropy starts near ln(64) = 4.16 and falls to ~2.9 in 8 steps; the runs are deterministic
LOSS_DROP = 1.0
TIMEOUT_S = 240


@dataclass
class Run:
    """A finished torchrun job of ``restart_job.py``: rank 0's report and every rank's events, all attempts."""

    job: Job
    report: dict[str, Any]
    events: list[dict[str, Any]]
    save_dir: Path

    def events_of(self, event: str, attempt: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event and attempt in (None, e["attempt"])]

    def pids(self, attempt: int) -> set[int]:
        return {e["pid"] for e in self.events_of("start", attempt)}

    def last_step(self, attempt: int) -> int:
        """The last step whose loss the attempt computed (on every rank: the loss is all-reduced)."""
        return max((e["step"] for e in self.events_of("step", attempt)), default=0)

    def context(self) -> str:
        events = "\n".join(json.dumps(e) for e in self.events)
        return f"\nreport: {json.dumps(self.report)}\nevents:\n{events}\n{self.job.tail()}"


def train(workdir: Path, *job_args: str) -> Run:
    save_dir, events = workdir / "checkpoints", workdir / "events.jsonl"
    env = CPU.job_env({"DEVSHIM_PLUGIN": CPU.plugin, **CPU.two_devices_env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    launcher_args = ("--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}")
    job = run_job("torchrun", ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--save-dir", str(save_dir),
                               "--events", str(events), *job_args],
                  workdir, env=env, launcher_args=launcher_args, script=JOB, timeout_s=TIMEOUT_S)
    report = job.report()
    return Run(job, report, [json.loads(line) for line in events.read_text().splitlines()], save_dir)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The same job, seeds and data, never killed: the losses every restarted run must reproduce."""
    run = train(tmp_path_factory.mktemp("uninterrupted"))
    context = run.context()
    assert run.report["attempt"] == 0 and run.report["resumed_from"] is None, context
    assert run.events_of("killed") == [] and run.pids(1) == set(), context
    assert run.report["plugin"] == CPU.plugin and run.report["accelerator"] == "DevshimAccelerator", context
    assert run.report["backend"] == CPU.backend and run.report["zero_stage"] == 2, context
    assert [e["step"] for e in run.events_of("saved")] == [3, 6], context
    assert_loss_fell(run.report["losses"], STEPS, LOSS_DROP, run.job)
    return run


def assert_resumed_exactly(run: Run, uninterrupted: Run, *, tag: str, step: int) -> None:
    """Attempt 1 (new processes) loaded ``tag``, the checkpoint of ``step``, and reproduced every loss exactly."""
    context = run.context()
    report, reference = run.report, uninterrupted.report["losses"]
    assert report["attempt"] == 1 and report["max_restarts"] == "1", context
    assert run.pids(0) and run.pids(1) and not run.pids(0) & run.pids(1), f"attempt 1 reused a process{context}"
    assert report["resumed_from"] == tag and report["start_steps"] == [step, step], context
    assert [e["tag"] for e in run.events_of("resumed", 1)] == [tag, tag], context
    assert report["checkpoint_losses"] == reference[:step], context
    assert report["optimizer_steps"] == STEPS, context  # the engine's counter came back with the checkpoint
    assert report["losses"] == reference, (
        f"the restarted run's losses differ from the uninterrupted run's:\n  uninterrupted: {reference}\n"
        f"  restarted:     {report['losses']}{context}")
    last = f"global_step{STEPS // SAVE_EVERY * SAVE_EVERY}"
    assert (run.save_dir / "latest").read_text().strip() == last, context
    differences = checkpoint_differences(run.save_dir / last, uninterrupted.save_dir / last)
    assert differences == [], f"the restarted run's {last} differs from the uninterrupted run's: {differences}{context}"


def checkpoint_differences(checkpoint: Path, reference: Path) -> list[str]:
    """Where two checkpoint tags differ: file names, then every value of every file (tensors with torch.equal).

    Not the bytes: pickle's memo makes a file's size depend on which objects were shared when it was saved (a
    resumed engine's optimizer param groups no longer share the config's objects), not only on their values.
    """
    import torch  # here: the tests' own process never needs it otherwise

    names = sorted(p.name for p in checkpoint.iterdir())
    if names != sorted(p.name for p in reference.iterdir()):
        return [f"files {names} != {sorted(p.name for p in reference.iterdir())}"]
    return [d for name in names
            for d in value_differences(torch.load(checkpoint / name, map_location="cpu", weights_only=False),
                                       torch.load(reference / name, map_location="cpu", weights_only=False), name)]


def test_rank_killed_mid_training_restarts_from_the_latest_checkpoint_with_identical_losses(
        tmp_path: Path, uninterrupted: Run) -> None:
    """Rank 1 SIGKILLs itself after step 5; torchrun restarts both ranks, which resume from the step-3 checkpoint.

    Attempt 0 computes steps 1-5 exactly as the uninterrupted run does (and completes the checkpoint of step 3),
    then rank 1 dies; attempt 1 finds ``latest`` naming global_step3, loads it on both ranks, and trains steps
    4-8. Lost: steps 4 and 5, the steps since the last checkpoint, no more.
    """
    run = train(tmp_path, "--kill-rank", "1", "--kill-after-step", str(KILL_AFTER_STEP))
    context = run.context()

    killed = run.events_of("killed")
    assert [(e["attempt"], e["rank"], e["step"]) for e in killed] == [(0, 1, KILL_AFTER_STEP)], context
    assert killed[0]["pid"] in run.pids(0), context
    assert [e["step"] for e in run.events_of("saved", 0)] == [3], context
    attempt0 = [e["loss"] for e in run.events_of("step", 0)]
    assert attempt0 == uninterrupted.report["losses"][:KILL_AFTER_STEP], context
    assert run.report["checkpoint_at_start"]["latest"] == "global_step3", context

    assert_resumed_exactly(run, uninterrupted, tag="global_step3", step=3)
    lost = run.last_step(0) - run.report["start_steps"][0]
    assert lost == KILL_AFTER_STEP - 3 < SAVE_EVERY, f"lost {lost} steps{context}"


def test_rank_killed_while_writing_a_checkpoint_restarts_from_the_previous_complete_one(
        tmp_path: Path, uninterrupted: Run) -> None:
    """Rank 0 dies half-way through its part of the step-6 checkpoint; the restart resumes from global_step3.

    In DeepSpeed's ``save_checkpoint`` rank 0 writes the model states, then its ZeRO optimizer states, and only then
    ``latest``. Attempt 0's rank 0 has written the model states file, and only the first half of its optimizer states
    file is on disk (the job cuts the file DeepSpeed wrote), when it SIGKILLs itself: global_step6 exists on disk,
    incomplete, and ``latest`` still names global_step3. Attempt 1 sees exactly that (the truncated file does not
    load), resumes from global_step3, and trains steps 4-8 again, writing a complete global_step6. Lost: steps 4-6,
    the steps since the last complete checkpoint, no more.

    The rank killed is rank 0 because it writes ``latest``: a rank > 0 dying mid-save does not stop rank 0, which
    waits for nobody before naming the new tag in ``latest`` (deepspeed/runtime/engine.py, ``save_checkpoint``),
    so ``latest`` then names the incomplete checkpoint and the restart fails to load it.
    """
    run = train(tmp_path, "--kill-rank", "0", "--kill-in-save", str(KILL_IN_SAVE))
    context = run.context()

    killed = run.events_of("killed")
    assert [(e["attempt"], e["rank"], e["tag"]) for e in killed] == [(0, 0, "global_step6")], context
    partial_file = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert killed[0]["while_writing"] == partial_file, context
    assert 0 < killed[0]["bytes_written"] < killed[0]["bytes_total"], context
    assert killed[0]["tag_files"]["mp_rank_00_model_states.pt"] > 0, context  # DeepSpeed had already written it
    assert run.last_step(0) == KILL_IN_SAVE, context
    assert [e["step"] for e in run.events_of("saved", 0)] == [3], context  # the save of step 6 never returned

    found = run.report["checkpoint_at_start"]  # what attempt 1 found on disk before loading
    assert found["latest"] == "global_step3", context
    assert all(f["loads"] for f in found["tags"]["global_step3"].values()), context
    partial = found["tags"]["global_step6"]
    assert partial["mp_rank_00_model_states.pt"]["loads"], context
    assert partial[partial_file] == {"bytes": killed[0]["bytes_written"], "loads": False}, context

    assert_resumed_exactly(run, uninterrupted, tag="global_step3", step=3)
    lost = run.last_step(0) - run.report["start_steps"][0]
    assert lost == KILL_IN_SAVE - 3 == SAVE_EVERY, f"lost {lost} steps{context}"
    assert (run.save_dir / "global_step6" / partial_file).stat().st_size > killed[0]["bytes_written"], context
