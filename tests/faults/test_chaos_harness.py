"""Spec of the chaos loop's harness (``stress/chaos.py``, ``make chaos``): its draw, its judge and its record.

The loop injects faults into real 2-rank training jobs (SIGKILL of a rank, a full ``/dev/shm``, a full checkpoint
disk, a corrupted newest checkpoint) and classifies what the user then sees. These tests pin the harness itself:

- a seeded draw is reproducible, job by job, so that any job of a 50-job record can be rerun alone (``--only``);
- a stop counts as a clear error only when a rank's final exception names the problem and the path;
- a final checkpoint that loads but holds other values than the uninterrupted run's is found;
- one real faulted job: a DeepSpeed ZeRO-2 job whose rank 1 is SIGKILLed after step 4 resumes, after one restart,
  from ``global_step3`` and prints exactly the uninterrupted run's losses (``==``), ending with an equal checkpoint;
- the section of docs/running-at-scale.md is generated from a results file, never typed.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections import Counter
from pathlib import Path

import pytest

from stress import chaos
from stress.chaos import FAULTS, STEPS, Fault

if importlib.util.find_spec("deepspeed") is None:  # found, not imported: the jobs import it, in their processes
    pytest.skip("the chaos jobs train with DeepSpeed: install the deepspeed extra", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


def test_a_seeded_draw_is_reproducible_and_each_job_draws_alone() -> None:
    first, again, other = chaos.draw(7, 40), chaos.draw(7, 40), chaos.draw(8, 40)
    assert first == again
    assert first != other
    assert [chaos.draw_one(7, i) for i in (0, 17, 39)] == [first[0], first[17], first[39]]  # what --only reruns
    assert chaos.draw(7, 60)[:40] == first  # a longer loop with the same seed starts with the same jobs

    assert {f.kind for f in first} == set(FAULTS) and {f.job for f in first} == {"deepspeed", "megatron"}
    for fault in first:
        if fault.kind == "kill":
            assert 0 <= fault.rank <= 1 and 1 <= fault.step < STEPS, fault
        if fault.kind == "corrupt":  # killed once a checkpoint exists, so there is a newest one to corrupt
            assert chaos.SAVE_EVERY <= fault.step < STEPS and fault.corruption in ("truncate", "flip"), fault
        if fault.kind == "disk-full":  # smaller than the checkpoints: some save must run out of space
            assert 0 < fault.disk_fraction < 1, fault
        if fault.kind == "shm-full":
            assert 1 <= fault.shm_mib <= 256 and 0 <= fault.step < STEPS, fault

    without_mounts = chaos.draw(7, 40, ("kill", "corrupt"))
    assert Counter(f.kind for f in without_mounts).keys() == {"kill", "corrupt"}


def test_a_stop_is_clear_only_when_the_final_exception_names_the_problem_and_the_path(tmp_path: Path) -> None:
    save_dir = tmp_path / "checkpoints"
    (save_dir / "global_step6").mkdir(parents=True)
    (save_dir / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"")
    file = save_dir / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"

    clear, line = chaos.judge_stop(f"Traceback (most recent call last):\n  File \"job.py\", line 1\n"
                                   f"[rank1]: OSError: [Errno 28] No space left on device: '{file}'\n", save_dir)
    assert clear and "No space left" in line

    # what torch.save says when the disk fills up (seen in the loop): neither the problem nor the file
    clear, line = chaos.judge_stop("[rank0]: RuntimeError: basic_ios::clear: iostream error\n"
                                   "[rank0]: During handling of the above exception, another exception occurred:\n"
                                   "[rank0]: Traceback (most recent call last):\n"
                                   "[rank0]: RuntimeError: [enforce fail at inline_container.cc:672] . "
                                   "unexpected pos 128 vs 0\n", save_dir)
    assert not clear and line.endswith("unexpected pos 128 vs 0")

    # the problem named, but not which file: a user with many checkpoints cannot tell which one
    clear, _ = chaos.judge_stop("[rank0]: RuntimeError: PytorchStreamReader failed reading zip archive: failed "
                                "finding central directory. [...] your checkpoint file is corrupted.\n", save_dir)
    assert not clear

    # a file named in an exception that a later one superseded does not make the stop clear
    clear, _ = chaos.judge_stop(f"OSError: [Errno 28] No space left on device: '{file}'\n\nThe above exception was "
                                "the direct cause of the following exception:\n\nKeyError: 'step'\n", save_dir)
    assert not clear

    clear, line = chaos.judge_stop("Fatal Python error: Segmentation fault\n\nexitcode  : -11 (pid: 42)\n", save_dir)
    assert not clear and "Segmentation fault" in line  # a crash: its last words are what the record shows


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> chaos.Reference:
    """The uninterrupted DeepSpeed run: what every faulted job must reproduce."""
    ref = chaos.run_reference("deepspeed", chaos.TIMEOUT_S, tmp_path_factory.mktemp("chaos-reference"))
    assert len(ref.losses) == STEPS and ref.losses[-1] < ref.losses[0] - 1.0, ref.losses  # it trains
    tags = sorted(p.name for p in ref.save_dir.glob("global_step*"))
    assert tags == ["global_step3", "global_step6", "global_step9"], tags
    return ref


def test_a_checkpoint_that_loads_with_other_values_is_found(reference: chaos.Reference, tmp_path: Path) -> None:
    final = reference.save_dir / chaos.final_tag("deepspeed")
    copy = tmp_path / final.name
    shutil.copytree(final, copy)
    assert chaos.checkpoint_differences(copy, final) == []

    states = copy / "mp_rank_00_model_states.pt"
    data = bytearray(states.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of a weight: torch.load does not notice (no checksum)
    states.write_bytes(bytes(data))
    assert chaos.checkpoint_differences(copy, final) != []


def test_a_rank_sigkilled_mid_run_resumes_with_the_uninterrupted_losses(reference: chaos.Reference) -> None:
    fault = Fault(index=0, job="deepspeed", kind="kill", rank=1, step=4)
    result = chaos.run_faulted(fault, reference, timeout_s=120)
    context = "\n".join(f"{a.number}: {a.judged} {a.error}\n{a.stderr_tail}" for a in result.attempts)

    assert result.outcome == "resumed-equal", (result.outcome, result.notes, context)
    killed, restart = result.attempts
    assert killed.injected and killed.injected[0].startswith("SIGKILL rank 1"), killed.injected
    assert killed.returncode not in (0, None) and killed.judged == "killed by the harness", context
    assert killed.losses == {s: reference.losses[s - 1] for s in killed.losses} and 4 in killed.losses
    # the kill lands after step 4's line, before the save of step 6: the restart resumes from step 3
    assert restart.resumed_from == "global_step3" and restart.start_step == 3, context
    assert restart.losses == {s: reference.losses[s - 1] for s in range(4, STEPS + 1)}, restart.losses
    assert result.notes == []  # the final checkpoint equals the uninterrupted run's, value by value


def test_the_doc_section_is_generated_from_a_results_file(tmp_path: Path) -> None:
    attempt = chaos.Attempt(0, 0, 12.0, None, 0, {1: 4.0}, ["global_step3"], {0: "yes", 1: "yes"}, [])
    result = chaos.Result(Fault(3, "megatron", "shm-full", shm_mib=8, step=0), "finished-equal", [attempt],
                          seed=5, jobs=9)
    document = {"date": "2026-01-01 00:00 UTC", "commit": "abc1234", "seconds": 75, "seed": 5, "jobs": 1,
                "timeout_s": 180, "versions": {"torch": "2.13.0", "deepspeed": "0.19.8", "megatron-core": "0.16.1"},
                "counts": {"finished-equal": 1}, "results": [result.as_json()]}
    body = chaos.markdown(document)
    assert "--jobs 1 --seed 5 --timeout 180" in body and "1 min 15 s" in body
    assert "| megatron | shm-full | 1 | 1 |" in body  # one job of that kind, finished-equal
    assert "| 3 | megatron | /dev/shm of 8 MiB, filled before the start |" in body

    doc = tmp_path / "page.md"
    doc.write_text(f"# Page\n\n{chaos.BEGIN}\nold table\n{chaos.END}\n\nafter\n")
    chaos.write_doc(doc, body)
    chaos.write_doc(doc, body)  # idempotent: the block is replaced, not appended to
    assert doc.read_text() == f"# Page\n\n{chaos.BEGIN}\n{body}{chaos.END}\n\nafter\n"

    doc.write_text("# Page without the markers\n")
    with pytest.raises(SystemExit, match="has no generated block"):
        chaos.write_doc(doc, body)
    page = (ROOT / "docs" / "running-at-scale.md").read_text()
    assert chaos.BEGIN in page and chaos.END in page, "the chaos section's markers are missing from the page"
