"""Spec: ``DEVSHIM_MIGRATION_LOG=PATH`` records what devshim did at run time, and ``devshim check --log PATH`` merges
that with the static scan.

Nothing is faulty here: a CUDA-written script runs under ``import devshim_core.auto`` on cpu_reference, in a loop,
making a redirected call (``torch.zeros(2, device='cuda')``, ``model.cuda()``), a modified one
(``torch.cuda.get_device_capability()``), a refused one (``torch.cuda.CUDAGraph()``, caught) and a blocked import
(``import apex``, caught), with ``CUDA_VISIBLE_DEVICES`` set, plus a redirected call in a helper module the scan is
not given. What the user sees: one JSON line per call site (not per call), each with the caller's file:line, the
call, what devshim did and its tag (served / modified / refused), one per environment translation and one for the
blocked import; then ``devshim check --log`` marks each finding of the script "ran" or "never ran" and lists the
helper's call as "only at run time". With the variable unset there is no file, and the native wrappers serve.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from plugin_fixtures import PYTHON, clean_env, run

from devshim_core import migration_log
from devshim_core.cli import main

HELPER = """\
import torch


def ones():
    return torch.ones(1, device="cuda")  # HELPER
"""

SCRIPT = """\
import devshim_core.auto  # noqa: F401
import torch

from devshim_core.integrations.cuda_redirect import wrappers
import helper

for _ in range(3):
    x = torch.zeros(2, device="cuda")  # ZEROS
    model = torch.nn.Linear(2, 2).cuda()  # MODULE
    capability = torch.cuda.get_device_capability()  # CAPABILITY
    try:
        torch.cuda.CUDAGraph()  # GRAPH
    except RuntimeError:
        pass
    try:
        import apex  # noqa: F401  # APEX
    except ImportError:
        pass
    helper.ones()
print("wrappers", wrappers.IMPLEMENTATION, x.device, capability)
if __name__ == "__never__":
    torch.cuda.synchronize()  # NEVER
