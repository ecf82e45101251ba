"""Faults in the checkpoints of real DeepSpeed engines and real megatron-core ``dist_checkpointing``, and what the user
sees: a :class:`CheckpointError` naming the file, never a checkpoint that loads wrong, never a bare ``OSError``.

- **A flipped byte in tensor data.** torch.load and dist_checkpointing check no checksum, so without devshim such a
  file loads silently wrong (each test shows it through the original function). With devshim the load raises naming
  the file, its recorded and actual sha256, and the other tags or iterations to load.
- **A truncated file.** The error names the file and both sizes; a file saved without devshim (no record) that does
  not load is named with its size.
- **A full checkpoint disk** (a 64 KiB tmpfs), **a file size limit** (``RLIMIT_FSIZE``) and **a full /dev/shm**
  (Megatron's writer keeps its queue's semaphore there): the save raises naming the path, "no space left" or "file
  too large", and the free space, instead of torch's ``unexpected pos 128 vs 0`` or a bare ``[Errno 28]``.
- **Two ranks, one corrupt shard.** The rank that checks the file and the rank that owns it raise the same error
  before Megatron reads anything; neither goes on alone into the collective load.
- **No fault.** A checkpoint round-trips with equal tensors; one saved without devshim (no records) loads as before;
  the records never sit in a tag's directory, so DeepSpeed's globs and ``zero_to_fp32`` never meet them; the
  integration is reported by ``devshim info`` and ``devshim patches`` and reverts.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import struct
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# isort: off
import devshim_core.auto  # noqa: F401  (activates devshim in this pytest process, before the frameworks)
import deepspeed

# isort: on
import pytest
import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

from devshim_core.errors import CheckpointError
from devshim_core.integrations.checkpoints import integration, patches
from devshim_core.patching import REGISTRY
from devshim_core.testing.launch import free_port

OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"
DEVSHIM = str(Path(sys.executable).with_name("devshim"))


pytestmark = pytest.mark.usefixtures("one_rank")  # tests/faults/conftest.py


@contextlib.contextmanager
def tiny_disk(path: Path, size: str = "64k") -> Iterator[Path]:
    """``path`` as a tmpfs of ``size``: a checkpoint disk that fills up part-way through a save."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "devshim-test", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def middle_of_largest_tensor(path: Path) -> int:
    """The offset of a byte in the middle of the largest tensor of a torch.save zip (stored, uncompressed)."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + name_length + extra_length + info.file_size // 2


def flat(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested state, in a fixed order."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        return [t for key in sorted(value, key=str) for t in flat(value[key])]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in flat(item)]
    return []


def same(a: Any, b: Any) -> bool:
    ta, tb = flat(a), flat(b)
    return len(ta) == len(tb) > 0 and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


# -- DeepSpeed: a real ZeRO-2 engine on one rank -------------------------------------------------------------------


def engine(width: int = 128) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    config = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
    built, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return built


def train(e: deepspeed.DeepSpeedEngine, steps: int) -> None:
    for step in range(steps):
        x = torch.randn(1, e.module.in_features, generator=torch.Generator().manual_seed(step))
        loss = e(x).square().mean()
        e.backward(loss)
        e.step()


def optimizer_state(e: deepspeed.DeepSpeedEngine) -> dict[str, Any]:
    return {"params": dict(e.module.state_dict()), "fp32": list(e.optimizer.single_partition_of_fp32_groups),
            "adam": e.optimizer.optimizer.state_dict()["state"]}


@pytest.fixture
def two_tags(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A save directory with global_step1 and global_step2 (``latest``); the state global_step2 holds."""
    e = engine()
    train(e, 1)
    e.save_checkpoint(str(tmp_path / "ckpt"))
    train(e, 1)
    e.save_checkpoint(str(tmp_path / "ckpt"))
    return tmp_path / "ckpt", optimizer_state(e)


