"""DeepSpeed's ``TorchCheckpointEngine`` with a checksum record per checkpoint file and a full disk named.

DeepSpeed writes a tag's files (``mp_rank_00_model_states.pt``, ``zero_pp_rank_1_mp_rank_00_optim_states.pt``, ...)
through its checkpoint engine, each rank its own. Each file's record goes to
``<save_dir>/.devshim-checksums/<tag>/<file>.json``: beside the tag, not in it, so that DeepSpeed's loaders,
``zero_to_fp32.py`` and any tool that loads every file of a tag never meet it. A file's old record is removed before
the file is rewritten: a crash between the two writes leaves a file without a record (loaded unchecked, as before),
never a good file with a stale record.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devshim_core.device import Device
from devshim_core.errors import CheckpointError
from devshim_core.integrations.checkpoints import integrity

# the files DeepSpeed writes into a tag directory (engine, ZeRO, pipeline layers, MoE experts); others, such as
# save_16bit_model's pytorch_model.bin in a directory of the user's, get no record
CHECKPOINT_FILE = re.compile(r"[_-](model|optim)_states\.pt$")


def record_path(path: Path) -> Path:
    return path.parent.parent / integrity.CHECKSUM_DIR / path.parent.name / f"{path.name}.json"


def _other_tags(path: Path) -> str:
    """What the user can load instead: the other tags of the save directory, and what ``latest`` names."""
    save_dir, tag = path.parent.parent, path.parent.name
    tags: list[str] = []
    with contextlib.suppress(OSError):
        for entry in save_dir.iterdir():
            if entry.is_dir() and entry.name != tag and not entry.name.startswith("."):
                with contextlib.suppress(OSError):
                    if any(CHECKPOINT_FILE.search(f.name) for f in entry.iterdir()):
                        tags.append(entry.name)
    latest = ""
    with contextlib.suppress(OSError):
        latest = f"; `latest` names {(save_dir / 'latest').read_text().strip()}"
    if not tags:
        return f"there is no other tag in {save_dir} to load{latest}: restore the file from a copy"
    return (f"load another tag of {save_dir}: engine.load_checkpoint({str(save_dir)!r}, tag=TAG) with TAG one of "
            f"{', '.join(sorted(tags, key=integrity.natural))}{latest}; or restore the file from a copy")


def _verified(path: Path) -> bool:
    """Checks ``path`` against its record: True if it matches, False if it has none; raises if it differs."""
    record = record_path(path)
    if not record.is_file():
        return False
    try:
        recorded = integrity.read_digest(record)
    except ValueError as exc:
        raise CheckpointError(f"{integrity.rank_prefix()}{exc}: the DeepSpeed checkpoint file {path} cannot be "
                              f"checked. Delete the record to load {path.name} unchecked, or {_other_tags(path)}."
                              ) from exc
    problem = integrity.mismatch(path, recorded)
    if problem is not None:
        raise CheckpointError(f"{integrity.rank_prefix()}the DeepSpeed checkpoint file {problem} (record: {record}); "
                              f"loading it would give wrong values. {integrity.sentence(_other_tags(path))}.")
    return True


def checked_save(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    def save(self: Any, state_dict: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        file = Path(path)
        record = record_path(file) if CHECKPOINT_FILE.search(file.name) else None
        try:
            if record is not None:
                record.unlink(missing_ok=True)
            result = original(self, state_dict, path, *args, **kwargs)
            if record is not None:
                integrity.write_json(record, {"format": integrity.FORMAT, "file": file.name,
                                              **integrity.digest(file).as_json()})
        except BaseException as exc:
            space = integrity.no_space(exc, file) if integrity.failed(exc) else None
            if space is None:
                raise
            partial = (f"the tag {file.parent.name} in {file.parent.parent} is incomplete: do not load it, load the "
                       "previous tag" if record is not None else f"{file.name} is incomplete")
            raise CheckpointError(f"{integrity.rank_prefix()}could not save the DeepSpeed checkpoint file {file}: "
                                  f"{space.describe()}. Free space there or save to a directory with room; {partial}."
                                  ) from exc
        return result

    save.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return save


def checked_load(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    def load(self: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        file = Path(path)
        if not CHECKPOINT_FILE.search(file.name):
            return original(self, path, *args, **kwargs)
        verified = _verified(file)
        try:
            return original(self, path, *args, **kwargs)
        except Exception as exc:
            if verified or not integrity.unreadable(exc):
                raise
            size = file.stat().st_size if file.is_file() else None
            cause = (str(exc).strip().splitlines() or [""])[0][:200]
            raise CheckpointError(f"{integrity.rank_prefix()}the DeepSpeed checkpoint file {file} "
                                  f"({integrity.size_text(size)}) could not be read: it is truncated or corrupt "
                                  f"({type(exc).__name__}: {cause}). It has no devshim checksum record (it was saved "
                                  f"without devshim, or its save did not finish). "
                                  f"{integrity.sentence(_other_tags(file))}.") from exc

    load.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return load
