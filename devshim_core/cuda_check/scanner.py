"""The ast visitor: every CUDA-only construct of one source file, as findings. The file is parsed, never run.

Names are resolved through the file's imports (``import torch as th``, ``from torch import cuda``,
``from torch.cuda.amp import autocast``), in source order and without scopes: a script that rebinds ``torch``
is not what this is for. An attribute chain is classified once, by its longest resolvable name.

A finding on code that runs only when a flag says so is marked with the flag's condition (``if_reached``): code
under an ``if`` (or a conditional expression) whose test reads a script variable (``args.fp16``, ``config.get(...)``,
``HAVE_TE``), the environment, or compares with a CUDA name; and the body of a module-level function this file calls
only under such conditions (a private one, or any in a script with a ``__main__`` block: a public function of a
library module may be called from elsewhere).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import dataclasses
import re
from collections import defaultdict
from collections.abc import Sequence
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
    if_reached: str | None = None  # the condition the code it is in runs under; None: no flag guards it

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def scan_source(source: str, path: str, target: Target) -> list[Finding]:
    """Findings for ``source`` in line order; raises SyntaxError (or ValueError for NUL bytes) if unparsable."""
    tree = ast.parse(source, filename=path)
    scanner = _Scanner(source, path, target)
    scanner.visit(tree)
    return sorted(scanner.final_findings(tree), key=lambda f: (f.line, f.col))


_DEVICE_INDEX_MESSAGE = "a device index means cuda:<index> on CUDA; the redirect maps it to {device}"
_MODULE_NAME = re.compile(r"[\w.]+")
_BUILTINS = frozenset(dir(builtins)) | {"__name__", "__file__"}  # names a test reads that are not the script's flags


def _short(node: ast.AST, limit: int = 48) -> str:
    text = ast.unparse(node)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _fullmatch(pattern: re.Pattern[str] | str, node: ast.AST) -> bool:
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return False
    return node.value == pattern if isinstance(pattern, str) else pattern.fullmatch(node.value) is not None


def _is_cuda_device(node: ast.AST) -> bool:
    """'cuda', 'cuda:1', f'cuda:{rank}', 'cuda:' + str(rank), 'cuda:%d' % rank, 'cuda:{}'.format(rank)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        return _fullmatch(rules.CUDA_DEVICE, node.func.value)
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


_OPPOSITES: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
    ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt,
}


