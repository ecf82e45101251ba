"""megatron-core's ``dist_checkpointing`` save and load with a checksum manifest per rank, checked before a load.

``save`` is collective: each rank writes its shards (``__{rank}_{i}.distcp``), rank 0 also ``.metadata``,
``common.pt`` and ``metadata.json``. Once the save has returned (or, for an asynchronous save, once its writes are
finalized), each rank records the files it wrote in ``<checkpoint>/.devshim-checksums/rank{rank}.json``; rank 0
records every file that is not a rank's shard. A hidden directory inside the checkpoint: Megatron reads only the
files its metadata names, and a listing of the checkpoint's files does not see it.

``load`` is collective too: before Megatron reads anything, the ranks split the recorded files between them (each
file is read once, by one rank), and then exchange their verdicts (``all_gather_object``, as Megatron's own load
does on the same group), so that every rank raises the same error, naming the file, or every rank loads. No rank
goes on alone into a load its peers refused.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from devshim_core import log
from devshim_core.device import Device
from devshim_core.errors import CheckpointError
from devshim_core.integrations.checkpoints import integrity

SERIALIZATION = "megatron.core.dist_checkpointing.serialization"
PACKAGE = "megatron.core.dist_checkpointing"
COMMON = "common.pt"
_SHARD = re.compile(r"__(\d+)_\d+\.distcp$")  # torch DCP's and Megatron's writers: __{rank}_{file number}.distcp
logger = log.logger("checkpoints")


def manifest_path(directory: Path, rank: int) -> Path:
    return directory / integrity.CHECKSUM_DIR / f"rank{rank}.json"


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _local(checkpoint_dir: Any) -> Path | None:
    """The checkpoint's directory on this machine's filesystem; ``None`` for an object-store URL (``msc://``)."""
    if not isinstance(checkpoint_dir, (str, os.PathLike)) or "://" in os.fspath(checkpoint_dir):
        return None
    return Path(os.fspath(checkpoint_dir))


def _files_of(directory: Path, rank: int) -> list[Path]:
    """The files ``rank`` wrote: its own shards; for rank 0 also every file that is no rank's shard."""
    found = []
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory)
        if relative.parts[0] == integrity.CHECKSUM_DIR or not path.is_file():
            continue
        shard = _SHARD.search(path.name)
        if (shard is not None and int(shard[1]) == rank) or (shard is None and rank == 0):
            found.append(path)
    return found


def _forget_old_manifests(directory: Path, rank: int, world: int) -> None:
    """Before a save into ``directory``: a manifest of an earlier save there would not match the new files."""
    folder = directory / integrity.CHECKSUM_DIR
    manifest_path(directory, rank).unlink(missing_ok=True)
    if rank == 0 and folder.is_dir():  # those of ranks the earlier save had and this one has not
        for stale in folder.glob("rank*.json"):
            number = stale.stem[len("rank"):]
            if number.isdigit() and int(number) >= world:
                stale.unlink(missing_ok=True)


def write_manifest(directory: Path, rank: int, world: int) -> None:
    files = {path.relative_to(directory).as_posix(): integrity.digest(path).as_json()
             for path in _files_of(directory, rank)}
    integrity.write_json(manifest_path(directory, rank), {"format": integrity.FORMAT, "rank": rank,
                                                          "world_size": world, "files": files})


def _save_failed(exc: BaseException, directory: Path) -> CheckpointError | None:
    space = integrity.no_space(exc, directory)
    if space is None:
        return None
    if space.where == integrity.SHM:
        what = (f"{space.reason} on /dev/shm ({integrity.size_text(space.free)} free): megatron-core's checkpoint "
                "writer (dist_checkpointing's FileSystemWriterAsync) makes a multiprocessing queue for its write "
                "workers, and the queue's semaphore lives in /dev/shm. Free space in /dev/shm or give the job a "
                "larger one (docker run --shm-size, a larger tmpfs mounted on /dev/shm)")
    else:
        what = f"{space.describe()}. Free space there or save to a directory with room"
    return CheckpointError(f"{integrity.rank_prefix()}could not save the Megatron checkpoint {directory}: {what}; "
                           f"{directory.name} is incomplete: do not load it, load the previous checkpoint.")


def _other_checkpoints(directory: Path) -> str:
    parent = directory.parent
    names: list[str] = []
    with contextlib.suppress(OSError):
        names = sorted((entry.name for entry in parent.iterdir()
                        if entry != directory and not entry.name.startswith(".") and entry.is_dir()
                        and ((entry / "metadata.json").is_file() or (entry / ".metadata").is_file())),
                       key=integrity.natural)
    if not names:
        return f"There is no other checkpoint in {parent} to load: restore the file from a copy."
    return (f"Load another checkpoint of {parent} ({', '.join(names)}; Megatron-LM: --ckpt-step, or the iteration "
            "in latest_checkpointed_iteration.txt), or restore the file from a copy.")


