"""Emulated vendor collectives (``hccl``, ``sccl``): a ``torch.distributed`` backend on the emulated device.

The process group runs gloo on zero-copy host aliases of the device tensors (the emulated device memory is
host memory), so gloo reads and writes device memory directly. A :class:`VendorRules` says what a vendor's
library refuses (a CPU tensor, say) and how its own adaptor papers over what it lacks (dtypes it reduces in
another dtype); each vendor's rules are declared in its module of :mod:`devshim_emulation.vendors`, nothing
here knows a vendor.

Every collective runs after the current stream's queued copies (the host aliases wait for them, as a vendor
library's stream waits on the current one) and completes before it returns; the returned ``Work`` is done.
Point-to-point operations return gloo's pending ``Work``, as the vendor's isend/irecv do: a rank posts
its sends and receives before waiting on any of them.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]  # private: not in torch's stubs
from torch.distributed.distributed_c10d import AllgatherOptions  # not re-exported by torch.distributed

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

ReduceOp = dist.ReduceOp


@dataclass(frozen=True)
class VendorRules:
    """What the vendor's collective library accepts, and how its adaptor narrows what it does not."""

    backend: str
    device_type: str
    #: dtypes reduced in another dtype and cast back (vendors/sophgo.py: int64 -> int32, float64 -> float32 ...)
    reduce_casts: dict[torch.dtype, torch.dtype] = field(default_factory=dict)
    #: ``refuses(tensor, what)``: why the library refuses an operand of collective ``what`` (the message of the
    #: RuntimeError raised), or ``None`` when it takes it; without it every tensor is taken (a CPU tensor as is)
    refuses: Callable[[torch.Tensor, str], str | None] | None = None


def _done(result: Any) -> Any:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


