"""A griffe extension for the docs site: the reST markup devshim's docstrings use, rendered as Markdown.

A paragraph that introduces a literal block ends in ``::``, which reST shows as ``:``; so does the site (the
indented block is already code in Markdown).

Docstrings here write ``:class:`DeviceReport```, ``:func:`~devshim_kernels.layouts.to_bnsd``` or ``:mod:`.norm```.
mkdocstrings renders Markdown, so each role becomes a cross-reference to the object it names, resolved as Python
would from the docstring's own scope (imports under ``TYPE_CHECKING`` included):

- a devshim object that the API reference renders becomes a link to it; one it does not render stays code;
- a builtin or a name imported from outside devshim (``OSError``, ``atexit``) stays code;
- a name that resolves to nothing is a warning, which fails ``mkdocs build --strict``: a reference that was
  renamed away is caught like a broken link.
"""

from __future__ import annotations

import builtins
import html
import re
from typing import Any

import griffe

logger = griffe.logger  # mkdocstrings routes it to mkdocs' log, where a warning counts for --strict

LITERAL_BLOCK = re.compile(r"(?<=\S)::(?=[ \t]*\n[ \t]*\n)")
ROLE = re.compile(r":(?:class|func|meth|data|attr|exc|mod|obj):`(~?)([^`]+)`")
PROJECT_PACKAGES = ("devshim_core", "devshim_kernels", "devshim_cpu_reference", "devshim_ascend", "devshim_sophgo")


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for obj in _walk(pkg):
            if obj.docstring is not None and ":" in obj.docstring.value:
                value = LITERAL_BLOCK.sub(":", obj.docstring.value)
                obj.docstring.value = ROLE.sub(lambda m, o=obj: _reference(o, loader, m), value)


def _walk(obj: griffe.Object) -> Any:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


def _reference(obj: griffe.Object, loader: griffe.GriffeLoader, match: re.Match[str]) -> str:
    short, written = match.group(1) == "~", match.group(2)
    text = written.rsplit(".", 1)[-1] if short else written.lstrip(".")
    path = _resolve(obj, written)
    if path is None:
        head = written.split(".")[0]
        if hasattr(builtins, head):  # OSError, RuntimeError
            return f"`{text}`"
        path = written  # a name nothing defines or imports here: reported below
    elif not path.startswith(PROJECT_PACKAGES):  # imported from outside devshim: atexit, torch
        return f"`{text}`"
    if not _exists(loader, path):
        location = f"{obj.filepath}:{obj.lineno}" if not isinstance(obj.filepath, list) else obj.path
        logger.warning("%s: %s names nothing in devshim (resolved to %s)", location, match.group(0), path)
        return f"`{text}`"
    # optional: links where the reference renders the object, plain code where it does not
    return f'<autoref identifier="{html.escape(path)}" optional><code>{html.escape(text)}</code></autoref>'


def _resolve(obj: griffe.Object, written: str) -> str | None:
    if written.startswith("."):  # relative to the docstring's package, as in an import
        module = obj if obj.is_module else obj.module
        package = module.path if module.is_package else module.path.rsplit(".", 1)[0]
        return f"{package}.{written.lstrip('.')}"
    head, _, rest = written.partition(".")
    if head in PROJECT_PACKAGES:
        return written
    try:
        resolved = obj.resolve(head)
    except griffe.NameResolutionError:
        return None
    return f"{resolved}.{rest}" if rest else resolved


def _exists(loader: griffe.GriffeLoader, path: str) -> bool:
    top = path.split(".")[0]
    try:
        if top not in loader.modules_collection:
            loader.load(top)
        loader.modules_collection[path]  # a lookup that raises when the path names nothing
    except (KeyError, ImportError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return False
    return True
