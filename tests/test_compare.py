"""Spec: ``devshim compare``'s parts, in one process: what a run records, that recording changes nothing, how two
records are measured, and how the first divergence is found.

The end-to-end specs (real launchers, real frameworks, planted mistakes) are in ``tests/e2e/test_compare_faults.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from devshim_core.compare import report
from devshim_core.compare.dump import Dump, sample_indices
from devshim_core.compare.metrics import TOLERANCES, measure, tolerance_of
from devshim_core.compare.recorder import Recorder


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Model(torch.nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(2))
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        for block in self.blocks:
            x = block(x)
        return {"logits": self.head(x)}


def train(steps: int, recorder: Recorder | None = None, break_block: int | None = None,
          break_step: int | None = None) -> list[float]:
    """A few AdamW steps of ``Model`` on fixed data; ``break_block``/``break_step``: scale that block's output by
    1.5 from that step on, a mistake for the comparison to find."""
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data, target = torch.randn(8, 16), torch.randint(0, 4, (8,))
    if recorder is not None:
        recorder.install()
    losses = []
    try:
        for step in range(steps):
            if break_block is not None and step == break_step:
                broken = model.blocks[break_block]
                broken.forward = lambda x, broken=broken: Block.forward(broken, x) * 1.5  # type: ignore[method-assign]
            loss = torch.nn.functional.cross_entropy(model(data)["logits"], target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        if recorder is not None:
            recorder.uninstall()
    return losses


def record(directory: Path, steps: int = 3, **kwargs: int) -> Dump:
    recorder = Recorder(directory / "rank0", steps=0, sample=4096, full=(), meta={"plugin": "test"})
    train(steps, recorder, **kwargs)
    return Dump(directory / "rank0")


def test_recording_changes_nothing_the_script_computes(tmp_path: Path) -> None:
    without = train(4)
    with_recorder = train(4, Recorder(tmp_path / "rank0", steps=0, sample=64, full=(), meta={}))
    assert with_recorder == without  # bit for bit


def test_a_run_records_each_modules_outputs_and_gradients_each_parameters_gradient_and_each_step(tmp_path: Path):
    dump = record(tmp_path, steps=2)
    assert dump.meta["complete"] is True and dump.meta["steps"] == 2
    step0 = [r for r in dump.records if r.step == 0]
    forward = [r.module for r in step0 if r.kind == "forward"]
    # in call order, innermost first (a module's output is recorded when it returns), named by path
    assert forward[:4] == ["Model.blocks.0.norm", "Model.blocks.0.up", "Model.blocks.0.down", "Model.blocks.0"]
    assert forward[-1] == "Model" and "Model.head" in forward
    assert {r.tensor for r in step0 if r.module == "Model"} == {"logits"}
    kinds = {r.kind for r in step0}
    assert kinds == {"init_param", "forward", "grad_output", "grad_param", "optimizer_grad", "param"}
    names = {p for p, _ in Model().named_parameters()}
    assert {r.module.removeprefix("Model.") for r in step0 if r.kind == "param"} == names
    assert [r.order for r in step0] == list(range(len(step0)))  # the order the run made them


def test_a_tensor_larger_than_the_sample_is_sampled_evenly_and_alike_in_both_runs() -> None:
    picked = sample_indices(10_000, 5, torch.device("cpu"))
    assert picked is not None and picked.tolist() == [0, 2500, 5000, 7499, 9999]
    assert sample_indices(5, 5, torch.device("cpu")) is None  # small enough: every element


def test_identical_values_are_within_every_tolerance_and_half_precision_is_looser():
    values = torch.randn(1000)
    same = measure(values, values.clone())
    assert same.cosine == pytest.approx(1.0) and same.max_abs == 0.0 and same.frac_rel_5e3 == 0.0
    assert not any(same.breaks(tolerance) for tolerance in TOLERANCES.values())
    off = measure(values * 1.2, values)
    assert off.max_rel == pytest.approx(0.2, rel=1e-3) and off.frac_rel_5e3 > 0.9
    assert off.breaks(tolerance_of("float32")) and off.breaks(tolerance_of("bfloat16"))
    assert TOLERANCES["bfloat16"].min_cosine < TOLERANCES["float16"].min_cosine < TOLERANCES["float32"].min_cosine
    assert TOLERANCES["bfloat16"].max_rel is None and TOLERANCES["float32"].max_rel is not None


def test_nan_where_the_reference_has_a_number_diverges():
    values, reference = torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])
    assert measure(values, reference).breaks(tolerance_of("float32"))
    assert not measure(reference.clone(), reference).breaks(tolerance_of("float32"))


def test_the_first_divergence_is_the_first_module_of_the_first_step_that_differs(tmp_path: Path):
    reference = record(tmp_path / "reference", steps=3)
    run = record(tmp_path / "run", steps=3, break_block=1, break_step=1)
    [rank] = report.compare_runs(tmp_path / "run", tmp_path / "reference")
    assert rank.first is not None and rank.problems == []
    first = rank.first.record
    assert (first.step, first.kind, first.module) == (1, "forward", "Model.blocks.1")
    assert all(not row.broken for row in rank.rows if row.record.step == 0)
    assert report.diverged([rank])
    text = report.terminal([rank], "run", "reference")
    assert "FIRST DIVERGENCE: step 1 forward Model.blocks.1" in text and text.endswith("RESULT: DIVERGED")
    json_path, html_path = report.write([rank], tmp_path / "out", {"steps": 3}, "run", "reference")
    found = json.loads(json_path.read_text())
    assert found["diverged"] is True and found["ranks"][0]["first_divergence"]["module"] == "Model.blocks.1"
    page = html_path.read_text()
    assert "<svg" in page and "polyline" in page and "Model.blocks.1" in page
    assert len(reference.records) == len(run.records)


def test_two_runs_of_the_same_script_agree(tmp_path: Path):
    record(tmp_path / "a", steps=2)
    record(tmp_path / "b", steps=2)
    [rank] = report.compare_runs(tmp_path / "a", tmp_path / "b")
    assert rank.first is None and not report.diverged([rank])
    assert report.terminal([rank], "a", "b").endswith("RESULT: same within tolerance")


def test_a_dump_a_killed_run_left_unclosed_is_reported_not_trusted(tmp_path: Path):
    record(tmp_path / "a", steps=2)
    record(tmp_path / "b", steps=2)
    meta = tmp_path / "a" / "rank0" / "meta.json"
    meta.write_text(json.dumps(dict(json.loads(meta.read_text()), complete=False)))
    [rank] = report.compare_runs(tmp_path / "a", tmp_path / "b")
    assert rank.problems == ["the run's dump is incomplete (the process ended before closing it)"]
    assert report.diverged([rank])


def test_a_run_that_recorded_nothing_is_an_error_naming_the_missing_import(tmp_path: Path):
    (tmp_path / "run").mkdir()
    record(tmp_path / "reference", steps=1)
    with pytest.raises(FileNotFoundError, match=r"import devshim_core\.auto"):
        report.compare_runs(tmp_path / "run", tmp_path / "reference")


def test_a_mixed_precision_runs_fp32_records_are_judged_at_its_half_precision(tmp_path: Path):
    """bf16 compute, fp32 master weights and gradients: errors of bf16 rounding's size in an fp32 gradient are not a
    divergence there; in an fp32 run they are."""
    from devshim_core.compare.dump import Record

    def rec(kind: str, dtype: str) -> Record:
        return Record(step=0, order=0, kind=kind, module="m", call=0, tensor=".", dtype=dtype, shape=(4,), numel=4,
                      offset=0, count=4, norm=1.0, max_abs=1.0)

    assert report.judged_dtype(rec("optimizer_grad", "float32"), "bfloat16") == "bfloat16"
    assert report.judged_dtype(rec("optimizer_grad", "float32"), None) == "float32"
    assert report.judged_dtype(rec("forward", "bfloat16"), "bfloat16") == "bfloat16"
    grad = torch.randn(1000)
    rounded = grad.bfloat16().float()  # what bf16 compute leaves in fp32 gradients: roundings of 2^-8
    noisy = rounded + 0.2 * grad.abs().max() * 2.0 ** -8 * torch.randn(1000).sign()  # and near zero, more
    assert measure(noisy, grad).breaks(tolerance_of("float32"))
    assert not measure(noisy, grad).breaks(tolerance_of(report.judged_dtype(rec("param", "float32"), "bfloat16")))


def test_a_tensor_scaled_as_a_whole_diverges_in_every_precision_though_its_cosine_is_1():
    """An all-reduce that averages where it should sum halves a gradient: the cosine cannot see it, the norms do."""
    grad = torch.randn(1000)
    halved = measure(grad / 2, grad)
    assert halved.cosine == pytest.approx(1.0) and halved.norm_rel == pytest.approx(0.5)
    assert all(halved.breaks(tolerance_of(dtype)) for dtype in ("float32", "bfloat16", "float16"))


# -- the reference kernels (devshim compare --reference kernels) -----------------------------------------------------


def test_reference_kernels_replace_every_kernel_the_plugin_serves_and_leave_out_what_it_leaves_out():
    """DEVSHIM_REFERENCE_KERNELS=1: the plugin's device, devshim-kernels' ops. A plugin that serves the cuda plugin's
    kernels (plain torch, on host tensors) gets devshim_kernels' in their place; an op it does not serve stays None,
    so the same framework paths run as without the switch."""
    import dataclasses

    import devshim_kernels
    from plugin_fixtures.kit_doubles import cuda_kernels_on_host

    from devshim_core.device import build_device
    from devshim_core.plugins import discover
    from devshim_core.selection import select
    from devshim_core.settings import Settings

    settings = Settings(forced="doubles")
    registry = discover(settings, extra=[("doubles", cuda_kernels_on_host)])
    own = build_device(registry, select(registry, settings))
    reference = build_device(registry, select(registry, settings), reference_kernels=True)
    assert own.attention.attention is not devshim_kernels.attention  # the cuda plugin's own, before
    assert reference.attention.attention is devshim_kernels.attention
    assert reference.optimizer.fused_adamw is devshim_kernels.fused_adamw
    for field in dataclasses.fields(type(own.attention)):
        if field.name != "source":
            assert (getattr(reference.attention, field.name) is None) == (getattr(own.attention, field.name) is None)
    assert "DEVSHIM_REFERENCE_KERNELS=1" in reference.attention.source


# -- the command ------------------------------------------------------------------------------------------------------

SCRIPT = """\
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    loss = model(torch.randn(4, 8)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print("step", step, flush=True)
"""


def devshim_compare(tmp_path: Path, *args: str, script: str = SCRIPT) -> subprocess.CompletedProcess[str]:
    (tmp_path / "train.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVSHIM_")} | {"DEVSHIM_PLUGIN": "cpu_reference"}
    devshim = Path(sys.executable).with_name("devshim")
    return subprocess.run([str(devshim), "compare", *args], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)


def test_an_unmodified_script_is_compared_and_each_process_stops_after_the_steps_asked(tmp_path: Path):
    """No devshim import in the script: DEVSHIM_AUTO activates it; --steps 2 stops the run at its third forward."""
    done = devshim_compare(tmp_path, "--steps", "2", "--", sys.executable, "train.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT: same within tolerance" in done.stdout
    assert (tmp_path / "devshim-compare" / "run.log").read_text().count("step ") == 2
    found = json.loads((tmp_path / "devshim-compare" / "compare.json").read_text())
    assert {r["step"] for r in found["ranks"][0]["records"]} == {0, 1}
    assert (tmp_path / "devshim-compare" / "compare.html").read_text().startswith("<!doctype html>")


def test_a_run_that_fails_is_exit_2_with_the_end_of_its_output(tmp_path: Path):
    done = devshim_compare(tmp_path, "--", sys.executable, "train.py", script="raise SystemExit('the data is gone')")
    assert done.returncode == 2
    assert "the device run exited with status 1" in done.stderr and "the data is gone" in done.stderr


def test_no_command_and_a_reference_from_another_command_are_refused(tmp_path: Path):
    assert devshim_compare(tmp_path).returncode == 2
    first = devshim_compare(tmp_path, "--steps", "1", "--out", "first", "--", sys.executable, "train.py")
    assert first.returncode == 0, first.stderr
    other = devshim_compare(tmp_path, "--steps", "2", "--out", "second", "--reference-from", "first", "--",
                            sys.executable, "train.py")
    assert other.returncode == 2 and "its reference ran with other steps" in other.stderr
    reused = devshim_compare(tmp_path, "--steps", "1", "--out", "third", "--reference-from", "first", "--",
                             sys.executable, "train.py")
    assert reused.returncode == 0, reused.stderr
    assert "reference run:" not in reused.stderr  # not run again


def test_runs_that_start_from_different_weights_are_told_so_with_what_to_do(tmp_path: Path):
    reference = record(tmp_path / "reference", steps=1)
    run_dir = tmp_path / "run" / "rank0"
    torch.manual_seed(1)  # another initialisation
    recorder = Recorder(run_dir, steps=0, sample=4096, full=(), meta={})
    model = Model()
    recorder.install()
    try:
        model(torch.randn(8, 16))
    finally:
        recorder.uninstall()
    [rank] = report.compare_runs(tmp_path / "run", tmp_path / "reference")
    assert rank.first is not None and rank.first.record.kind == "init_param"
    assert "start from different weights" in report.terminal([rank], "run", "reference")
    assert reference.records[0].kind == "init_param"