class EmulatedProcessGroup(dist.ProcessGroup):
    """A vendor backend's process group on the emulated device, staged through gloo on host aliases."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta, rules: VendorRules,
                 alias: Callable[[torch.Tensor], torch.Tensor], options: Any = None) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # pybind's (rank, size) overload: not in torch's stub
        self._rules = rules
        self._alias = alias
        # Any: torch's stubs declare the collectives on ProcessGroup, not on the Backend that ProcessGroupGloo is
        self._gloo: Any = dist.ProcessGroupGloo(dist.PrefixStore(f"{rules.backend}-emulated", store), rank, size,
                                           timeout)
        self._group_name = ""
        self.options = options  # what init_process_group(pg_options=...) gave, as a vendor backend keeps it

    # -- identity ---------------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return self._rules.backend

    def name(self) -> str:
        return self._rules.backend

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(self._rules.device_type)]

    def _get_backend(self, device: Any) -> EmulatedProcessGroup:  # type: ignore[override]  # is its own Backend
        return self

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> GroupName:
        return cast("GroupName", self._group_name)

    # -- operands ---------------------------------------------------------------------------------
    def _host(self, tensors: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        hosts = []
        for tensor in tensors:
            refused = self._rules.refuses(tensor, what) if self._rules.refuses is not None else None
            if refused is not None:
                raise RuntimeError(refused)
            hosts.append(self._alias(tensor) if tensor.device.type == self._rules.device_type else tensor)
        return hosts

    def _reduce_in(self, host: torch.Tensor) -> tuple[torch.Tensor, Callable[[], object]]:
        """The tensor to reduce, and what to do after: narrow the dtype like the vendor's adaptor does."""
        cast = self._rules.reduce_casts.get(host.dtype)
        if cast is None:
            return host, lambda: None
        narrowed = host.to(cast)
        return narrowed, lambda: host.copy_(narrowed)

    @staticmethod
    def _gloo_op(op: Any) -> tuple[Any, bool]:
        # gloo has no AVG: SUM, then divide
        if op == ReduceOp.AVG:
            return ReduceOp.SUM, True
        return op, False

    # -- collectives ------------------------------------------------------------------------------
    # the ignored [override] errors below: these are the backend's methods, the (tensors, opts) form that torch's C++
    # ProcessGroup dispatches to, not the Python overloads (a single tensor, op=, timeout=) its stubs declare
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]  # backend form: (tensors, opts)
        opts = opts if opts is not None else dist.AllreduceOptions()
        hosts = self._host(tensors, "allreduce")
        op, average = self._gloo_op(opts.reduceOp)
        for host in hosts:
            work_tensor, finish = self._reduce_in(host)
            gloo_opts = dist.AllreduceOptions()
            gloo_opts.reduceOp = op
            self._gloo.allreduce([work_tensor], gloo_opts).wait()
            if average:
                if work_tensor.is_floating_point():
                    work_tensor.div_(self.size())
                else:
                    work_tensor.floor_divide_(self.size())
            finish()
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        options = dist.AllreduceOptions()
        if opts is not None:
            options.reduceOp = opts.reduceOp
        return self.allreduce(tensors, options)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]  # backend form: (tensors, opts)
        hosts = self._host(tensors, "reduce")
        op, average = self._gloo_op(opts.reduceOp)
        for host in hosts:
            work_tensor, finish = self._reduce_in(host)
            gloo_opts = dist.ReduceOptions()
            gloo_opts.reduceOp, gloo_opts.rootRank, gloo_opts.rootTensor = op, opts.rootRank, opts.rootTensor
            self._gloo.reduce([work_tensor], gloo_opts).wait()
            if average and self.rank() == opts.rootRank:
                work_tensor.div_(self.size())
            finish()
        return _done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]  # backend form: (tensors, opts)
        opts = opts if opts is not None else dist.BroadcastOptions()
        self._gloo.broadcast(self._host(tensors, "broadcast"), opts).wait()
        return _done(tensors)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]  # backend form: (tensors, opts)
        opts = opts if opts is not None else AllgatherOptions()
        outs = [self._host(outputs, "allgather") for outputs in output_lists]
        self._gloo.allgather(outs, self._host(inputs, "allgather"), opts).wait()
        return _done(output_lists)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = opts if opts is not None else AllgatherOptions()
        self._gloo._allgather_base(self._host([output], "allgather")[0], self._host([input], "allgather")[0],
                                   opts).wait()
        return _done([output])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._allgather_base(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        for output, input in zip(outputs, inputs, strict=True):
            self._allgather_base(output, input, opts)
        return _done(outputs)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> Any:
        for outputs, input in zip(output_lists, inputs, strict=True):
            self.allgather([outputs], [input], opts)
        return _done(output_lists)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]  # backend form: (tensors, opts)
        outs = [self._host(outputs, "gather") for outputs in output_lists]
        self._gloo.gather(outs, self._host(inputs, "gather"), opts).wait()
        return _done(output_lists)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> Any:  # type: ignore[override]  # backend form: (tensors, opts)
        ins = [self._host(inputs, "scatter") for inputs in input_lists]
        self._gloo.scatter(self._host(outputs, "scatter"), ins, opts).wait()
        return _done(outputs)

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],  # type: ignore[override]  # backend form: (tensors, opts)
                       opts: Any = None) -> Any:
        # gloo has no reduce_scatter: reduce each chunk where it belongs (SUM/AVG, as the vendors support)
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        for output, inputs in zip(outputs, input_lists, strict=True):
            stacked = torch.stack([t.reshape(-1) for t in inputs])
            self._reduce_stacked_into(stacked, output, opts.reduceOp)
        return _done(outputs)

    def _reduce_stacked_into(self, stacked: torch.Tensor, output: torch.Tensor, reduce_op: Any) -> None:
        host = self._host([stacked], "reduce_scatter")[0]
        op, average = self._gloo_op(reduce_op)
        gloo_opts = dist.AllreduceOptions()
        gloo_opts.reduceOp = op
        work_tensor, finish = self._reduce_in(host)
        self._gloo.allreduce([work_tensor], gloo_opts).wait()
        finish()
        mine = stacked[self.rank()].view(output.shape)
        output.copy_(mine / self.size() if average else mine)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        stacked = input.reshape(self.size(), -1).clone()
        self._reduce_stacked_into(stacked, output, opts.reduceOp)
        return _done([output])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        for output, input in zip(outputs, inputs, strict=True):
            self._reduce_scatter_base(output, input, opts)
        return _done(outputs)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllToAllOptions()
        self._gloo.alltoall_base(self._host([output], "alltoall")[0], self._host([input], "alltoall")[0],
                                 output_split_sizes, input_split_sizes, opts).wait()
        return _done([output])

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> Any:
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        # gloo has no list all-to-all: one send/recv exchange per peer
        hosts_out, hosts_in = self._host(outputs, "alltoall"), self._host(inputs, "alltoall")
        rank = self.rank()
        hosts_out[rank].copy_(hosts_in[rank])
        for peer in range(self.size()):
            if peer == rank:
                continue
            if rank < peer:
                self._gloo.send([hosts_in[peer].contiguous()], peer, 0).wait()
                self._gloo.recv([hosts_out[peer]], peer, 0).wait()
            else:
                self._gloo.recv([hosts_out[peer]], peer, 0).wait()
                self._gloo.send([hosts_in[peer].contiguous()], peer, 0).wait()
        return _done(outputs)

    # point-to-point returns gloo's pending work: isend and irecv must both be posted before either can finish
    # (batch_isend_irecv, pipeline exchanges), and gloo writes the received data straight into device memory
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        return self._gloo.send(self._host(tensors, "send"), dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return self._gloo.recv(self._host(tensors, "recv"), src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        return self._gloo.recv_anysource(self._host(tensors, "recv"), tag)

    def barrier(self, opts: Any = None) -> Any:
        self._gloo.barrier(dist.BarrierOptions()).wait()
        return _done([])

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        self._gloo.barrier(dist.BarrierOptions()).wait()

    def shutdown(self) -> None:
        shutdown = getattr(self._gloo, "shutdown", None)
        if shutdown is not None:
            shutdown()


def register_backend(rules: VendorRules, alias: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Register ``rules.backend`` with ``torch.distributed`` for ``rules.device_type`` (idempotent)."""
    if rules.backend.upper() in dist.Backend._plugins:
        return

    def create(backend_options: Any, pg_options: Any) -> EmulatedProcessGroup:
        return EmulatedProcessGroup(backend_options.store, backend_options.group_rank, backend_options.group_size,
                                    backend_options.timeout, rules, alias, options=pg_options)

    dist.Backend.register_backend(rules.backend, create, extended_api=True, devices=[rules.device_type])
