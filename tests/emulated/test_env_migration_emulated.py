"""Spec: on the emulated vendor device, a CUDA job script's environment changes what the vendor runtime does.

Fault injected: the job sets ``CUDA_VISIBLE_DEVICES``, ``PYTORCH_CUDA_ALLOC_CONF`` and ``NCCL_*``, names the vendor
runtime never reads. What the user sees: ``CUDA_VISIBLE_DEVICES=1`` on a 2-device node leaves the process one device
(device 1: on a 1-device node the runtime refuses it, and devshim names the translation); a vendor variable the user
set wins and the warning says the CUDA one was not applied; allocator keys the vendor does not read are dropped and
named; NCCL settings without a documented equivalent are named in one warning. Each run is a fresh process
(``DEVSHIM_EMULATE`` of this folder's vendor): the variables are read when the runtime starts.
"""

from __future__ import annotations

import json
import textwrap

from devshim_emulation import vendors
from plugin_fixtures import DEVSHIM_SCRIPT, PYTHON, clean_env, run, run_json

from devshim_core.env_migration import is_source
from emulated.conftest import DEVICE_TYPE, VENDOR, only

VISIBLE = vendors.get(VENDOR).VISIBLE_DEVICES if VENDOR else ""
ALLOC_CONF = {"ascend": "PYTORCH_NPU_ALLOC_CONF", "sophgo": "PYTORCH_TPU_ALLOC_CONF"}.get(VENDOR or "", "")

SCRIPT = textwrap.dedent(f"""
    import json, os
    import devshim_core.auto
    import torch
    print(json.dumps({{"count": torch.{DEVICE_TYPE}.device_count(),
                      "env": {{k: v for k, v in os.environ.items() if k in {{{VISIBLE!r}, {ALLOC_CONF!r},
                                                                           "ASCEND_GLOBAL_LOG_LEVEL"}}}}}}))
""")


def _environment(**settings: str) -> dict[str, str]:
    """A fresh emulated process's environment: a 2-device node, no vendor or CUDA/NCCL variable but ``settings``."""
    env = {k: v for k, v in clean_env().items() if not is_source(k) and k not in (VISIBLE, ALLOC_CONF)}
    return {**env, "DEVSHIM_EMULATE": VENDOR or "", "DEVSHIM_EMULATE_DEVICES": "2", **settings}


def _script(**settings: str) -> tuple[dict, str]:
    result = run([PYTHON, "-c", SCRIPT], _environment(**settings))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_cuda_visible_devices_1_leaves_the_process_one_device_through_the_vendors_variable():
    seen, stderr = _script(CUDA_VISIBLE_DEVICES="1")
    assert seen == {"count": 1, "env": {VISIBLE: "1"}}
    assert f"CUDA_VISIBLE_DEVICES='1' -> {VISIBLE}='1'" in stderr
    report = run_json([DEVSHIM_SCRIPT, "info", "--json"], _environment(CUDA_VISIBLE_DEVICES="1"))
    assert report["device"]["device_count"] == 1  # detected again after the translation
    [translation] = report["environment"]["translations"]
    assert (translation["source"], translation["outcome"], translation["target"]) == (
        "CUDA_VISIBLE_DEVICES", "applied", VISIBLE)


def test_the_translated_index_is_the_runtimes_device_index_so_a_missing_device_is_refused_and_named():
    result = run([DEVSHIM_SCRIPT, "info"], _environment(CUDA_VISIBLE_DEVICES="1", DEVSHIM_EMULATE_DEVICES="1"))
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"CUDA_VISIBLE_DEVICES='1' -> {VISIBLE}='1'" in result.stderr
    assert "names devices 1 that the emulated node does not have" in result.stderr
    assert "set the vendor variables yourself" in result.stderr


def test_the_users_vendor_variable_wins_and_the_warning_says_cuda_visible_devices_was_not_applied():
    seen, stderr = _script(CUDA_VISIBLE_DEVICES="1", **{VISIBLE: "0,1"})
    assert seen == {"count": 2, "env": {VISIBLE: "0,1"}}
    assert f"CUDA_VISIBLE_DEVICES='1' not applied: {VISIBLE}='0,1' is set already" in stderr


def test_allocator_keys_the_vendor_does_not_read_are_dropped_and_named_and_nccl_without_equivalent_is_warned():
    seen, stderr = _script(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True,backend:cudaMallocAsync",
                           NCCL_IB_HCA="mlx5_0", NCCL_NET_GDR_LEVEL="PHB")
    assert seen["env"][ALLOC_CONF] == "expandable_segments:True"
    assert "dropped backend, which the device's allocator does not read" in stderr
    [warning] = [line for line in stderr.splitlines() if "have no effect on the" in line]
    assert "NCCL_IB_HCA='mlx5_0' untranslatable" in warning and "NCCL_NET_GDR_LEVEL='PHB' untranslatable" in warning


@only("ascend")
def test_ascend_takes_nccl_debug_as_cann_log_level_and_nccl_socket_ifname_as_hccls():
    report = run_json([DEVSHIM_SCRIPT, "info", "--json"],
                      _environment(NCCL_DEBUG="WARN", NCCL_SOCKET_IFNAME="=eth0", TORCH_NCCL_BLOCKING_WAIT="1"))
    targets = {t["source"]: (t["target"], t["target_value"]) for t in report["environment"]["translations"]}
    assert targets == {"NCCL_DEBUG": ("ASCEND_GLOBAL_LOG_LEVEL", "2"),
                       "NCCL_SOCKET_IFNAME": ("HCCL_SOCKET_IFNAME", "=eth0"),
                       "TORCH_NCCL_BLOCKING_WAIT": ("HCCL_BLOCKING_WAIT", "1")}


@only("sophgo")
def test_sophgo_documents_no_nccl_equivalent_so_nccl_settings_are_warned_not_guessed():
    _, stderr = _script(NCCL_SOCKET_IFNAME="eth0", NCCL_DEBUG="INFO")
    [warning] = [line for line in stderr.splitlines() if "have no effect on the sophgo device" in line]
    assert "NCCL_DEBUG='INFO' untranslatable" in warning and "NCCL_SOCKET_IFNAME='eth0' untranslatable" in warning
