"""ZeRO-3's blocking parameter gather on a backend that completes all-gathers out of order (gloo).

DeepSpeed 0.16-0.19.7's ``Init._allgather_params_coalesced`` (``GatheredParameters``, checkpoint saving) launches
one asynchronous all-gather per parameter and waits for the last handle only, as if one CUDA stream ordered them;
gloo runs them on a pool of threads, so the caller could read a ``torch.empty`` buffer an earlier gather had not
filled yet. devshim's ``deepspeed-zero3-gather-order`` patch makes each handle's ``wait`` wait for the ones
launched before it.
"""

from __future__ import annotations

import sys
import types
from importlib import metadata

# isort: off
import devshim_core.auto  # noqa: F401  (activates devshim in this pytest process, before deepspeed)
import deepspeed  # noqa: F401

# isort: on
import pytest

from devshim_core.integrations.deepspeed import patches
from devshim_core.integrations.deepspeed.patches import GATHER_ORDER_PATCHES, _GathersInLaunchOrder
from devshim_core.patching import REGISTRY, version_in_range


class FakeWork:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> bool:
        self.log.append(self.name)
        return True

    def is_completed(self) -> bool:
        return self.name in self.log


class FakeComm:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.launched = 0

    def _launch(self, async_op: bool) -> FakeWork | None:
        self.launched += 1
        return FakeWork(self.log, f"g{self.launched}") if async_op else None

    def all_gather(self, outputs, tensor, group=None, async_op=False):
        return self._launch(async_op)

    def all_gather_into_tensor(self, output, tensor, group=None, async_op=False):
        return self._launch(async_op)

    def get_rank(self) -> int:
        return 3


def test_waiting_for_the_last_gather_waits_for_every_earlier_one_oldest_first():
    comm = FakeComm()
    ordered = _GathersInLaunchOrder(comm)
    handles = [ordered.all_gather_into_tensor(None, None, async_op=True) for _ in range(3)]
    handles.append(ordered.all_gather([], None, async_op=True))
    assert handles[-1].wait() is True
    assert comm.log == ["g1", "g2", "g3", "g4"]
    assert all(h.is_completed() for h in handles)


def test_a_gather_already_waited_for_is_not_waited_again_and_later_chains_start_after_it():
    comm = FakeComm()
    ordered = _GathersInLaunchOrder(comm)
    first = ordered.all_gather_into_tensor(None, None, async_op=True)
    second = ordered.all_gather_into_tensor(None, None, async_op=True)
    assert second.wait() is True and first.wait() is True  # the earlier one: already done, still True
    third = ordered.all_gather_into_tensor(None, None, async_op=True)
    third.wait()
    assert comm.log == ["g1", "g2", "g3"]


def test_synchronous_gathers_and_everything_else_pass_through():
    comm = FakeComm()
    ordered = _GathersInLaunchOrder(comm)
    assert ordered.all_gather_into_tensor(None, None) is None
    assert ordered.get_rank() == 3


def test_the_patch_is_applied_exactly_on_the_releases_that_wait_for_one_handle():
    from deepspeed.runtime.zero import partition_parameters

    affected = version_in_range(metadata.version("deepspeed"), "<0.19.8")
    assert REGISTRY.is_applied(GATHER_ORDER_PATCHES.name) == affected
    assert isinstance(partition_parameters.dist, _GathersInLaunchOrder) == affected


@pytest.mark.skipif(not version_in_range(metadata.version("deepspeed"), "<0.19.8"), reason="only where patched")
def test_the_patched_function_still_waits_for_one_handle_only():
    # if a DeepSpeed release in the range already waits for every handle, the patch's range is too wide
    import inspect

    from deepspeed.runtime.zero.partition_parameters import Init

    assert "launch_handles[-1].wait()" in inspect.getsource(Init._allgather_params_coalesced)


def test_the_deepspeed_version_that_counts_is_the_imported_checkouts(tmp_path, monkeypatch):
    """DeepSpeed's unit tests import a source checkout over the installed release: the version gates must see the
    checkout's version (from git_version_info, or its version.txt when that says 0.0.0), not the metadata's."""
    package = tmp_path / "DeepSpeed" / "deepspeed"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (tmp_path / "DeepSpeed" / "version.txt").write_text("0.19.6\n")
    checkout = types.ModuleType("deepspeed")
    checkout.__file__ = str(package / "__init__.py")
    info = types.ModuleType("deepspeed.git_version_info")
    info.version = "0.0.0"  # an uninstalled checkout, run from its tests/ folder
    monkeypatch.setitem(sys.modules, "deepspeed", checkout)
    monkeypatch.setitem(sys.modules, "deepspeed.git_version_info", info)

    assert patches.running_deepspeed() == "0.19.6"
    assert REGISTRY.check(GATHER_ORDER_PATCHES) == []  # 0.19.6 waits for one handle: patched
    info.version = "0.19.8"
    assert patches.running_deepspeed() == "0.19.8"
    assert REGISTRY.check(GATHER_ORDER_PATCHES) != []
