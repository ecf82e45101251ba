"""Spec: devshim never unpickles arbitrary objects: every ``torch.load`` in its code passes ``weights_only=True``.

A checkpoint is data a user may have downloaded; ``weights_only=False`` (the default before torch 2.6) runs any
code a crafted file carries. The scan reads every Python source the project ships or runs (the core, the kernels,
the plugins, the emulation, the examples, the benchmarks, the stress loop, the release and build helpers) with
``ast``, so a call written any way (``torch.load``, ``load`` imported from torch, through an alias) is seen. The
tests are left out: they read back checkpoints their own jobs wrote.
"""

from __future__ import annotations

import ast

from plugin_fixtures import PROJECT_DIR

SOURCES = [PROJECT_DIR / name for name in ("devshim_core", "kernels", "plugins", "emulation", "examples", "bench",
                                           "stress", "release", "build_support", "docs_support")]
TOP_LEVEL = sorted(PROJECT_DIR.glob("*.py"))  # setup.py and any other module at the root


def torch_loads(tree: ast.AST) -> list[ast.Call]:
    """Calls of torch.load, however the module or the function was imported."""
    torch_names, load_names = {"torch"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            torch_names |= {a.asname or a.name for a in node.names if a.name == "torch"}
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.serialization"):
            load_names |= {a.asname or a.name for a in node.names if a.name == "load"}
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr == "load" and isinstance(func.value, ast.Name)
                and func.value.id in torch_names) or (isinstance(func, ast.Name) and func.id in load_names):
            calls.append(node)
    return calls


def weights_only(call: ast.Call) -> bool:
    return any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
               for k in call.keywords)


def test_the_scan_sees_every_spelling_of_a_torch_load():
    code = ("import torch\nimport torch as t\nfrom torch import load\nfrom torch.serialization import load as L\n"
            "torch.load(f)\nt.load(f, weights_only=True)\nload(f)\nL(f, weights_only=False)\njson.load(f)\n")
    calls = torch_loads(ast.parse(code))
    assert [(c.lineno, weights_only(c)) for c in calls] == [(5, False), (6, True), (7, False), (8, False)]


def test_every_torch_load_in_devshim_loads_weights_only():
    unsafe = []
    assert all(root.is_dir() for root in SOURCES), [str(root) for root in SOURCES if not root.is_dir()]
    for path in [*TOP_LEVEL, *(p for root in SOURCES for p in root.rglob("*.py"))]:
        if ".venv" in path.parts or "build" in path.parts:
            continue
        for call in torch_loads(ast.parse(path.read_text(), filename=str(path))):
            if not weights_only(call):
                unsafe.append(f"{path.relative_to(PROJECT_DIR)}:{call.lineno}")
    assert unsafe == [], f"torch.load without weights_only=True: {unsafe}"
