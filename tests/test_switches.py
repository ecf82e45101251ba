"""Spec: every ``DEVSHIM_*`` variable is declared once (``devshim_core.switches``), with what it takes, its default and
one line of doc. A bad value of any of them is an error naming the variable and what it takes; a ``DEVSHIM_*`` name
declared nowhere is a warning naming the nearest known one; an unknown plugin name in DEVSHIM_DISABLED_PLUGINS is
warned about. The user guide's table is generated from the declarations, and a stale one fails the suite (and CI).
devshim logs through ``logging.getLogger("devshim")``: on stderr by default, ``DEVSHIM_LOG_LEVEL=debug`` for more.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_fixtures import PROJECT_DIR, PYTHON, clean_env, run

from devshim_core import log, switches
from devshim_core.errors import ConfigError
from devshim_core.settings import Settings

SOURCES = ("devshim_core", "kernels/devshim_kernels", "plugins", "examples", "build_support", "release", "bench")


def test_every_devshim_variable_the_code_reads_is_declared():
    read = set()
    for folder in SOURCES:
        for path in (PROJECT_DIR / folder).rglob("*"):
            if path.suffix in (".py", ".pth", ".sh") and "egg-info" not in str(path):  # the C sources read no env
                read |= set(re.findall(r"\bDEVSHIM_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    constants = {"DEVSHIM_PATHS", "DEVSHIM_ADAM", "DEVSHIM_TORCH_PATH", "DEVSHIM_LAYOUT",  # bench's names, not env
                 "DEVSHIM_ADAM_ABI", "DEVSHIM_ROWWISE_ABI", "DEVSHIM_AIO_ABI"}  # the ABI versions' Python names
    assert sorted(read - constants - set(switches.BY_NAME)) == []
    assert sorted(set(switches.BY_NAME) - read) == []  # and nothing is declared that nothing reads


@pytest.mark.parametrize(("name", "value", "takes"), [
    ("DEVSHIM_KERNELS_NATIVE", "flase", "1 or 0 (also true/false, yes/no, on/off), or generic"),
    ("DEVSHIM_CPU_DEVICE_COUNT", "two", "a positive integer"),
    ("DEVSHIM_LOG_LEVEL", "verbose", "debug, info, warning or error"),
    ("DEVSHIM_EMULATE_DEVICES", "0", "a device count from 1 to 64"),
    ("DEVSHIM_CPU_VISIBLE_DEVICES", "0,one", "comma-separated device indices"),
])
def test_a_bad_value_of_any_declared_variable_names_it_and_what_it_takes(name, value, takes):
    with pytest.raises(ConfigError) as excinfo:
        Settings.from_env({name: value})
    assert str(excinfo.value) == f"{name}={value!r} is not valid: {name} takes {takes}."


def test_a_bad_boolean_keeps_the_booleans_wording():
    with pytest.raises(ConfigError, match=r"^DEVSHIM_AUTO='maybe' is not a boolean: use 1 or 0"):
        Settings.from_env({"DEVSHIM_AUTO": "maybe"})


@pytest.mark.parametrize(("name", "nearest"), [("DEVSHIM_PLUGN", "DEVSHIM_PLUGIN"),
                                               ("DEVSHIM_DISABLED_PLUGIN", "DEVSHIM_DISABLED_PLUGINS"),
                                               ("DEVSHIM_EMULATED", "DEVSHIM_EMULATE")])
def test_a_misspelled_variable_is_a_warning_naming_the_nearest_one(name, nearest, capsys):
    Settings.from_env({name: "x"})
    assert capsys.readouterr().err == f"devshim: {name} is not a devshim setting (did you mean {nearest}?); it is " \
                                      "ignored.\n"


def test_in_a_real_activation_the_warnings_reach_stderr_once_each():
    env = clean_env(DEVSHIM_PLUGIN="cpu_reference", DEVSHIM_PLUGN="cpu_reference",
                    DEVSHIM_DISABLED_PLUGINS="cpu_refrence")
    result = run([PYTHON, "-c", "import devshim_core.auto"], env)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "devshim: DEVSHIM_PLUGN is not a devshim setting (did you mean DEVSHIM_PLUGIN?); it is ignored.",
        "devshim: DEVSHIM_DISABLED_PLUGINS names 'cpu_refrence', which is not an installed plugin (did you mean "
        "cpu_reference?); it blocks nothing.",
    ]


def test_devshim_log_level_debug_shows_every_patch_applied():
    quiet = run([PYTHON, "-c", "import devshim_core.auto"], clean_env(DEVSHIM_PLUGIN="cpu_reference"))
    loud = run([PYTHON, "-c", "import devshim_core.auto"], clean_env(DEVSHIM_PLUGIN="cpu_reference",
                                                                     DEVSHIM_LOG_LEVEL="debug"))
    assert quiet.returncode == loud.returncode == 0
    assert quiet.stderr == ""
    assert "devshim: applied cuda-redirect:torch.cuda (torch.cuda.{" in loud.stderr
    assert "devshim: applied torch.distributed-timeouts:named-collectives " in loud.stderr


def test_an_application_that_configures_logging_can_take_devshims_records_over():
    code = ("import logging, devshim_core.log as l; root = l.logger(); root.handlers.clear(); root.propagate = True;"
            "logging.basicConfig(format='APP %(name)s %(message)s'); l.logger('x').warning('hello')")
    result = run([PYTHON, "-c", code], clean_env())
    assert result.stderr == "APP devshim.x hello\n"


def test_the_user_guides_table_of_switches_is_the_generated_one():
    guide = (PROJECT_DIR / "docs" / "user-guide.md").read_text()
    start = guide.index("<!-- generated by devshim settings --markdown")
    table = guide[guide.index("\n", start) + 1:guide.index("<!-- end of generated settings -->")]
    assert table.strip() == switches.markdown(), "run `make docs` (or devshim settings --markdown) and commit"


def test_devshim_settings_prints_the_table():
    result = subprocess.run([str(Path(sys.executable).with_name("devshim")), "settings", "--markdown"],
                            capture_output=True, text=True, check=True)
    assert result.stdout.strip() == switches.markdown()
    assert log.NAME == "devshim"


def test_devshim_log_level_debug_shows_every_kernel_dispatch_decision():
    script = ("import torch, devshim_core.auto, devshim_kernels as dk\n"
              "q = torch.randn(1, 2, 8, 4)\n"
              "dk.attention(q, q, q, layout='BNSD', causal=True)\n"
              "dk.attention(q, q, q, layout='BNSD', attn_mask=torch.ones(8, 8, dtype=torch.bool))\n"
              "dk.rms_norm(torch.randn(4, 8), None)\n")
    env = clean_env(DEVSHIM_PLUGIN="cpu_reference", DEVSHIM_LOG_LEVEL="debug")
    result = run([PYTHON, "-c", script], env)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "attention (1, 2, 8, 4)" in line or "row-wise" in line]
    assert len(lines) == 3, result.stderr[-2000:]
    assert "scaled_dot_product_attention (mask True, causal False)" in lines[1]
    assert lines[2] == "devshim: row-wise kernel for torch.float32 (4, 8): " + lines[2].rsplit(": ", 1)[1]
    assert lines[2].endswith(("native", "PyTorch"))
    quiet = run([PYTHON, "-c", script], clean_env(DEVSHIM_PLUGIN="cpu_reference"))
    assert quiet.returncode == 0 and quiet.stderr == ""
