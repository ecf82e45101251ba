"""devshim reads distribution versions from the metadata headers itself (cheaply, once per process)."""

from __future__ import annotations

import importlib.metadata as metadata

import pytest

from devshim_core.distributions import installed_version, name_and_version


@pytest.mark.parametrize("name", ["torch", "deepspeed", "pluggy", "megatron-core", "devshim-core", "devshim-kernels"])
def test_installed_version_is_what_importlib_metadata_reports(name):
    assert installed_version(name) == metadata.version(name)


def test_a_distribution_that_is_not_installed_has_no_version():
    assert installed_version("devshim-no-such-distribution") is None


def test_name_and_version_of_every_devshim_plugin_distribution_match_their_metadata():
    entry_points = list(metadata.entry_points(group="devshim"))
    assert {ep.name for ep in entry_points} >= {"cpu_reference", "ascend", "sophgo", "cuda"}
    for ep in entry_points:
        assert name_and_version(ep.dist) == (ep.dist.metadata["Name"], ep.dist.version)