def test_a_deepspeed_checkpoint_round_trips_and_its_records_sit_beside_the_tags_not_in_them(two_tags):
    """No fault: the records are in <save_dir>/.devshim-checksums/<tag>/, each tag directory holds only DeepSpeed's
    files (so its globs and zero_to_fp32 never meet a record), and a load gives the saved tensors back."""
    save_dir, saved = two_tags
    assert sorted(p.name for p in (save_dir / "global_step2").iterdir()) == [MODEL, OPTIM]
    record = json.loads((save_dir / ".devshim-checksums" / "global_step2" / f"{OPTIM}.json").read_text())
    assert record["bytes"] == (save_dir / "global_step2" / OPTIM).stat().st_size and len(record["sha256"]) == 64

    e = engine()
    path, _ = e.load_checkpoint(str(save_dir))
    assert Path(path).parent.name == "global_step2"
    assert same(optimizer_state(e), saved)

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(save_dir))
    assert same(consolidated, {k: v for k, v in saved["params"].items()})


def test_a_flipped_byte_in_optimizer_states_raises_naming_the_file_instead_of_loading_wrong_values(two_tags):
    """Fault: one byte of the fp32 optimizer states of global_step2 flipped on disk (what the chaos loop's job 17
    did). Without devshim, torch.load reads it without a word and training resumes with other values. User sees:
    CheckpointError naming the file, its recorded and actual sha256, and global_step1 to load instead."""
    save_dir, saved = two_tags
    victim = save_dir / "global_step2" / OPTIM
    flip(victim, middle_of_largest_tensor(victim))

    unchecked = TorchCheckpointEngine.load.__devshim_original__(TorchCheckpointEngine(), str(victim))
    loaded = unchecked["optimizer_state_dict"]
    assert not same([loaded["single_partition_of_fp32_groups"], loaded["base_optimizer_state"]["state"]],
                    [saved["fp32"], saved["adam"]]), "the flip missed the tensor data: the spec would prove nothing"

    with pytest.raises(CheckpointError) as raised:
        engine().load_checkpoint(str(save_dir))
    message = str(raised.value)
    assert f"the DeepSpeed checkpoint file {victim} is corrupt: its sha256 checksum is " in message
    assert "was recorded when it was saved" in message and "loading it would give wrong values" in message
    assert f"engine.load_checkpoint('{save_dir}', tag=TAG) with TAG one of global_step1; `latest` names " \
           "global_step2" in message


