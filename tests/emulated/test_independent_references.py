"""Spec: on the emulated npu the conformance kit's kernel comparison catches attention conversion mistakes, because
the simulated ``torch_npu`` computes with plain torch, not with the ``devshim_kernels`` the kit compares against.

``DEVSHIM_EMULATE=ascend pytest tests/emulated``. Each mistake is injected and the kit's own check
(``devshim_core.testing.suite.test_kernels.test_attention_dense``, as ``pytest --devshim-plugin=ascend`` runs it) is
called with the Ascend plugin's attention:

- in the plugin's conversion to the vendor op (a flipped mask polarity: the vendor's True means masked out; a
  transposed layout: BSH passed as SBH): the kit fails, and passes without the mistake;
- made twice, in the conversions ``devshim_kernels`` shares between the kit's reference and whatever computes with
  it: the kit fails now, where a simulated op computing with ``devshim_kernels`` (as it did before) agreed with the
  equally wrong reference and passed, as the last check of each case shows.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

import devshim_kernels as dk
import pytest
import torch

from devshim_core.testing.suite import test_kernels as kit
from emulated.conftest import DEVICE_TYPE, only

pytestmark = only("ascend")
dk_attention = importlib.import_module("devshim_kernels.attention")  # the module: the package's name is the function

MASKED_CASES = ["keep_mask", "masked_mask", "padding_mask", "causal_and_mask"]  # a boolean mask reaches the vendor op
UNMASKED_CASES = ["none", "causal_top_left", "gqa_causal"]  # BSH read as SBH keeps the shapes valid


class _MistakenSdk:
    """``torch_npu`` as the plugin's kernels see it, with one mistake between the plugin's conversion and the op."""

    def __init__(self, real: Any, mistake: str) -> None:
        self._real, self._mistake = real, mistake

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def npu_fusion_attention(self, q: Any, k: Any, v: Any, head_num: int, input_layout: str, *,
                             atten_mask: Any = None, **kwargs: Any) -> Any:
        if self._mistake == "mask polarity" and atten_mask is not None and kwargs.get("sparse_mode", 0) in (0, 1):
            atten_mask = ~atten_mask  # SDPA's keep-mask handed over as it is: True read as masked out
        if self._mistake == "layout" and input_layout == "BSH":
            input_layout = "SBH"  # [batch, seq, hidden] described as [seq, batch, hidden]
        return self._real.npu_fusion_attention(q, k, v, head_num, input_layout, atten_mask=atten_mask, **kwargs)


@pytest.fixture(scope="module")
def plugin() -> Any:
    from devshim_ascend import kernels

    return kernels


@pytest.fixture
def mistake_in_plugin(plugin: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    yield lambda mistake: monkeypatch.setattr(plugin, "torch_npu", _MistakenSdk(plugin.torch_npu, mistake))


def kit_check(attention: Callable[..., Any], layout: str, case: str) -> None:
    """The kit's dense attention check, as ``pytest --devshim-plugin=ascend`` runs it (its fixture seeds first)."""
    torch.manual_seed(1234)
    kit.test_attention_dense(attention, DEVICE_TYPE, layout, case, torch.float32)


def _dk_on_device(**inputs: Any) -> Any:
    """What the simulated npu_fusion_attention used to compute: devshim_kernels, on the device tensors."""
    return dk.attention(**inputs)


# -- a mistake in the plugin's conversion ---------------------------------------------------------------------------

@pytest.mark.parametrize("case", MASKED_CASES)
def test_a_flipped_mask_polarity_in_the_plugin_fails_the_kit(plugin, mistake_in_plugin, case):
    kit_check(plugin.attention, "BNSD", case)  # passes without the mistake
    mistake_in_plugin("mask polarity")
    with pytest.raises(AssertionError, match="not close"):
        kit_check(plugin.attention, "BNSD", case)


@pytest.mark.parametrize("case", UNMASKED_CASES)
def test_bsh_passed_as_sbh_by_the_plugin_fails_the_kit(plugin, mistake_in_plugin, case):
    kit_check(plugin.attention, "BSH", case)
    kit_check(plugin.attention, "SBH", case)
    mistake_in_plugin("layout")
    with pytest.raises(AssertionError, match="not close"):
        kit_check(plugin.attention, "BSH", case)
    kit_check(plugin.attention, "SBH", case)  # the mistake touches BSH only


# -- the same mistake made twice: in the conversions devshim_kernels shares ----------------------------------------

def _flip_dk_polarity(monkeypatch: pytest.MonkeyPatch) -> None:
    shared = dk_attention._additive_or_keep_mask
    monkeypatch.setattr(dk_attention, "_additive_or_keep_mask",
                        lambda mask, true_means_masked: shared(mask, not true_means_masked))


def _bsh_as_sbh_in_dk(monkeypatch: pytest.MonkeyPatch) -> None:
    to_bnsd, from_bnsd = dk_attention.to_bnsd, dk_attention.from_bnsd
    monkeypatch.setattr(dk_attention, "to_bnsd",
                        lambda x, layout, *rest: to_bnsd(x, "SBH" if layout == "BSH" else layout, *rest))
    monkeypatch.setattr(dk_attention, "from_bnsd", lambda x, layout: from_bnsd(x, "SBH" if layout == "BSH" else layout))


@pytest.mark.parametrize("case", ["keep_mask", "masked_mask"])
def test_a_polarity_mistake_in_devshim_kernels_fails_the_kit_on_the_independent_emulation(plugin, monkeypatch, case):
    kit_check(plugin.attention, "BNSD", case)
    _flip_dk_polarity(monkeypatch)
    with pytest.raises(AssertionError, match="not close"):
        kit_check(plugin.attention, "BNSD", case)
    kit_check(_dk_on_device, "BNSD", case)  # computing with devshim_kernels, the device agrees with the reference


@pytest.mark.parametrize("case", UNMASKED_CASES)
def test_a_layout_mistake_in_devshim_kernels_fails_the_kit_on_the_independent_emulation(plugin, monkeypatch, case):
    kit_check(plugin.attention, "BSH", case)
    _bsh_as_sbh_in_dk(monkeypatch)
    with pytest.raises(AssertionError, match="not close"):
        kit_check(plugin.attention, "BSH", case)
    kit_check(_dk_on_device, "BSH", case)