def _manifests(directory: Path) -> dict[str, tuple[integrity.Digest, Path]]:
    """Every recorded file of the checkpoint (its path relative to it), with its record and the manifest holding it.
    A manifest that cannot be read raises ValueError, naming it."""
    folder = directory / integrity.CHECKSUM_DIR
    recorded: dict[str, tuple[integrity.Digest, Path]] = {}
    if not folder.is_dir():
        return recorded
    ranks, worlds = set(), set()
    for manifest in sorted(folder.glob("rank*.json"), key=lambda p: integrity.natural(p.name)):
        data = integrity.read_json(manifest)
        try:
            for name, record in data["files"].items():
                if Path(name).is_absolute() or ".." in Path(name).parts:  # a record names files of this checkpoint
                    raise ValueError(f"{name!r} is not a file of the checkpoint")
                recorded[name] = (integrity.Digest.from_json(record), manifest)
            ranks.add(int(data["rank"]))
            worlds.add(int(data["world_size"]))
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            raise ValueError(f"devshim's checksum record {manifest} is corrupt ({type(exc).__name__}: {exc})"
                             ) from exc
    missing = sorted(set(range(max(worlds, default=0))) - ranks)
    if missing and _rank_and_world()[0] == 0:
        logger.warning(f"the Megatron checkpoint {directory} has no checksum manifest of rank(s) "
                       f"{', '.join(map(str, missing))} (their save did not finish recording it): their shards are "
                       "loaded unchecked")
    return recorded


def _problem(directory: Path, names: list[str], recorded: dict[str, tuple[integrity.Digest, Path]]) -> str | None:
    for name in names:
        record, manifest = recorded[name]
        problem = integrity.mismatch(directory / name, record)
        if problem is not None:
            return f"the Megatron checkpoint file {problem} (record: {manifest}); loading it would give wrong values"
    return None


def _unreadable_record(exc: ValueError, directory: Path) -> str:
    return f"{exc}: the checkpoint {directory} cannot be checked (delete the record to load it unchecked)"


def verify(directory: Path) -> None:
    """Every rank checks its share of the recorded files, then all ranks raise the first problem found, or none."""
    rank, world = _rank_and_world()
    problem: str | None
    try:
        recorded = _manifests(directory)
        problem = _problem(directory, sorted(recorded)[rank::world], recorded)
    except ValueError as exc:
        problem = _unreadable_record(exc, directory)
    except Exception as exc:  # any rank's failure becomes its verdict: raised alone, it would leave the others waiting
        problem = f"the Megatron checkpoint {directory} could not be checked ({type(exc).__name__}: {exc})"
    if world > 1:
        verdicts: list[str | None] = [None] * world
        dist.all_gather_object(verdicts, problem)
    else:
        verdicts = [problem]
    found = [(r, p) for r, p in enumerate(verdicts) if p]
    if found:
        by, first = found[0]
        more = f", and {len(found) - 1} more rank(s) found others" if len(found) > 1 else ""
        everyone = f"; every rank stops before reading {directory} (rank {by} found this{more})" if world > 1 else ""
        raise CheckpointError(f"{integrity.rank_prefix()}{first}{everyone}. {_other_checkpoints(directory)}")


def checked_save(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    def save(sharded_state_dict: Any, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        directory = _local(checkpoint_dir)
        rank, world = _rank_and_world()
        try:
            if directory is not None:
                _forget_old_manifests(directory, rank, world)
            result = original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
            if directory is not None:
                if isinstance(getattr(result, "finalize_fns", None), list):  # an async save: written later
                    result.finalize_fns.append(lambda: _record(directory, rank, world))
                else:
                    write_manifest(directory, rank, world)
        except BaseException as exc:
            error = _save_failed(exc, directory) if directory is not None and integrity.failed(exc) else None
            if error is None:
                raise
            raise error from exc
        return result

    save.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return save


def _record(directory: Path, rank: int, world: int) -> None:
    try:
        write_manifest(directory, rank, world)
    except BaseException as exc:
        error = _save_failed(exc, directory) if integrity.failed(exc) else None
        if error is None:
            raise
        raise error from exc


def checked_load(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    def load(sharded_state_dict: Any, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        directory = _local(checkpoint_dir)
        if directory is not None:
            verify(directory)
        return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)

    load.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return load


def checked_load_common(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    """``load_common_state_dict``, which Megatron-LM calls before ``load`` (and a tool may call on one rank alone):
    only ``common.pt`` is checked, by the calling rank; every caller reads the same file and so reaches the same
    verdict without a collective."""

    def load_common_state_dict(checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        directory = _local(checkpoint_dir)
        if directory is not None:
            try:
                recorded = _manifests(directory)
                problem = _problem(directory, [COMMON] if COMMON in recorded else [], recorded)
            except ValueError as exc:
                problem = _unreadable_record(exc, directory)
            if problem is not None:
                raise CheckpointError(f"{integrity.rank_prefix()}{problem}. {_other_checkpoints(directory)}")
        return original(checkpoint_dir, *args, **kwargs)

    load_common_state_dict.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark
    return load_common_state_dict


def forgetting_manifests(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    """``remove_sharded_tensors`` rewrites a saved checkpoint in place (files removed, ``.metadata`` rewritten): its
    manifests would then fail a good checkpoint, so they go, and it loads unchecked."""

    def remove_sharded_tensors(checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(checkpoint_dir, *args, **kwargs)
        directory = _local(checkpoint_dir)
        if directory is not None:
            shutil.rmtree(directory / integrity.CHECKSUM_DIR, ignore_errors=True)
        return result

    remove_sharded_tensors.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark
    return remove_sharded_tensors
