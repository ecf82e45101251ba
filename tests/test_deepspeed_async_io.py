"""DeepSpeed's ``async_io`` op (ZeRO-Infinity's NVMe offload), served by devshim: no libaio, no compiled op.

The op is what ``deepspeed.ops.op_builder.AsyncIOBuilder().load()`` returns once devshim is active, so these
specs call it as DeepSpeed's swappers and ``deepspeed.io``'s writers do. The engine under it is the plugin's
(``devshim_kernels.file_io``'s native thread pool for devshim's plugins). End to end, ZeRO-Infinity to NVMe is
``tests/e2e/test_deepspeed_reference.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

# isort: off
import devshim_core.auto  # noqa: F401  (activates devshim in this pytest process, before deepspeed)
import deepspeed  # noqa: F401

# isort: on
import jit_watch
import pytest
import torch
from deepspeed.ops.op_builder import AsyncIOBuilder
from devshim_kernels import file_io

from devshim_core.integrations.deepspeed.aio import AsyncIOOp

jit_compilations = jit_watch.fixture()
MiB = 1 << 20


@pytest.fixture(scope="module")
def aio() -> AsyncIOOp:
    return AsyncIOBuilder().load()


@pytest.fixture
def handle(aio):
    return aio.aio_handle(block_size=MiB, queue_depth=8, single_submit=False, overlap_events=True,
                          intra_op_parallelism=2)


def random_bytes(nbytes: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def test_deepspeeds_builder_loads_devshims_op_without_compiling(aio):
    assert isinstance(aio, AsyncIOOp)
    assert AsyncIOBuilder().is_compatible()
    assert file_io.AVAILABLE, file_io.REASON  # the install built the native engine; no silent fallback


def test_the_handle_reports_its_configuration_as_deepspeed_reads_it(handle):
    assert (handle.get_block_size(), handle.get_queue_depth(), handle.get_single_submit(),
            handle.get_overlap_events(), handle.get_intra_op_parallelism()) == (MiB, 8, False, True, 2)
    assert handle.get_alignment() == 2 * 512  # deepspeed.io aligns its buffers to this


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 3 * MiB + 17, 8 * MiB], ids=lambda n: f"{n}B")
def test_an_asynchronous_write_then_read_round_trips_every_byte(handle, tmp_path, nbytes):
    # sizes around the page and block boundaries: whole pages go O_DIRECT, the rest through the page cache
    data = random_bytes(nbytes)
    path = str(tmp_path / "t.swp")
    assert handle.async_pwrite(data, path) == 0
    assert handle.wait() == 1
    assert os.path.getsize(path) == nbytes
    back = torch.empty_like(data)
    assert handle.async_pread(back, path) == 0
    assert handle.wait() == 1
    assert torch.equal(back, data)


def test_the_synchronous_forms_return_the_count_of_completed_transfers(handle, tmp_path):
    data = torch.randn(MiB // 2, generator=torch.Generator().manual_seed(1))
    path = str(tmp_path / "t.swp")
    assert handle.sync_pwrite(data, path) == 1
    back = torch.empty_like(data)
    assert handle.sync_pread(back, path) == 1
    assert torch.equal(back, data)
    assert handle.pwrite(data, path, True, False) == 1  # validate=True, async=False
    assert handle.pread(back.zero_(), path, True, False) == 1 and torch.equal(back, data)
    assert handle.write(data, path, True) == 0 and handle.read(back.zero_(), path, True) == 0  # "non-parallel"
    assert torch.equal(back, data)


def test_wait_counts_every_transfer_submitted_since_the_last_wait(handle, tmp_path):
    tensors = [random_bytes(MiB + 512 * i, seed=i) for i in range(5)]
    for i, tensor in enumerate(tensors):
        assert handle.async_pwrite(tensor, str(tmp_path / f"{i}.swp")) == 0
    assert handle.wait() == 5
    backs = [torch.empty_like(t) for t in tensors]
    for i, back in enumerate(backs):
        handle.async_pread(back, str(tmp_path / f"{i}.swp"))
    assert handle.wait() == 5
    assert all(torch.equal(a, b) for a, b in zip(backs, tensors, strict=True))


def test_file_offsets_address_parts_of_one_file(handle, tmp_path):
    path = str(tmp_path / "t.swp")
    first, second = random_bytes(MiB, seed=2), random_bytes(MiB, seed=3)
    handle.async_pwrite(first, path, 0)
    handle.async_pwrite(second, path, MiB)
    assert handle.wait() == 2
    back = torch.empty(MiB, dtype=torch.uint8)
    assert handle.sync_pread(back, path, MiB) == 1 and torch.equal(back, second)


def test_a_write_to_an_open_descriptor_leaves_it_open(handle, tmp_path):
    # deepspeed.io's fast checkpoint writer hands the op a descriptor of its own
    path = tmp_path / "checkpoint.pt"
    data = random_bytes(2 * MiB, seed=4)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        assert handle.async_pwrite(data, fd, 0) == 0
        assert handle.wait() == 1
        os.fstat(fd)  # still open
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(data.tolist())


def test_tensors_that_are_not_contiguous_host_memory_go_through_a_bounce_copy(handle, tmp_path):
    strided = torch.arange(2 * MiB, dtype=torch.float32).reshape(1024, 2048).t()
    path = str(tmp_path / "t.swp")
    assert handle.sync_pwrite(strided, path) == 1
    back = torch.empty(1024, 2048).t()  # reading into a strided view fills it in place
    assert handle.sync_pread(back, path) == 1
    assert torch.equal(back, strided)


def test_locked_buffers_are_page_aligned_and_recognised_with_their_views(handle, aio):
    example = torch.empty(0, dtype=torch.bfloat16)
    buffer = handle.new_cpu_locked_tensor(3 * MiB, example)
    assert buffer.dtype == torch.bfloat16 and buffer.numel() == 3 * MiB and buffer.data_ptr() % 4096 == 0
    assert handle.is_pinned(buffer) and handle.is_pinned(buffer.narrow(0, 1024, MiB))
    other = aio.aio_handle()  # the op's handles share its buffers, as DeepSpeed's share one pinned-tensor manager
    assert other.is_pinned(buffer)
    assert not handle.is_pinned(torch.empty(16))
    assert handle.free_cpu_locked_tensor(buffer) and not handle.is_pinned(buffer)
    assert not handle.free_cpu_locked_tensor(buffer)


def test_a_read_of_a_missing_file_raises_naming_it_and_queues_nothing(handle, tmp_path):
    missing = tmp_path / "never-written.swp"
    with pytest.raises(OSError, match=r"never-written\.swp"):
        handle.async_pread(torch.empty(16), str(missing))
    assert handle.sync_pwrite(torch.zeros(16), str(tmp_path / "ok.swp")) == 1  # the handle is still usable


def test_a_read_past_the_end_of_the_file_raises_instead_of_returning_minus_one(handle, tmp_path):
    path = tmp_path / "short.swp"
    path.write_bytes(b"x" * 100)
    with pytest.raises(OSError, match="the file has 100 bytes"):
        handle.sync_pread(torch.empty(200, dtype=torch.uint8), str(path))
    with pytest.raises(ValueError, match="100"):
        handle.read(torch.empty(200, dtype=torch.uint8), str(path), False)


def test_a_failed_write_raises_from_wait_naming_the_file(handle, tmp_path):
    directory = tmp_path / "a-directory"
    directory.mkdir()
    with pytest.raises(OSError, match="a-directory"):  # open(O_WRONLY) of a directory: EISDIR
        handle.async_pwrite(torch.zeros(16), str(directory))


def test_validation_catches_a_transfer_that_did_not_store_what_was_given(aio, tmp_path):
    class CorruptingFileIO(file_io.AsyncFileIO):
        """The real engine, and then one byte of each written file flipped, as a failing disk would."""

        def wait(self) -> int:
            targets = [p.target for p in self._pending if not p.read]
            count = super().wait()
            for target in targets:
                with open(target, "r+b") as f:
                    first = f.read(1)
                    f.seek(0)
                    f.write(bytes([first[0] ^ 0xFF]))
            return count

    handle = AsyncIOOp(CorruptingFileIO, None).aio_handle(MiB, 8, False, False, 1)
    data = random_bytes(8192, seed=5)
    assert handle.pwrite(data, str(tmp_path / "unchecked.swp"), False, False) == 1  # unnoticed without validate
    with pytest.raises(OSError, match=r"validation of the write failed.*checked\.swp"):
        handle.pwrite(data, str(tmp_path / "checked.swp"), True, False)


def test_the_module_level_helpers_work_as_deepspeeds_do(aio, tmp_path):
    data = random_bytes(MiB, seed=6)
    path = str(tmp_path / "t.swp")
    assert aio.aio_write(data, path, MiB, 8, False, False, True) == 0
    back = torch.empty_like(data)
    assert aio.aio_read(back, path, MiB, 8, False, False, True) == 0 and torch.equal(back, data)
    target = torch.empty(1000)
    assert aio.deepspeed_memcpy(target, torch.arange(1000.0)) == 0 and torch.equal(target, torch.arange(1000.0))


def test_the_engine_moves_chunks_on_several_threads_at_once(tmp_path):
    engine = file_io.AsyncFileIO(threads=4, block_size=4096)
    try:
        assert engine.threads == 4
        data = file_io.aligned_empty(MiB, torch.uint8).copy_(random_bytes(MiB, seed=7))
        engine.submit(False, data, Path(tmp_path / "t.swp"))
        assert engine.pending == 1 and engine.wait() == 1 and engine.pending == 0
        back = file_io.aligned_empty(MiB, torch.uint8)
        engine.submit(True, back, tmp_path / "t.swp")
        assert engine.wait() == 1 and torch.equal(back, data)
        with pytest.raises(ValueError, match="contiguous CPU tensor"):
            engine.submit(True, back[::2], tmp_path / "t.swp")
    finally:
        engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.wait()


def test_a_plugin_without_file_io_gets_a_refusal_naming_it(monkeypatch):
    import dataclasses

    from devshim_core.integrations.deepspeed.op_builders.base import active_device

    device = active_device()
    monkeypatch.setattr(device, "offload_io", dataclasses.replace(device.offload_io, file_io=None,
                                                                   source="unavailable: no C compiler"))
    monkeypatch.setattr(AsyncIOBuilder, "_devshim_ops", {})
    with pytest.raises(RuntimeError, match=rf"{device.plugin}.*no C compiler"):
        AsyncIOBuilder().load()


def test_nothing_was_jit_compiled_while_this_module_ran(jit_compilations):
    jit_watch.assert_nothing_compiled(jit_compilations)
