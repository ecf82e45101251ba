"""The ast visitor: every CUDA-only construct of one source file, as findings. The file is parsed, never run.

Names are resolved through the file's imports (``import torch as th``, ``from torch import cuda``,
``from torch.cuda.amp import autocast``), in source order and without scopes: a script that rebinds ``torch``
is not what this is for. An attribute chain is classified once, by its longest resolvable name.
"""

from __future__ import annotations

import ast
import contextlib
import re
from dataclasses import asdict, dataclass
from typing import Any, cast

from devshim_core.cuda_check import rules
from devshim_core.cuda_check.rules import Category
from devshim_core.cuda_check.target import Target
from devshim_core.integrations.cuda_redirect import coverage


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    col: int  # 1-based, in characters
    category: Category
    construct: str
    message: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def scan_source(source: str, path: str, target: Target) -> list[Finding]:
    """Findings for ``source`` in line order; raises SyntaxError (or ValueError for NUL bytes) if unparsable."""
    tree = ast.parse(source, filename=path)
    scanner = _Scanner(source, path, target)
    scanner.visit(tree)
    return sorted(scanner.findings, key=lambda f: (f.line, f.col))


_DEVICE_INDEX_MESSAGE = "a device index means cuda:<index> on CUDA; the redirect maps it to {device}"
_MODULE_NAME = re.compile(r"[\w.]+")


def _short(node: ast.AST, limit: int = 48) -> str:
    text = ast.unparse(node)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _fullmatch(pattern: re.Pattern[str] | str, node: ast.AST) -> bool:
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return False
    return node.value == pattern if isinstance(pattern, str) else pattern.fullmatch(node.value) is not None


def _is_cuda_device(node: ast.AST) -> bool:
    """'cuda', 'cuda:1', f'cuda:{rank}', 'cuda:' + str(rank), 'cuda:%d' % rank."""
    if isinstance(node, ast.JoinedStr):
        return bool(node.values) and _fullmatch(rules.CUDA_DEVICE, node.values[0])
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        return _fullmatch(rules.CUDA_DEVICE, node.left)
    return _fullmatch(rules.CUDA_DEVICE, node)


def _is_tensor_type_name(node: ast.AST) -> bool:
    """'torch.cuda.HalfTensor', as tensor.type() takes and returns it."""
    match = (rules.TENSOR_TYPE_NAME.fullmatch(node.value)  # type: ignore[attr-defined]  # a str: _fullmatch checked
             if _fullmatch(rules.TENSOR_TYPE_NAME, node) else None)
    return match is not None and match.group(1) in coverage.TENSOR_TYPES