def test_a_truncated_file_raises_naming_it_and_both_sizes(two_tags):
    """Fault: the model states file of global_step2 cut to half (a copy interrupted, a disk that lost a page).
    User sees: CheckpointError naming the file, the bytes on disk and the bytes saved."""
    save_dir, _ = two_tags
    victim = save_dir / "global_step2" / MODEL
    size = victim.stat().st_size
    os.truncate(victim, size // 2)
    with pytest.raises(CheckpointError, match=f"{victim} is truncated: {size // 2} bytes on disk, {size} were saved"):
        engine().load_checkpoint(str(save_dir))


def test_a_checkpoint_saved_without_devshim_loads_as_before_and_a_truncated_one_is_named_with_its_size(two_tags):
    """No records (a checkpoint DeepSpeed wrote without devshim): it loads unchecked, with equal tensors. Fault: then
    one of its files truncated. User sees: CheckpointError naming the file and its size, saying it has no record,
    with torch's own error chained (today: 'PytorchStreamReader failed ... central directory' or '[Errno 22] Invalid
    argument', naming no file)."""
    import shutil

    save_dir, saved = two_tags
    shutil.rmtree(save_dir / ".devshim-checksums")
    e = engine()
    e.load_checkpoint(str(save_dir))
    assert same(optimizer_state(e), saved)

    victim = save_dir / "global_step2" / MODEL
    os.truncate(victim, victim.stat().st_size * 7 // 10)
    with pytest.raises(CheckpointError) as raised:
        engine().load_checkpoint(str(save_dir))
    message = str(raised.value)
    assert f"the DeepSpeed checkpoint file {victim} (" in message
    cause = raised.value.__cause__
    assert f"could not be read: it is truncated or corrupt ({type(cause).__name__}: " in message
    assert "It has no devshim checksum record" in message and "TAG one of global_step1" in message


def test_a_full_checkpoint_disk_names_the_file_and_says_no_space(tmp_path):
    """Fault: the save directory is a 64 KiB tmpfs; the model states file does not fit. User sees: CheckpointError
    naming the file, "no space left on device" and the free space, chained to torch's 'unexpected pos' error."""
    e = engine()
    train(e, 1)
    with tiny_disk(tmp_path / "disk") as disk:
        with pytest.raises(CheckpointError) as raised:
            e.save_checkpoint(str(disk))
        message = str(raised.value)
        assert f"could not save the DeepSpeed checkpoint file {disk / 'global_step1' / MODEL}: no space left on " \
               f"device on the filesystem of {disk / 'global_step1'} (" in message
        assert "the tag global_step1 in" in message and "do not load it" in message
        assert "unexpected pos" in str(raised.value.__cause__)
        assert not (disk / "latest").exists()


def test_a_file_size_limit_names_the_file_and_the_limit(tmp_path):
    """Fault: the process's file size limit (``ulimit -f``, RLIMIT_FSIZE) is below the optimizer states' size, with
    SIGXFSZ ignored (else the kernel kills the process). User sees: CheckpointError naming the file, "file too large"
    and the limit."""
    e = engine()
    train(e, 1)
    limit = 128 << 10  # the model states (about 68 KiB) fit, the optimizer states (about 200 KiB) do not
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        with pytest.raises(CheckpointError) as raised:
            e.save_checkpoint(str(tmp_path / "ckpt"))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    victim = tmp_path / "ckpt" / "global_step1" / OPTIM
    assert (f"could not save the DeepSpeed checkpoint file {victim}: file too large ({victim} reached this "
            "process's file size limit, 128.0 KiB (RLIMIT_FSIZE, `ulimit -f`))") in str(raised.value)


# -- megatron-core dist_checkpointing on one rank -------------------------------------------------------------------

WEIGHT = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)


def sharded(tensor: torch.Tensor) -> dict[str, Any]:
    return {"weight": ShardedTensor.from_rank_offsets("weight", tensor, replica_id=0), "iteration": 7}


@pytest.fixture
def dist_checkpoint(tmp_path: Path) -> Path:
    """iter_0000003 and iter_0000006 of a one-rank job; the second one is the one the tests corrupt."""
    for iteration in (3, 6):
        directory = tmp_path / f"iter_{iteration:07d}"
        directory.mkdir()
        dist_checkpointing.save(sharded(WEIGHT * iteration), str(directory))
    return tmp_path / "iter_0000006"


def load(directory: Path) -> dict[str, Any]:
    return dist_checkpointing.load({"weight": ShardedTensor.from_rank_offsets("weight", torch.zeros(64, 64),
                                                                              replica_id=0)}, str(directory))


def test_a_dist_checkpoint_round_trips_and_each_rank_records_the_files_it_wrote(dist_checkpoint):
    """No fault: rank 0's manifest lists its shard and the common files, and a load gives the saved tensor back."""
    manifest = json.loads((dist_checkpoint / ".devshim-checksums" / "rank0.json").read_text())
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    assert (manifest["rank"], manifest["world_size"]) == (0, 1)
    loaded = load(dist_checkpoint)
    assert torch.equal(loaded["weight"], WEIGHT * 6) and loaded["iteration"] == 7


def test_an_asynchronous_save_is_recorded_once_its_writes_are_finalized(tmp_path):
    """No fault: with ``async_sharded_save`` (Megatron-LM's --async-save) the files are written after save returns;
    the manifest is written by a finalize function of the request, after them, and the checkpoint then loads."""
    directory = tmp_path / "iter_0000001"
    directory.mkdir()
    request = dist_checkpointing.save(sharded(WEIGHT), str(directory), async_sharded_save=True)
    manifest = directory / ".devshim-checksums" / "rank0.json"
    assert not manifest.exists()
    request.execute_sync()
    assert "__0_0.distcp" in json.loads(manifest.read_text())["files"]
    assert torch.equal(load(directory)["weight"], WEIGHT)


def test_a_flipped_byte_in_a_distcp_shard_raises_naming_the_file_instead_of_loading_wrong_values(dist_checkpoint):
    """Fault: one byte of the tensor data of ``__0_0.distcp`` flipped (the chaos loop's job 22: losses off by 1e-4).
    Without devshim, dist_checkpointing loads it without a word. User sees: CheckpointError naming the file, both
    sha256 and the other iteration to load."""
    victim = dist_checkpoint / "__0_0.distcp"
    flip(victim, victim.stat().st_size // 2)
    original = dist_checkpointing.load.__devshim_original__
    unchecked = original({"weight": ShardedTensor.from_rank_offsets("weight", torch.zeros(64, 64), replica_id=0)},
                         str(dist_checkpoint))
    assert not torch.equal(unchecked["weight"], WEIGHT * 6), "the flip did not land in tensor data"

    with pytest.raises(CheckpointError) as raised:
        load(dist_checkpoint)
    message = str(raised.value)
    assert f"the Megatron checkpoint file {victim} is corrupt: its sha256 checksum is " in message
    assert f"(record: {dist_checkpoint / '.devshim-checksums' / 'rank0.json'}); loading it would give wrong " \
           "values" in message
    assert f"Load another checkpoint of {dist_checkpoint.parent} (iter_0000003;" in message


def test_a_truncated_shard_and_a_corrupt_common_file_are_named(dist_checkpoint):
    """Faults: ``__0_0.distcp`` truncated (job 13: 'metadata is None; ... pickle data was truncated'), then
    ``common.pt`` with a flipped byte (job 26: UnicodeDecodeError), read through load_common_state_dict as
    Megatron-LM does first. User sees: CheckpointError naming the file each time."""
    shard = dist_checkpoint / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size // 3)
    with pytest.raises(CheckpointError, match=f"{shard} is truncated: {size // 3} bytes on disk, {size} were saved"):
        load(dist_checkpoint)

    common = dist_checkpoint / "common.pt"
    flip(common, common.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=f"the Megatron checkpoint file {common} is corrupt: its sha256"):
        dist_checkpointing.load_common_state_dict(str(dist_checkpoint))


def test_a_dist_checkpoint_without_manifests_loads_and_a_corrupt_manifest_is_named(dist_checkpoint):
    """No manifest (saved without devshim): it loads unchecked, as before. Fault: a manifest that is not JSON. User
    sees: CheckpointError naming the manifest and saying how to load unchecked."""
    manifest = dist_checkpoint / ".devshim-checksums" / "rank0.json"
    manifest.write_text('{"files": {"common.pt": ')
    with pytest.raises(CheckpointError, match=f"devshim's checksum record {manifest} is corrupt or unreadable"):
        load(dist_checkpoint)
    manifest.unlink()
    assert torch.equal(load(dist_checkpoint)["weight"], WEIGHT * 6)


def test_a_full_disk_during_a_dist_checkpointing_save_names_the_checkpoint_and_says_no_space(tmp_path):
    """Fault: the checkpoint directory is a 64 KiB tmpfs and the shard is 128 KiB (the chaos loop's job 16). User
    sees: CheckpointError naming the checkpoint, "no space left on device" and the free space."""
    with tiny_disk(tmp_path / "disk") as disk, pytest.raises(CheckpointError) as raised:
        dist_checkpointing.save(sharded(torch.ones(128, 256)), str(disk))
    message = str(raised.value)
    assert f"could not save the Megatron checkpoint {disk}: no space left on device on the filesystem of {disk} (" \
           in message and "do not load it" in message


SHM_JOB = """
import sys

if __name__ == "__main__":  # all under the guard: Megatron's writer spawns a manager process that imports this file
    import devshim_core.auto  # noqa: F401  first: activates devshim
    import torch, torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(16, 16), replica_id=0)}, sys.argv[1])
"""


def test_a_full_dev_shm_during_a_dist_checkpointing_save_names_dev_shm_and_why_megatron_needs_it(tmp_path):
    """Fault: /dev/shm is a full 1 MiB tmpfs (a private mount namespace: nothing else sees it; the chaos loop's job
    20). Megatron's checkpoint writer makes a multiprocessing queue, whose semaphore lives there. User sees:
    CheckpointError naming /dev/shm and the writer, not a bare '[Errno 28] No space left on device'."""
    if os.geteuid() != 0:
        pytest.skip("a private /dev/shm needs root (unshare, mount)")
    job = tmp_path / "shm_job.py"
    job.write_text(SHM_JOB)
    (tmp_path / "ckpt").mkdir()
    script = ("mount -t tmpfs -o size=1m devshim-test-shm /dev/shm || exit 97; "
              "cat /dev/zero > /dev/shm/filler 2>/dev/null; exec \"$@\"")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVSHIM_")} | {
        "DEVSHIM_PLUGIN": "cpu_reference", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh",
                           sys.executable, str(job), str(tmp_path / "ckpt"), str(free_port())],
                          env=env, capture_output=True, text=True, timeout=120)
    if done.returncode == 97:
        pytest.skip(f"cannot mount a private /dev/shm here: {done.stderr[-300:]}")
    last = [line for line in done.stderr.splitlines() if "Error" in line][-1]
    assert "devshim_core.errors.CheckpointError: could not save the Megatron checkpoint " \
           f"{tmp_path / 'ckpt'}: no space left on device on /dev/shm (" in last, done.stderr[-3000:]
    assert "the queue's semaphore lives in /dev/shm" in last and "--shm-size" in last


