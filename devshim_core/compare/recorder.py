"""The recorder ``devshim compare`` installs in each process of a run (``DEVSHIM_COMPARE_DIR`` set).

It uses torch's own global hooks, nothing patched: module forward pre- and post-hooks (every ``nn.Module`` of the
process, whoever built it), tensor hooks on module outputs and parameters (their gradients, read in the backward
and passed on unchanged) and optimizer step pre- and post-hooks (every ``torch.optim.Optimizer``, DeepSpeed's and
Megatron's inner ones included). A step ends with the outermost optimizer step of the process (an optimizer wrapping
another, as Accelerate's, counts once). Every hook reads tensors and copies a sample to the host; none returns a
value, so none changes what the script computes.

Module names are their paths from the outermost module called (``DeepSpeedEngine.module.blocks.0.attn``): when a
module is first called with no other module running, it and every module it owns are named. A module no such
outermost module owns is named after the one that called it: ``caller/ClassName``.

With ``DEVSHIM_COMPARE_STEPS=N`` (``devshim compare --steps``) the process stops at the first forward after its
N-th step: the dump is closed, every rank meets at a barrier (when a process group is up, so that no rank leaves
while another still waits in the step's collectives), and the process exits with status 0. A recording that fails
(a full disk) stops recording, says why on stderr and in the dump's ``meta.json``, and leaves the run alone.
"""

from __future__ import annotations

import atexit
import fnmatch
import os
import sys
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from devshim_core import log
from devshim_core.compare.dump import DumpWriter
from devshim_core.compare.names import DEFAULT_SAMPLE, DIR, FULL, SAMPLE, STEPS
from devshim_core.errors import ConfigError