"""


def _line(source: str, marker: str) -> int:
    return next(i for i, text in enumerate(source.splitlines(), 1) if text.endswith(f"# {marker}"))


def _run_script(directory: Path, **env: str) -> Any:
    (directory / "helper.py").write_text(HELPER)
    (directory / "train.py").write_text(SCRIPT)
    result = run([PYTHON, "train.py"], clean_env(DEVSHIM_PLUGIN="cpu_reference", **env), cwd=directory, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("migration-log")
    log = directory / "migration.jsonl"
    result = _run_script(directory, DEVSHIM_MIGRATION_LOG=str(log), CUDA_VISIBLE_DEVICES="0")
    entries = [json.loads(text) for text in log.read_text().splitlines()]
    return directory, result.stdout, entries


def test_each_call_site_is_one_line_with_file_line_call_what_and_tag(
        logged: tuple[Path, str, list[dict[str, Any]]]) -> None:
    directory, stdout, entries = logged
    script, helper = str(directory / "train.py"), str(directory / "helper.py")
    calls = {(e["file"], e["line"]): e for e in entries if e["kind"] != "environment"}
    assert len(calls) == len(entries) - 1, f"a call site logged twice in the loop: {entries}"
    expected = {
        (script, _line(SCRIPT, "ZEROS")): ("call", "torch.zeros", "served", "device='cuda' -> cpu"),
        (script, _line(SCRIPT, "MODULE")): ("call", "Module.cuda", "served", "to cpu"),
        (script, _line(SCRIPT, "CAPABILITY")): ("call", "torch.cuda.get_device_capability", "modified",
                                                 "(0, 0): no CUDA architecture"),
        (script, _line(SCRIPT, "GRAPH")): ("call", "torch.cuda.CUDAGraph", "refused", "CUDA graphs have no equivalent"),
        (script, _line(SCRIPT, "APEX")): ("import", "import apex", "refused", "apex's fused kernels are CUDA-only"),
        (helper, _line(HELPER, "HELPER")): ("call", "torch.ones", "served", "device='cuda' -> cpu"),
    }
    # Module.cuda moves through Module.to: devshim's own call is not a call site of the script
    assert set(calls) == set(expected), json.dumps(entries, indent=1)
    for site, (kind, call, tag, did) in expected.items():
        entry = calls[site]
        assert (entry["kind"], entry["call"], entry["tag"]) == (kind, call, tag), entry
        assert entry["did"].startswith(did), entry
        assert entry["rank"] is None and isinstance(entry["pid"], int), entry
    assert "wrappers python" in stdout  # recording needs the Python wrappers


def test_an_environment_translation_is_logged(logged: tuple[Path, str, list[dict[str, Any]]]) -> None:
    _, _, entries = logged
    [translation] = [e for e in entries if e["kind"] == "environment"]
    assert translation["call"] == "CUDA_VISIBLE_DEVICES" and translation["tag"] == "served"
    assert translation["outcome"] == "applied" and translation["file"] is None and translation["line"] is None
    assert translation["did"] == "CUDA_VISIBLE_DEVICES='0' -> DEVSHIM_CPU_VISIBLE_DEVICES='0'"


def test_check_with_the_log_says_what_ran_what_never_ran_and_what_only_ran(
        logged: tuple[Path, str, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    directory, _, _ = logged
    monkeypatch.chdir(directory)
    monkeypatch.setenv("DEVSHIM_PLUGIN", "cpu_reference")
    status = main(["check", "--log", "migration.jsonl", "train.py"])
    out = capsys.readouterr().out
    assert status == 1  # the CUDA graph is unsupported: the log changes no exit status
    lines = {int(text.split(":")[1]): text for text in out.splitlines() if text.startswith("train.py:")}
    assert lines[_line(SCRIPT, "ZEROS")].endswith("[ran: served: torch.zeros -- device='cuda' -> cpu]")
    assert "[ran: modified: torch.cuda.get_device_capability -- (0, 0)" in lines[_line(SCRIPT, "CAPABILITY")]
    assert "unsupported" in lines[_line(SCRIPT, "GRAPH")]
    assert "[ran: refused: torch.cuda.CUDAGraph -- " in lines[_line(SCRIPT, "GRAPH")]
    apex = lines[_line(SCRIPT, "APEX")]
    assert "blocked" in apex and "[ran: refused: import apex -- " in apex
    assert lines[_line(SCRIPT, "NEVER")].endswith("[never ran]")
    helper = f"{directory / 'helper.py'}:{_line(HELPER, 'HELPER')}: only at run time: served: torch.ones -- "
    assert helper in out
    assert "environment: served: CUDA_VISIBLE_DEVICES -- CUDA_VISIBLE_DEVICES='0' -> " in out
    ran = sum(1 for text in lines.values() if "[ran: " in text)
    never = sum(1 for text in lines.values() if text.endswith("[never ran]"))
    assert f"migration log (1 file): {ran} ran, {never} never ran, 1 only at run time, 1 environment" in out

    assert main(["check", "--json", "--log", "migration.jsonl", "train.py"]) == 1
    report = json.loads(capsys.readouterr().out)
    by_line = {f["line"]: f for f in report["findings"]}
    assert [e["tag"] for e in by_line[_line(SCRIPT, "GRAPH")]["ran"]] == ["refused"]
    assert by_line[_line(SCRIPT, "NEVER")]["ran"] == []
    assert [e["call"] for e in report["only_at_run_time"]] == ["torch.ones"]
    assert [e["call"] for e in report["environment"]] == ["CUDA_VISIBLE_DEVICES"]


def test_an_unreadable_log_is_named_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch\ntorch.zeros(1, device='cuda')\n")
    (tmp_path / "damaged.jsonl").write_text('{"kind": "call"\n')
    monkeypatch.setenv("DEVSHIM_PLUGIN", "cpu_reference")
    assert main(["check", "--log", str(tmp_path / "missing.jsonl"), "--log", str(tmp_path / "damaged.jsonl"),
                 str(script)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'missing.jsonl'}: cannot read the migration log" in err
    assert f"{tmp_path / 'damaged.jsonl'}:1: not a migration-log line" in err


def test_each_rank_writes_its_own_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert migration_log.log_path("/logs/run.jsonl") == "/logs/run.jsonl"
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert migration_log.log_path("/logs/run.jsonl") == "/logs/run.jsonl.rank3"
    monkeypatch.setenv("RANK", "11")  # the global rank wins: local ranks repeat across nodes
    assert migration_log.log_path("/logs/run.jsonl") == "/logs/run.jsonl.rank11"
    assert migration_log.log_path("/logs/run-{rank}.jsonl") == "/logs/run-11.jsonl"


def test_unset_means_no_file_and_the_native_wrappers(tmp_path: Path) -> None:
    from devshim_core.integrations.cuda_redirect import wrappers

    result = _run_script(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["helper.py", "train.py"]
    expected = "native" if wrappers._native is not None else "python"  # python only where no compiler built it
    assert f"wrappers {expected} cpu (0, 0)" in result.stdout
    assert not os.environ.get(migration_log.ENV) and migration_log.recorder() is None