# -- megatron-core on two ranks: one verdict for both ---------------------------------------------------------------

TWO_RANK_JOB = """
import json, sys
from pathlib import Path


def half(tensor, rank):  # tensor parallel 2: rank r holds columns [256 r, 256 (r + 1)) of one [8, 512] weight
    from megatron.core.dist_checkpointing import ShardedTensor

    return {"w": ShardedTensor.from_rank_offsets("w", tensor, (1, rank, 2))}


if __name__ == "__main__":  # all under the guard: Megatron's writer spawns a manager process that imports this file
    import devshim_core.auto  # noqa: F401  first: activates devshim
    import torch, torch.distributed as dist
    from megatron.core import dist_checkpointing
    from devshim_core.errors import CheckpointError

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out, directory = Path(sys.argv[1]), Path(sys.argv[2])
    mine = torch.arange(8 * 512, dtype=torch.float32).reshape(8, 512)[:, 256 * rank:256 * (rank + 1)].contiguous()
    dist_checkpointing.save(half(mine, rank), str(directory))
    report = {"round trip equal": torch.equal(dist_checkpointing.load(half(torch.zeros_like(mine), rank),
                                                                      str(directory))["w"], mine)}
    dist.barrier()
    if rank == 0:  # rank 1's shard: a byte in the middle of its tensor data
        victim = directory / "__1_0.distcp"
        with open(victim, "r+b") as f:
            f.seek(victim.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    try:
        dist_checkpointing.load(half(torch.zeros_like(mine), rank), str(directory))
        report["after the flip"] = "loaded"
    except CheckpointError as exc:
        report["after the flip"] = str(exc)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()
"""