def _is_device_index(node: ast.AST) -> bool:
    """An int, or a name that holds one by convention (local_rank, args.local_rank, gpu_id)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int) and not isinstance(node.value, bool)
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    return name is not None and rules.DEVICE_INDEX_NAME.fullmatch(name) is not None


class _Scanner(ast.NodeVisitor):
    def __init__(self, source: str, path: str, target: Target) -> None:
        self.lines = source.splitlines()
        self.path = path
        self.words = target.words()
        self.aliases: dict[str, str] = {}  # local name -> dotted name it was imported as
        self.reported_aliases: set[str] = set()  # names bound by an import already reported: uses are not
        self.done: set[int] = set()  # ids of nodes already reported from their parent's context
        self.guarded = 0  # depth of try blocks that catch ImportError
        self.findings: list[Finding] = []

    # -- reporting ------------------------------------------------------------------------------

    def add(self, node: ast.expr | ast.stmt, category: Category, construct: str, message: str,
            at: tuple[int, int] | None = None) -> None:
        line, offset = at or (node.lineno, node.col_offset)
        text = self.lines[line - 1] if line <= len(self.lines) else ""
        col = len(text.encode()[:offset].decode(errors="replace")) + 1  # ast counts UTF-8 bytes
        with contextlib.suppress(KeyError, IndexError, ValueError):  # a message with braces of its own stays as is
            message = message.format(**self.words)  # {device}, {backend}, {visible}
        self.findings.append(Finding(self.path, line, col, category, construct, message))

    # -- names ----------------------------------------------------------------------------------

    def resolve(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def _root_reported(self, node: ast.AST) -> bool:
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id in self.reported_aliases

    def classify_name(self, dotted: str) -> tuple[Category, str] | None:
        parts = dotted.split(".")
        if parts[:2] == ["torch", "cuda"] and len(parts) > 2:
            return rules.torch_cuda_rule(parts[2:])
        review = rules.review_prefix_rule(dotted)
        if review:
            return "review", review
        if dotted == f"{rules.CPP_EXTENSION}.CUDAExtension":
            return "unsupported", rules.CUDA_EXTENSION_MESSAGE
        if dotted == "torch.distributed.Backend.NCCL":
            return "redirected", "backend NCCL becomes {backend} on {device}"
        return rules.module_rule(dotted)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):  # `flash_attn = None` in an except clause rebinds, it does not use
            self._visit_chain(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr == "is_cuda":
            self.add(node, "review", _short(node), rules.IS_CUDA_MESSAGE)
        self._visit_chain(node)

    def _visit_chain(self, node: ast.Name | ast.Attribute) -> None:
        dotted = self.resolve(node)
        if dotted is None:
            self.generic_visit(node)  # e.g. the call inside torch.cuda.get_device_properties(0).total_memory
            return
        rule = self.classify_name(dotted)
        if rule and not self._root_reported(node):
            self.add(node, rule[0], dotted, rule[1])
        # the longest resolvable chain was classified: its prefixes are not classified again

    # -- imports --------------------------------------------------------------------------------

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            bound = alias.asname or alias.name.split(".")[0]
            self.aliases[bound] = alias.name if alias.asname else bound
            # `import flash_attn.ops` binds flash_attn, which is reported; `import torch.cuda.jiterator` binds torch
            if self._report_import(node, alias.name) and (alias.asname or rules.module_rule(bound)):
                self.reported_aliases.add(bound)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module:
            return  # relative imports are the project's own modules
        whole = self._report_import(node, node.module)
        for alias in node.names:
            full = f"{node.module}.{alias.name}"
            bound = alias.asname or alias.name
            self.aliases[bound] = full
            if whole or self._report_import(node, full):
                self.reported_aliases.add(bound)

    def _report_import(self, node: ast.expr | ast.stmt, module: str) -> bool:
        rule = rules.module_rule(module)
        if rule is None:
            return False
        category, message = rule
        if category == "unsupported" and self.guarded:
            category, message = "review", rules.GUARDED_IMPORT_MESSAGE.format(why=message)
        self.add(node, category, f"import {module}", message)
        return True

    def visit_Try(self, node: ast.Try) -> None:
        catches = any(self._catches_import_error(h.type) for h in node.handlers)
        self.guarded += catches
        for stmt in node.body:
            self.visit(stmt)
        self.guarded -= catches
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)

    visit_TryStar = visit_Try

    def _catches_import_error(self, handler_type: ast.expr | None) -> bool:
        if handler_type is None:
            return True
        names = handler_type.elts if isinstance(handler_type, ast.Tuple) else [handler_type]
        return any(isinstance(n, ast.Name) and n.id in rules.IMPORT_ERRORS for n in names)

    # -- calls ----------------------------------------------------------------------------------

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        callee = self.resolve(func)
        if callee == "importlib.import_module" and node.args and _fullmatch(_MODULE_NAME, node.args[0]):
            self._report_import(node, node.args[0].value)  # type: ignore[attr-defined]  # a str: _fullmatch checked
        if callee in (f"{rules.CPP_EXTENSION}.load", f"{rules.CPP_EXTENSION}.load_inline"):
            self._cpp_extension_load(node, callee)
        if callee is None and isinstance(func, ast.Attribute):
            self._method_call(node, func)
        arguments = [(None, arg) for arg in node.args] + [(k.arg, k.value) for k in node.keywords]
        for i, (name, arg) in enumerate(arguments):
            shown = f"{name}={_short(arg)}" if name else _short(arg)
            before, after = "..., " * (i > 0), ", ..." * (i < len(arguments) - 1)
            construct = f"{_short(func, 40)}({before}{shown}{after})"
            if name == "device" and _is_device_index(arg):
                self.add(arg, "redirected", construct, _DEVICE_INDEX_MESSAGE)
                self.done.add(id(arg))
            self._literal(arg, construct)
        self.generic_visit(node)

    def _method_call(self, node: ast.Call, func: ast.Attribute) -> None:
        if func.attr == "cuda":
            served = "cuda" in coverage.TENSOR_METHODS | coverage.MODULE_METHODS
            # model.cuda() is reported at .cuda (ast.parse sets the end positions: ints, never None)
            dot = (cast(int, func.end_lineno), cast(int, func.end_col_offset) - len(".cuda"))
            self.add(func, "redirected" if served else "review", f"{_short(func.value, 32)}.cuda()",
                     ".cuda() moves tensors and modules to {device}" if served else ".cuda() is not redirected",
                     at=dot)
        elif func.attr in coverage.TENSOR_METHODS and node.args and _is_device_index(node.args[0]):
            self.add(node.args[0], "redirected", f".{func.attr}({_short(node.args[0])})",
                     _DEVICE_INDEX_MESSAGE)
            self.done.add(id(node.args[0]))

    def _cpp_extension_load(self, node: ast.Call, callee: str) -> None:
        keywords = {k.arg: k.value for k in node.keywords}
        sources = keywords.get("sources", node.args[1] if len(node.args) > 1 else None)
        cu_files = sources is not None and any(
            isinstance(n, ast.Constant) and isinstance(n.value, str) and rules.CUDA_SOURCE.search(n.value)
            for n in ast.walk(sources))
        with_cuda = (isinstance(keywords.get("with_cuda"), ast.Constant)
                     and cast(ast.Constant, keywords["with_cuda"]).value is True)
        if cu_files or "cuda_sources" in keywords or with_cuda:
            self.add(node, "unsupported", f"{callee}(... CUDA sources ...)", rules.CUDA_EXTENSION_MESSAGE)

    # -- string literals --------------------------------------------------------------------------

    def _literal(self, node: ast.expr, construct: str | None = None) -> None:
        """Report a string literal naming a CUDA thing; ``construct`` shows it in its call or subscript."""
        if id(node) in self.done:
            return
        construct = construct or _short(node)
        if _is_cuda_device(node):
            self.add(node, "redirected", construct, "'cuda' names {device} through the redirect")
        elif _fullmatch(rules.NCCL, node):
            self.add(node, "redirected", construct, "backend 'nccl' becomes {backend} on {device}")
        elif _is_tensor_type_name(node):
            self.add(node, "redirected", construct, "the redirect reports {device} tensors by their CUDA type names")
        elif _fullmatch(rules.CUDA_VISIBLE_DEVICES, node):
            self.add(node, "review", construct, "CUDA_VISIBLE_DEVICES does not restrict {device}; use {visible}")
        elif _fullmatch(rules.CUDA_ENV, node):
            self.add(node, "review", construct, "CUDA variables have no effect on {device}")
        elif _fullmatch(rules.NCCL_ENV, node):
            self.add(node, "review", construct, "NCCL variables do not steer {backend}; set the plugin's own")
        else:
            return
        self.done.add(id(node))

    def visit_Subscript(self, node: ast.Subscript) -> None:
        self._literal(node.slice, _short(node))  # os.environ['CUDA_VISIBLE_DEVICES']
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        self._literal(node)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        self._literal(node)
        if id(node) not in self.done:
            self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if _is_cuda_device(node):
            self._literal(node)
            self.visit(node.right)
        else:
            self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        if not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):  # docstrings
            self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        """``x.device.type == 'cuda'`` is False on another device: the branch the script takes changes."""
        for operand in (node.left, *node.comparators):
            if _is_cuda_device(operand) or _fullmatch(rules.NCCL, operand) or _is_tensor_type_name(operand):
                self.add(operand, "review", _short(node),
                         "devices and backends here ({device}, {backend}) do not report this CUDA name: "
                         "check which branch runs")
                self.done.add(id(operand))
        self.generic_visit(node)
