"""Every field of a record a plugin returns has its declared type, or activation stops naming plugin, hook and field.

A plugin's answers reach frameworks as they are: ``bf16_supported="no"`` would make ``torch.cuda.is_bf16_supported()``
return a truthy string, and a dtype written as ``"bfloat16"`` would reach DeepSpeed. The declared annotations of
:mod:`devshim_core.records` are the contract; this module reads them and checks values against them.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from devshim_core.errors import PluginError


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    from devshim_core import records

    return typing.get_type_hints(cls, {**vars(records), "torch": torch})


def _describe(annotation: Any) -> str:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " | ".join(_describe(arm) for arm in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type):
        module, name = annotation.__module__, annotation.__qualname__
        return name if module in ("builtins", "devshim_core.records") else f"{module}.{name}"
    return str(annotation).replace("typing.", "").replace("collections.abc.", "")


def _problem(value: Any, annotation: Any) -> str | None:
    """Why ``value`` does not have type ``annotation``, or ``None``."""
    if annotation is Any:
        return None
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        problems = [_problem(value, arm) for arm in args]
        return None if any(p is None for p in problems) else f"is {value!r:.60}, expected {_describe(annotation)}"
    if origin is tuple:
        if not isinstance(value, tuple):
            return f"is a {type(value).__name__}, expected a tuple"
        item = args[0] if len(args) == 2 and args[1] is Ellipsis else None
        for index, element in enumerate(value):
            problem = _problem(element, item if item is not None else args[index] if index < len(args) else Any)
            if problem:
                return f"item {index} {problem}"
        return None
    if origin in (Mapping, dict) or annotation in (Mapping, dict):
        if not isinstance(value, Mapping):
            return f"is a {type(value).__name__}, expected a mapping"
        key_type = args[0] if args else Any
        for key in value:
            problem = _problem(key, key_type)
            if problem:
                return f"key {key!r:.40} {problem}"
        return None
    if origin is Callable or annotation is Callable:
        return None if callable(value) else f"is {value!r:.60}, expected a callable"
    if origin in (list, Sequence):
        return None if isinstance(value, (list, tuple)) else f"is a {type(value).__name__}, expected a sequence"
    if isinstance(annotation, type):
        if getattr(annotation, "_is_protocol", False):  # FusedAdamW, HostAdamStep: callables of that signature
            return None if callable(value) else f"is {value!r:.60}, expected a callable ({annotation.__name__})"
        if annotation is bool:  # 0, 1 and "no" are not answers to a yes/no question
            return None if type(value) is bool else f"is {value!r:.60} ({type(value).__name__}), expected a bool"
        if annotation is int and isinstance(value, bool):
            return f"is {value!r}, expected an int"
        if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return None
        if isinstance(value, annotation):
            return None
        return f"is {value!r:.60} ({type(value).__name__}), expected {_describe(annotation)}"
    return None  # an annotation this check does not model is not checked, rather than refused wrongly


def check_record(record: Any, plugin: str, hook: str) -> None:
    """Raise :class:`PluginError` naming ``plugin``, ``hook`` and the first field of ``record`` whose value does not
    have its declared type."""
    record_type: type = type(record)  # (to mypy, type[Any] is not Hashable, as lru_cache wants; a class is)
    for field in dataclasses.fields(record):
        annotation = _field_types(record_type).get(field.name, Any)
        problem = _problem(getattr(record, field.name), annotation)
        if problem:
            raise PluginError(f"plugin {plugin!r}: {hook} returned {type(record).__name__} whose field "
                              f"{field.name} {problem}.")


def check_environment_map(record: Any, plugin: str, hook: str) -> None:
    """Beyond the field types: an :class:`~devshim_core.records.EnvironmentMap` maps CUDA/NCCL names only, to
    variable names, and converts only what it maps; raise :class:`PluginError` naming the first entry that does not."""
    from devshim_core.env_migration import is_source
    from devshim_core.records import EnvironmentMap

    if not isinstance(record, EnvironmentMap):
        raise PluginError(f"plugin {plugin!r}: {hook} returned {type(record).__name__}, expected EnvironmentMap.")
    check_record(record, plugin, hook)
    where = f"plugin {plugin!r}: {hook} returned EnvironmentMap whose"
    for source, target in record.variables.items():
        if not is_source(source):
            raise PluginError(f"{where} variables maps {source!r}, which is not CUDA_VISIBLE_DEVICES, "
                              "PYTORCH_CUDA_ALLOC_CONF, NCCL_* or TORCH_NCCL_*.")
        if not isinstance(target, str) or not target.isidentifier() or is_source(target):
            raise PluginError(f"{where} variables maps {source!r} to {target!r}, which is not a vendor variable name.")
    for source, converter in record.convert.items():
        if source not in record.variables:
            raise PluginError(f"{where} convert has {source!r}, which variables does not map.")
        if not callable(converter):
            raise PluginError(f"{where} convert[{source!r}] is {converter!r:.60}, expected a callable.")
    bad = [rule for rule in record.ignored if not isinstance(rule, str) or not rule]
    if bad:
        raise PluginError(f"{where} ignored has {bad!r:.60}; expected variable names or prefixes ending in '_'.")