def test_two_ranks_raise_the_same_error_naming_a_corrupt_shard_before_either_loads(tmp_path):
    """Fault: two tensor-parallel ranks saved, then one byte of rank 1's shard ``__1_0.distcp`` flipped. The ranks
    split the files between them to check (rank 0 checks rank 1's shard) and exchange verdicts. User sees: on both
    ranks, within seconds, the same CheckpointError naming the file and the rank that found it; no rank loads."""
    job = tmp_path / "two_rank_job.py"
    job.write_text(TWO_RANK_JOB)
    (tmp_path / "ckpt").mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("DEVSHIM_")} | {
        "DEVSHIM_PLUGIN": "cpu_reference", "DEVSHIM_CPU_DEVICE_COUNT": "2", "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    ranks = [subprocess.Popen([sys.executable, str(job), str(tmp_path), str(tmp_path / "ckpt")],
                              env=base | {"RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    deadline = time.monotonic() + 120
    errors = []
    for process in ranks:
        try:
            _, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in ranks:
                p.kill()
            pytest.fail("a rank hung past 120 s")
        errors.append(err[-3000:])
        assert process.returncode == 0, err[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(report["round trip equal"] for report in reports), reports
    victim = tmp_path / "ckpt" / "__1_0.distcp"
    for rank, report in enumerate(reports):
        assert report["after the flip"].startswith(f"rank {rank}: the Megatron checkpoint file {victim} is corrupt: "
                                                   "its sha256 checksum is "), report
        assert f"every rank stops before reading {tmp_path / 'ckpt'} (rank 0 found this)" in report["after the flip"]
    assert reports[0]["after the flip"][len("rank 0"):] == reports[1]["after the flip"][len("rank 1"):]


# -- the integration: declared, reported, revertible ----------------------------------------------------------------


def test_the_integration_is_reported_by_devshim_info_and_devshim_patches_and_turned_off_by_name():
    """``devshim info`` reports each set on a line of its own; ``devshim patches`` lists every patch with its target,
    versions and reason; DEVSHIM_DISABLE=checkpoints turns the integration off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVSHIM_")} | {"DEVSHIM_PLUGIN": "cpu_reference"}
    info = subprocess.run([DEVSHIM, "info", "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr[-3000:]
    report = json.loads(info.stdout)
    assert report["integrations"]["checkpoints-deepspeed"] == integration.APPLIED
    assert report["integrations"]["checkpoints-megatron-core"] == "armed: applied when megatron.core is imported"
    assert {(row["set"], row["name"], row["target"]) for row in report["patches"]} >= {
        ("checkpoints-deepspeed", "checksum-on-save", f"{patches.ENGINE}.save"),
        ("checkpoints-deepspeed", "verify-on-load", f"{patches.ENGINE}.load")}

    listed = subprocess.run([DEVSHIM, "patches"], env=env, capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr[-3000:]
    rows = [row for row in json.loads(listed.stdout) if row["set"].startswith("checkpoints-")]
    assert {row["name"] for row in rows if row["set"] == "checkpoints-megatron-core"} >= {
        "manifest-on-save", "manifest-on-save-reexport", "verify-on-load", "verify-common-state"}
    assert all(row["requires"] and len(row["reason"]) > 20 for row in rows), rows

    probe = ("import json, devshim_core.auto as auto, deepspeed\n"
             "print(json.dumps({k: v for k, v in auto.session.integrations.items() if k.startswith('checkpoints')}))")
    off = subprocess.run([sys.executable, "-c", probe], env=env | {"DEVSHIM_DISABLE": "checkpoints"},
                         capture_output=True, text=True, timeout=120)
    assert off.returncode == 0, off.stderr[-3000:]
    assert json.loads(off.stdout.splitlines()[-1]) == {"checkpoints": "skipped: DEVSHIM_DISABLE=checkpoints"}


def test_the_deepspeed_set_reverts_to_deepspeeds_own_methods_and_applies_again_idempotently():
    """Reverting the set restores TorchCheckpointEngine.save/load themselves; applying it twice patches once."""
    from devshim_core.session import current

    session = current()
    assert session is not None
    patched_save = TorchCheckpointEngine.save
    original_save = patched_save.__devshim_original__
    assert REGISTRY.revert(patches.DEEPSPEED_CHECKPOINTS.name)
    try:
        assert TorchCheckpointEngine.save is original_save
        assert not hasattr(TorchCheckpointEngine.load, "__devshim_original__")
    finally:
        REGISTRY.apply(patches.DEEPSPEED_CHECKPOINTS, session.device)
    REGISTRY.apply(patches.DEEPSPEED_CHECKPOINTS, session.device)
    assert TorchCheckpointEngine.save.__devshim_original__ is original_save
    assert not hasattr(TorchCheckpointEngine.save.__devshim_original__, "__devshim_original__")