def _count(environ: Mapping[str, str], name: str, default: int, least: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < least:
        raise ConfigError(f"{name}={environ[name]!r} is not valid: {name} takes an integer of at least {least}.")
    return int(raw)


def _tensors(value: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The floating tensors in a module's output, with where each sits (tuples, lists, dicts, HF ModelOutput)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.numel():
            yield path or ".", value
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{path}.{i}" if path else str(i))
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _tensors(item, f"{path}.{key}" if path else str(key))


class Recorder:
    """One process's recording: :meth:`install` registers the hooks, :meth:`uninstall` removes them."""

    def __init__(self, directory: Path, *, steps: int, sample: int, full: tuple[str, ...], meta: dict[str, Any]):
        self.writer = DumpWriter(directory, dict(meta, steps_requested=steps, sample=sample, full=list(full)))
        self.steps, self.sample, self.full = steps, sample, full
        self.step = 0
        self.order = 0
        self.failed: str | None = None
        self._names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        # by identity: a tensor's == is elementwise
        self._param_names: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._roots: dict[str, int] = {}
        self._calls: dict[str, int] = {}
        self._stack: list[torch.nn.Module] = []
        self._optimizer_depth = 0
        self._handles: list[Any] = []

    # -- installing -------------------------------------------------------------------------------------------

    def install(self) -> None:
        from torch.nn.modules import module
        from torch.optim import optimizer

        self._handles = [module.register_module_forward_pre_hook(self._before_forward),
                         module.register_module_forward_hook(self._after_forward, always_call=True),
                         optimizer.register_optimizer_step_pre_hook(self._before_step),
                         optimizer.register_optimizer_step_post_hook(self._after_step)]
        atexit.register(self.close)

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.close()

    def close(self) -> None:
        self.writer.close(complete=self.failed is None)

    # -- recording --------------------------------------------------------------------------------------------

    def _sample_of(self, module: str) -> int:
        return sys.maxsize if any(fnmatch.fnmatchcase(module, p) for p in self.full) else self.sample

    def _add(self, kind: str, module: str, call: int, tensor: str, value: torch.Tensor) -> None:
        if self.failed is not None or self.writer.meta.get("stopped"):
            return
        try:
            self.writer.add(step=self.step, order=self.order, kind=kind, module=module, call=call, tensor=tensor,
                            value=value, sample=self._sample_of(module))
            self.order += 1
        except OSError as exc:  # a full disk: stop recording, leave the run alone
            self.failed = f"{type(exc).__name__}: {exc}"
            self.writer.meta["error"] = self.failed
            log.logger().error(f"devshim compare: recording stopped at step {self.step}: {self.failed}; the run "
                               "goes on unrecorded and the comparison will say the dump is incomplete")
            self.writer.close(complete=False)

    def _name(self, module: torch.nn.Module) -> str:
        name = self._names.get(module)
        if name is not None:
            return name
        if not self._stack:
            base = type(module).__name__
            seen = self._roots.get(base, 0)
            self._roots[base] = seen + 1
            name = base if seen == 0 else f"{base}#{seen}"
            for path, sub in module.named_modules():  # every module it owns, by its path (ModuleLists included)
                self._names.setdefault(sub, f"{name}.{path}" if path else name)
            self._hook_parameters(module, name)
            return self._names[module]
        # a module its caller does not own (a loss, a helper built on the fly)
        name = f"{self._names[self._stack[-1]]}/{type(module).__name__}"
        self._names[module] = name
        return name

    def _hook_parameters(self, root: torch.nn.Module, root_name: str) -> None:
        for name, param in root.named_parameters():
            if param in self._param_names:
                continue
            self._param_names[param] = f"{root_name}.{name}"
            if param.numel():  # the weights the run starts from: two runs that differ here differ everywhere
                with torch.no_grad():
                    self._add("init_param", f"{root_name}.{name}", 0, ".", param)
            if param.requires_grad:
                param.register_hook(self._param_grad_hook(param, f"{root_name}.{name}"))

    def _grad_hook(self, kind: str, module: str, call: int, tensor: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if grad is not None and grad.is_floating_point() and grad.numel():
                self._add(kind, module, call, tensor, grad)
        return hook

    def _param_grad_hook(self, param: torch.Tensor, name: str) -> Any:
        """A parameter's gradient, once per backward that reaches it (micro-batches of one step are told apart by
        their call number). Megatron's fused gradient accumulation adds the gradient to ``main_grad`` itself and
        hands autograd an uninitialised placeholder: such a parameter's gradient is recorded where the optimizer
        reads it (``optimizer_grad``), not here."""
        key = f"\0{name}"

        def hook(grad: torch.Tensor) -> None:
            if grad is None or not grad.is_floating_point() or not grad.numel() or hasattr(param, "main_grad"):
                return
            call = self._calls.get(key, -1) + 1
            self._calls[key] = call
            self._add("grad_param", name, call, ".", grad)
        return hook

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self.steps and self.step >= self.steps and not self._stack:
            self._stop()
        name = self._name(module)
        self._stack.append(module)
        self._calls[name] = self._calls.get(name, -1) + 1

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._stack and self._stack[-1] is module:
            self._stack.pop()
        name = self._names.get(module)
        if name is None:
            return
        call = self._calls.get(name, 0)
        for path, tensor in _tensors(output):
            self._add("forward", name, call, path, tensor)
            if tensor.requires_grad:
                tensor.register_hook(self._grad_hook("grad_output", name, call, path))

    def _optimizer_tensors(self, optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
        kind = type(optimizer).__name__
        for g, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                yield self._param_names.get(param) or f"{kind}.group{g}.param{i}", param

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_depth += 1
        if self._optimizer_depth == 1:
            for name, param in self._optimizer_tensors(optimizer):
                if param.grad is not None and param.grad.numel():
                    self._add("optimizer_grad", name, 0, ".", param.grad)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_depth -= 1
        if self._optimizer_depth:
            return
        with torch.no_grad():
            for name, param in self._optimizer_tensors(optimizer):
                if param.numel():
                    self._add("param", name, 0, ".", param)
        self.step += 1
        self.order = 0
        self._calls.clear()
        if self.failed is None:
            self.writer.step_done(self.step)

    def _stop(self) -> None:
        """The N-th step is done: close the dump, meet the other ranks, leave."""
        self.writer.meta["stopped"] = f"after {self.step} steps (DEVSHIM_COMPARE_STEPS={self.steps})"
        self.close()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def from_environment(environ: Mapping[str, str], meta: dict[str, Any]) -> Recorder | None:
    """The recorder ``DEVSHIM_COMPARE_*`` asks for (rank directory from ``RANK``), or ``None`` when unset."""
    directory = environ.get(DIR, "").strip()
    if not directory:
        return None
    rank = environ.get("RANK", "0").strip() or "0"
    full = tuple(p.strip() for p in environ.get(FULL, "").split(",") if p.strip())
    return Recorder(Path(directory) / f"rank{rank}", steps=_count(environ, STEPS, 0, 0),
                    sample=_count(environ, SAMPLE, DEFAULT_SAMPLE, 1), full=full,
                    meta=dict(meta, rank=int(rank) if rank.isdigit() else rank,
                              world_size=environ.get("WORLD_SIZE", "1"), argv=list(sys.argv)))
