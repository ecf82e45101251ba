"""The table of every patch devshim applies, generated from the registry (``devshim patches --markdown``); a patch
gated to other releases of a framework than the installed one is listed too, with the range it is for.

Activates devshim as a script would, imports each installed framework so that armed patch sets fire, then
renders ``REGISTRY.report()``: nothing in the table is written by hand.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from devshim_core.patching import REGISTRY
from devshim_core.session import activate

# what a Megatron, DeepSpeed or HF Trainer script imports; each fires the patch sets armed for it
_FRAMEWORK_MODULES = ("deepspeed", "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
                      "accelerate.accelerator", "transformers.training_args")


def collect() -> list[dict[str, Any]]:  # REGISTRY.report()'s rows
    session = activate()
    for name in _FRAMEWORK_MODULES:
        if importlib.util.find_spec(name.partition(".")[0]) is not None:
            importlib.import_module(name)
    rows = REGISTRY.report() + REGISTRY.gated_report()
    for row in rows:
        row["plugin"] = session.device.plugin
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| set | patch | target | versions | why |", "|---|---|---|---|---|"]
    for r in rows:
        requires = ", ".join(f"{d} {s}" for d, s in r["requires"].items()) or "-"
        cells = [str(r["set"]), str(r["name"]), f"`{r['target']}`", requires, str(r["reason"])]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)
