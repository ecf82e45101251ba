"""``python -m bench --quick`` runs every benchmark end to end at toy sizes and writes a well-formed report.

It measures nothing worth keeping (the sizes are tiny and the machine is shared with the test run); it
proves the harness measures what it says: both contenders run, ratios are computed from the recorded
times, and a quick run compiles nothing.
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import pytest

from bench.common import environment_without_devshim

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    extensions = tmp / "torch_extensions"
    env = environment_without_devshim()
    env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    out = tmp / "results.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--output", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout, extensions


def test_every_benchmark_reports_and_none_failed(quick_report):
    report, stdout, _ = quick_report
    assert report["quick"] is True and report["failures"] == {}
    groups = {r["group"] for r in report["comparisons"]} | {n["group"] for n in report["notes"]}
    assert groups >= {"host_adam", "attention", "fused_ops", "import", "end_to_end"}
    targets = report["targets"]
    assert f"targets: {targets['met']} met, {targets['missed']} missed, {targets['inconclusive']} inconclusive " \
           f"of {targets['judged']}" in stdout


def test_each_comparison_is_the_geometric_mean_of_its_paired_rounds_with_its_interval(quick_report):
    report, _, _ = quick_report
    assert report["comparisons"]
    for result in report["comparisons"]:
        subject, peer = result["subject_rounds"], result["peer_rounds"]
        assert len(subject) == len(peer) == result["rounds"] >= 2, result
        assert all(0 < s < 60 for s in subject + peer), result
        ratios = [s / p for s, p in zip(subject, peer, strict=True)]
        assert math.isclose(result["ratio"], math.prod(ratios) ** (1 / len(ratios)))
        assert result["ci_low"] <= result["ratio"] <= result["ci_high"]
        expected = ("met" if result["ci_high"] <= result["max_ratio"] else
                    "missed" if result["ci_low"] > result["max_ratio"] else "inconclusive")
        assert result["verdict"] == (expected if result["judged"] else "informational")
        assert result["subject"] != result["peer"] and result["target"]


def test_the_target_count_is_the_judged_comparisons_and_nothing_else(quick_report):
    report, _, _ = quick_report
    judged = [r for r in report["comparisons"] if r["judged"]]
    targets = report["targets"]
    assert targets["judged"] == len(judged) == targets["met"] + targets["missed"] + targets["inconclusive"]
    assert all(set(note) == {"group", "name", "value", "unit"} for note in report["notes"])  # no verdict on a note


def test_the_report_names_the_machine(quick_report):
    machine = quick_report[0]["machine"]
    assert machine["logical_cpus"] >= 1 and machine["torch"].startswith("2.") and machine["torch_threads"] >= 1


def test_a_quick_run_compiles_nothing(quick_report):
    _, _, extensions = quick_report
    assert not extensions.exists() or not any(extensions.rglob("*.so"))


def test_the_results_render_as_markdown_for_the_performance_doc(quick_report):
    from bench.report import tables

    report = quick_report[0]
    text = tables(report)
    for result in report["comparisons"]:
        assert f"| {result['case']}" in text
        assert f"{result['ratio']:.3f}× ({result['ci_low']:.3f}-{result['ci_high']:.3f})" in text
    assert f"{report['targets']['met']} met, {report['targets']['missed']} missed" in text


def test_the_cuda_redirect_benchmark_measures_both_processes_and_checks_untouched_functions(quick_report):
    notes = [n for n in quick_report[0]["notes"] if n["group"] == "cuda_redirect"]
    process_pairs = [n for n in notes if ", process pairs: added per call, quick" in n["name"]]
    in_process = [n for n in notes if ", in one process: added per call, quick" in n["name"]]
    quick = process_pairs + in_process
    assert len(process_pairs) == 4 and len(in_process) == 4, notes
    assert all(n["unit"] == "µs" and math.isfinite(n["value"]) for n in quick)
    (untouched,) = [n for n in notes if n["name"].startswith("functions that take no device")]
    assert "torch.add" in untouched["name"] and untouched["unit"] == f"of {untouched['value']:.0f}"


def test_the_megatron_step_benchmark_runs_both_contenders_and_reports_their_memory(quick_report):
    notes = {n["name"]: n for n in quick_report[0]["notes"] if n["group"] == "megatron_step"}
    for contender in ("fused", "redirect"):
        (step,) = [n for name, n in notes.items() if name.startswith(f"{contender}: step time")]
        assert 0 < step["value"] < 60 and step["unit"] == "s"
        memory = [n for name, n in notes.items() if name.startswith(f"{contender}: peak")]
        assert len(memory) == 2 and all(n["unit"] == "MiB" and n["value"] > 0 for n in memory)


def test_the_megatron_step_benchmark_refuses_a_run_on_the_wrong_paths():
    from bench.megatron_step import _check_paths

    fused = {"attention_forward": "devshim_core.integrations.megatron.fused_ops._attention_forward.<locals>.forward",
             "bias_swiglu_impl": "devshim_core.integrations.megatron.fused_ops._bias_swiglu_impl.<locals>.f",
             "rotary_bshd": "devshim_core.integrations.megatron.fused_ops._rotary_bshd.<locals>.f",
             "norm_classes": ["DeviceRMSNorm", "IdentityOp"], "megatron_integration": "applied",
             "optimizers": ["devshim_core.integrations.megatron.fused_adam.FusedAdam"],
             "cuda_redirect": "applied (...)", "device": "cpu"}
    unfused = {**fused,
               "attention_forward": "megatron.core.transformer.dot_product_attention.DotProductAttention.forward",
               "bias_swiglu_impl": "megatron.core.fusions.fused_bias_swiglu.bias_swiglu_impl",
               "rotary_bshd": "megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_bshd",
               "norm_classes": ["IdentityOp", "RMSNorm"], "megatron_integration": "skipped: DEVSHIM_PATCH_MEGATRON=0",
               "optimizers": ["torch.optim.adamw.AdamW"]}
    _check_paths("fused", fused)
    _check_paths("redirect", unfused)
    for contender, paths in (("fused", unfused), ("redirect", fused), ("redirect", {**unfused, "device": "npu:0"}),
                             ("fused", {**fused, "optimizers": unfused["optimizers"]}),
                             ("redirect", {**unfused, "optimizers": fused["optimizers"]})):
        with pytest.raises(RuntimeError, match=contender):
            _check_paths(contender, paths)


def test_the_file_io_benchmark_moves_bytes_through_devshims_async_io_op(quick_report):
    notes = {n["name"]: n for n in quick_report[0]["notes"] if n["group"] == "file_io"}
    moved = [n for name, n in notes.items() if name.startswith("devshim async_io ")]
    assert {n["name"].split(",")[0] for n in moved} == {"devshim async_io write", "devshim async_io read"}
    assert all(n["unit"] == "GB/s" and n["value"] > 0 for n in moved)
    assert any(name.startswith("DeepSpeed's libaio op not run: not measured (--quick)") for name in notes)


def test_the_offload_step_benchmark_trains_through_the_one_pass_step(quick_report):
    notes = {n["name"]: n for n in quick_report[0]["notes"] if n["group"] == "offload_step"}
    from bench.offload_step import WARMUP

    assert notes["devshim: warm-up steps whose bf16 copy the host Adam wrote"]["value"] == WARMUP
    share = next(n for name, n in notes.items() if name.startswith("devshim: optimizer-step share"))
    assert 0 < share["value"] < 1
    assert any(name.startswith("DeepSpeed's CPU accelerator not run: not measured (--quick)") for name in notes)