def _negated(test: ast.expr) -> ast.expr:
    """The condition an ``else`` branch runs under, as a reader writes it: ``x is not None``, ``not args.fp16``."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return test.operand
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        return ast.Compare(test.left, [_OPPOSITES[type(test.ops[0])]()], test.comparators)
    return ast.UnaryOp(ast.Not(), test)


_CONDITION_LIMIT = 120


def _condition_text(test: ast.expr) -> str:
    """One condition, short, parenthesised where ``and`` would change its meaning."""
    text = _short(test, 72)
    wrap = isinstance(test, (ast.IfExp, ast.Lambda, ast.NamedExpr)) or (isinstance(test, ast.BoolOp)
                                                                         and isinstance(test.op, ast.Or))
    return f"({text})" if wrap else text


def _is_main_guard(test: ast.expr) -> bool:
    """``__name__ == "__main__"``."""
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.comparators) == 1 and _fullmatch("__main__", test.comparators[0]))


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
        self.megatron = target.megatron
        self.aliases: dict[str, str] = {}  # local name -> dotted name it was imported as
        self.reported_aliases: set[str] = set()  # names bound by an import already reported: uses are not
        self.done: set[int] = set()  # ids of nodes already reported from their parent's context
        # try blocks whose except clause catches an import error, innermost last: (the clause's line, re-raises)
        self.guards: list[tuple[int, bool]] = []
        self.conditions: list[str] = []  # the flag conditions of the enclosing branches, outermost first
        self.scopes: list[ast.AST] = []  # the enclosing defs and classes, outermost first
        self.findings: list[Finding] = []
        self.finding_scope: list[str | None] = []  # per finding: the module-level function it is in
        # name -> each use: (the condition it is called under, None if it is not called or unconditionally; the
        # module-level function the use is in)
        self.uses: defaultdict[str, list[tuple[str | None, str | None]]] = defaultdict(list)
        self.called: set[int] = set()  # ids of the Name nodes that are called

    # -- reporting ------------------------------------------------------------------------------

    def add(self, node: ast.expr | ast.stmt, category: Category, construct: str, message: str,
            at: tuple[int, int] | None = None) -> None:
        line, offset = at or (node.lineno, node.col_offset)
        text = self.lines[line - 1] if line <= len(self.lines) else ""
        col = len(text.encode()[:offset].decode(errors="replace")) + 1  # ast counts UTF-8 bytes
        with contextlib.suppress(KeyError, IndexError, ValueError):  # a message with braces of its own stays as is
            message = message.format(**self.words)  # {device}, {backend}, {visible}
        condition = self._condition()
        self.findings.append(Finding(self.path, line, col, category, construct, message, condition))
        self.finding_scope.append(self._function())

    def _function(self) -> str | None:
        """The module-level function the visitor is in (not a method: who calls those is not known here)."""
        if self.scopes and isinstance(self.scopes[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
            return self.scopes[0].name
        return None

    # -- code behind a flag ---------------------------------------------------------------------

    def _flag(self, test: ast.expr) -> bool:
        """Whether ``test`` reads a flag: a script variable or attribute, the environment, or a CUDA comparison.
        A test made only of imported names and constants (``torch.cuda.is_available()``, ``TYPE_CHECKING``) or of
        ``__name__`` is not one: it answers the same in every run of the script."""
        for node in ast.walk(test):
            if isinstance(node, ast.Name) and node.id not in self.aliases and node.id not in _BUILTINS:
                return True
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call):  # get_args().fp16
                return True
            if isinstance(node, (ast.Name, ast.Attribute)) and (self.resolve(node) or "").startswith(
                    ("os.environ", "os.getenv")):
                return True
            if isinstance(node, ast.Compare) and any(
                    _is_cuda_device(o) or _fullmatch(rules.NCCL, o) for o in (node.left, *node.comparators)):
                return True
        return False

    def _condition(self) -> str | None:
        """Every enclosing flag condition, outermost first (the middle ones elided when that gets long)."""
        if not self.conditions:
            return None
        text = " and ".join(self.conditions)
        if len(text) > _CONDITION_LIMIT and len(self.conditions) > 2:
            text = f"{self.conditions[0]} and ... and {self.conditions[-1]}"
        return text

    def _branch(self, nodes: Sequence[ast.AST], condition: str | None) -> None:
        if condition:
            self.conditions.append(condition)
        for node in nodes:
            self.visit(node)
        if condition:
            self.conditions.pop()

    def _conditional(self, test: ast.expr, body: Sequence[ast.AST], orelse: Sequence[ast.AST]) -> None:
        self.visit(test)
        flag = self._flag(test)
        self._branch(body, _condition_text(test) if flag else None)
        self._branch(orelse, _condition_text(_negated(test)) if flag else None)

    def visit_If(self, node: ast.If) -> None:
        self._conditional(node.test, node.body, node.orelse)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self._conditional(node.test, [node.body], [node.orelse])

    def _scope(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scopes.append(node)
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope

    def final_findings(self, tree: ast.Module) -> list[Finding]:
        """The findings, once the whole file is read: those in a function it calls only under flags are marked with
        the calls' conditions."""
        script = any(isinstance(s, ast.If) and _is_main_guard(s.test) for s in tree.body)
        marks: dict[str, str] = {}
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if not (script or node.name.startswith("_")):
                continue
            uses = [c for c, f in self.uses[node.name] if f != node.name]  # recursion is no caller
            if uses and all(uses):
                conditions = list(dict.fromkeys(c for c in uses if c))
                marks[node.name] = f"{node.name}() is called only if {' or '.join(conditions)}"
        return [dataclasses.replace(f, if_reached=marks[scope])
                if f.if_reached is None and scope in marks else f
                for f, scope in zip(self.findings, self.finding_scope, strict=True)]

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
        rule = rules.module_rule(dotted)
        return rules.import_rule(rule, None, self.megatron) if rule else None

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):  # `flash_attn = None` in an except clause rebinds, it does not use
            # a function passed on (a callback) may be called from anywhere: only a call has a known condition
            called = id(node) in self.called
            condition = self._condition() if called else None
            self.uses[node.id].append((condition, self._function()))
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
        reported: set[str] = set()
        for alias in node.names:
            full = f"{node.module}.{alias.name}"
            bound = alias.asname or alias.name
            self.aliases[bound] = full
            rule = rules.module_rule(full)
            if rule is None:
                continue
            self.reported_aliases.add(bound)
            # `from apex import amp` is apex.amp's rule; `from flash_attn import f` is one import of flash_attn
            module = full if len(rule.key) > len(node.module) else node.module
            if module not in reported:
                reported.add(module)
                self._report_import(node, module)

    def _report_import(self, node: ast.expr | ast.stmt, module: str) -> bool:
        rule = rules.module_rule(module)
        if rule is None:
            return False
        category, message = rules.import_rule(rule, self.guards[-1] if self.guards else None, self.megatron)
        self.add(node, category, f"import {module}", message)
        return True

    def visit_Try(self, node: ast.Try) -> None:
        # an import error is caught by the first clause that matches it: that clause decides
        handler = next((h for h in node.handlers if self._catches_import_error(h.type)), None)
        if handler is not None:
            self.guards.append((handler.lineno, self._exits(handler)))
        for stmt in node.body:
            self.visit(stmt)
        if handler is not None:
            self.guards.pop()
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)

    visit_TryStar = visit_Try

    def _catches_import_error(self, handler_type: ast.expr | None) -> bool:
        if handler_type is None:
            return True
        names = handler_type.elts if isinstance(handler_type, ast.Tuple) else [handler_type]
        return any(isinstance(n, ast.Name) and n.id in rules.IMPORT_ERRORS for n in names)

    def _exits(self, handler: ast.ExceptHandler) -> bool:
        """Whether the clause raises or exits whatever happens (a raise under an ``if`` of its own is a choice)."""
        for stmt in handler.body:
            if isinstance(stmt, ast.Raise):
                return True
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
                func = stmt.value.func
                name = self.resolve(func) or (func.id if isinstance(func, ast.Name) else None)
                if name in rules.EXITS:
                    return True
        return False

    # -- calls ----------------------------------------------------------------------------------

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name):
            self.called.add(id(func))
        if _is_cuda_device(node):  # 'cuda:{}'.format(rank)
            self._literal(node)
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
            if name == "map_location" or (callee == "torch.load" and i == 1 and name is None):
                self._map_location(arg, construct)
            self._literal(arg, construct)
        self.generic_visit(node)

    def _map_location(self, node: ast.expr, construct: str) -> None:
        """torch.load(..., map_location='cuda:0' or {'cuda:1': 'cuda:0'}): one finding for the argument."""
        literals = [*node.keys, *node.values] if isinstance(node, ast.Dict) else [node]
        if any(n is not None and _is_cuda_device(n) for n in literals):
            self.add(node, "redirected", construct, rules.MAP_LOCATION_MESSAGE)
            self.done.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Constant, ast.JoinedStr,
                                                                           ast.BinOp, ast.Call)))

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
            if isinstance(node, ast.Call):  # 'cuda:{}'.format(rank): the literal inside is this finding
                self.done.add(id(cast(ast.Attribute, node.func).value))
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
                if isinstance(operand, ast.Call):
                    self.done.add(id(cast(ast.Attribute, operand.func).value))
        self.generic_visit(node)
