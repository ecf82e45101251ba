"""The dump one rank of one run writes: an index of records and the sampled values they point into.

A rank's directory holds ``records.jsonl`` (one JSON object per record, appended as the run goes), ``values.f32``
(the sampled values, little-endian float32, appended in the same order) and ``meta.json`` (written when recording
starts and rewritten when it ends, so a run that died says so). A record names where its values are
(``offset``, ``count``) and summarises the whole tensor (``norm``, ``max_abs``), whatever was sampled.

Sampling is deterministic and the same in both runs: ``count`` elements evenly spaced over the flattened tensor
(:func:`sample_indices`), all of them for a tensor no larger than the sample size or for a module named for full
dumps. It reads the tensor and copies the sample to the host; it never writes to the tensor nor draws from any
random generator, so the script computes what it computes without ``compare``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from devshim_core.compare.names import DEFAULT_SAMPLE

RECORDS, VALUES, META = "records.jsonl", "values.f32", "meta.json"
__all__ = ["DEFAULT_SAMPLE", "Dump", "DumpWriter", "Record", "rank_directories", "sample_indices"]


@dataclass(frozen=True)
class Record:
    """One sampled tensor of one step.

    ``kind``: ``init_param`` (a parameter as the run starts: recorded when its model is first called),
    ``forward`` (a module's output), ``grad_output`` (the gradient reaching that output in the backward),
    ``grad_param`` (a parameter's gradient from this rank's backward, before any reduction), ``optimizer_grad``
    (the gradient an optimizer steps with: reduced, and for ZeRO a flat partition) or ``param`` (a parameter after
    the step). ``module`` is the module's path in its model (``GPT.decoder.layers.0.mlp``), or the parameter's.
    ``call``: which call of that module in the step (a shared or recomputed module runs more than once);
    ``tensor``: where in the output the tensor sits (``0``, ``logits``, ``1.0``; ``.`` for a bare tensor).
    ``order``: the record's place in its step, as the run made them.
    """

    step: int
    order: int
    kind: str
    module: str
    call: int
    tensor: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    offset: int
    count: int
    norm: float
    max_abs: float

    @property
    def key(self) -> tuple[int, str, str, int, str]:
        """What pairs a record with its counterpart in the other run."""
        return (self.step, self.kind, self.module, self.call, self.tensor)


def sample_indices(numel: int, count: int, device: torch.device) -> torch.Tensor | None:
    """``count`` evenly spaced indices into ``numel`` elements (``None``: take them all)."""
    if numel <= count:
        return None
    return torch.linspace(0, numel - 1, count, device=device).round().long()


def _float32_bytes(values: torch.Tensor) -> bytes:
    """Little-endian float32 bytes of a host tensor (numpy's when installed: torch does not require it)."""
    try:
        return values.contiguous().numpy().astype("<f4").tobytes()
    except (ImportError, RuntimeError):  # torch raises RuntimeError "Numpy is not available"
        return struct.pack(f"<{values.numel()}f", *values.tolist())


class DumpWriter:
    """Appends one rank's records and values; every write is flushed, so a killed run keeps what it recorded."""

    def __init__(self, directory: Path, meta: dict[str, Any]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.meta = dict(meta, complete=False, steps=0)
        self._records = open(directory / RECORDS, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._values = open(directory / VALUES, "wb")  # noqa: SIM115 - closed in close()
        self._offset = 0
        self._write_meta()

    def _write_meta(self) -> None:
        tmp = self.directory / (META + ".tmp")
        tmp.write_text(json.dumps(self.meta, indent=1))
        os.replace(tmp, self.directory / META)

    def add(self, *, step: int, order: int, kind: str, module: str, call: int, tensor: str, value: torch.Tensor,
            sample: int) -> None:
        flat = value.detach().reshape(-1)
        numel = flat.numel()
        indices = sample_indices(numel, sample, flat.device)
        picked = (flat if indices is None else flat[indices]).to(device="cpu", dtype=torch.float32)
        # accumulated in fp32 without an fp32 copy of the tensor: this runs for every tensor of every step
        norm = float(torch.linalg.vector_norm(flat, dtype=torch.float32)) if numel else 0.0
        max_abs = float(torch.linalg.vector_norm(flat, ord=float("inf"), dtype=torch.float32)) if numel else 0.0
        record = Record(step=step, order=order, kind=kind, module=module, call=call, tensor=tensor,
                        dtype=str(value.dtype).removeprefix("torch."), shape=tuple(value.shape), numel=numel,
                        offset=self._offset, count=picked.numel(), norm=norm, max_abs=max_abs)
        self._values.write(_float32_bytes(picked))
        self._offset += picked.numel()
        self._records.write(json.dumps(asdict(record)) + "\n")
        self._records.flush()
        self._values.flush()

    def step_done(self, steps: int) -> None:
        self.meta["steps"] = steps
        self._write_meta()

    def close(self, complete: bool) -> None:
        if self._records.closed:
            return
        self._records.close()
        self._values.close()
        self.meta["complete"] = complete
        self._write_meta()


class Dump:
    """One rank's dump, read back: its meta, its records in order, and each record's values."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        meta_path = directory / META
        if not meta_path.exists():
            raise FileNotFoundError(f"{directory} holds no {META}: the run recorded nothing there (did the script "
                                    "activate devshim? `import devshim_core.auto`, or run it with DEVSHIM_AUTO=1)")
        self.meta: dict[str, Any] = json.loads(meta_path.read_text())
        self.records = list(self._read_records())
        self._values = (directory / VALUES).read_bytes()

    def _read_records(self) -> Iterator[Record]:
        with open(self.directory / RECORDS, encoding="utf-8") as lines:
            for line in lines:
                if line.strip():
                    fields = json.loads(line)
                    fields["shape"] = tuple(fields["shape"])
                    yield Record(**fields)

    def values(self, record: Record) -> torch.Tensor:
        start = record.offset * 4
        data = self._values[start:start + record.count * 4]
        if len(data) != record.count * 4:  # a run killed between the two writes of its last record
            raise ValueError(f"{self.directory / VALUES} ends before record {record.key}: the run was cut short")
        return torch.tensor(struct.unpack(f"<{record.count}f", data), dtype=torch.float32)


def rank_directories(run: Path) -> dict[int, Path]:
    """``rank<N>`` directories of one run, by rank."""
    return {int(p.name.removeprefix("rank")): p for p in sorted(run.glob("rank*"))
            if p.is_dir() and p.name.removeprefix("rank").isdigit()}
