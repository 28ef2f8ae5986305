"""Record this rank's communication calls while real code runs: the traces ``comm_order.replay`` checks.

``record_communication()`` replaces, for the duration of a ``with`` block, the functions of
``torch.distributed`` (collectives, point-to-point, ``batch_isend_irecv``; also in ``distributed_c10d``,
where ``P2POp`` and ``batch_isend_irecv`` look up ``isend``/``irecv``), the functional collectives DTensor
calls (``torch.distributed._functional_collectives``) and ``Work.wait``. Each call becomes a ``Call`` with
its process group as a ``Comm`` (global ranks from ``dist.get_process_group_ranks``, and the group's name,
which tells apart groups with the same members), the peer and shape of each message, or what the members
of a collective must agree on; each ``wait()`` on a recorded call's Work becomes a ``Wait``.

A call that returns no Work has waited already (``async_op=False``, ``send``/``recv``): a ``Wait`` follows it
at once. So does a functional collective, whose wait really comes at the result's first use: waiting earlier
only adds order, so a replay that completes still completes. Only the outermost call counts: the isends of a
batch belong to the batch, the broadcasts inside ``broadcast_object_list`` to it.

Code that bound a function before recording started (``from torch.distributed import all_reduce``) is not
seen; this project and FSDP2 call through the module, and tests assert that the calls they expect appear.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from lightning_sppo.parallel.comm_order import Call, Comm, Message, Trace, Wait

__all__ = ["gather_traces", "record_communication"]

_P2P = {"isend": True, "irecv": False, "send": True, "recv": False}
"""Point-to-point functions: name -> whether it sends."""

_COLLECTIVES: dict[str, tuple[str, str | None]] = {
    # name -> (NCCL's primitive, the argument holding what this rank contributes: members agree on its size)
    "all_reduce": ("all_reduce", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors"),
    "reduce": ("reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "all_gather": ("all_gather", "tensor"),
    "all_gather_into_tensor": ("all_gather", "input_tensor"),
    "all_gather_single": ("all_gather", "input_tensor"),
    "all_gather_coalesced": ("all_gather", "input_tensor_list"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "all_to_all_single": ("all_to_all", None),  # split sizes may differ per rank
    "all_to_all": ("all_to_all", None),
    "gather": ("gather", "tensor"),
    "scatter": ("scatter", None),
    "barrier": ("barrier", None),
    "broadcast_object_list": ("broadcast_object", None),  # sizes are only known to the source
    "all_gather_object": ("all_gather_object", None),
    "gather_object": ("gather_object", None),
    "scatter_object_list": ("scatter_object", None),
}

_FUNCTIONAL: dict[str, tuple[str, str | None]] = {
    # torch.distributed._functional_collectives (DTensor's redistributions), same meaning
    "all_reduce": ("all_reduce", "self"),
    "all_reduce_coalesced": ("all_reduce", "self"),
    "broadcast": ("broadcast", "self"),
    "all_gather_tensor": ("all_gather", "self"),
    "all_gather_tensor_autograd": ("all_gather", "self"),
    "all_gather_single": ("all_gather", "self"),
    "all_gather_single_autograd": ("all_gather", "self"),
    "all_gather_into_tensor_coalesced": ("all_gather", "self"),
    "reduce_scatter_tensor": ("reduce_scatter", "self"),
    "reduce_scatter_tensor_autograd": ("reduce_scatter", "self"),
    "reduce_scatter_single": ("reduce_scatter", "self"),
    "reduce_scatter_single_autograd": ("reduce_scatter", "self"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "all_to_all_single": ("all_to_all", None),
    "all_to_all_single_autograd": ("all_to_all", None),
}

_ROOTS = ("src", "dst", "group_src", "group_dst")
_Resolve = Callable[[Any], dist.ProcessGroup]  # a call's ``group`` argument -> the process group it means
_SKIP_FRAMES = (str(Path(torch.__file__).parent) + os.sep, __file__)  # call sites: the first frame outside these


@contextmanager
def record_communication() -> Iterator[Trace]:
    """``with record_communication() as trace:`` -- ``trace`` fills with this rank's calls and waits."""
    recorder = _Recorder()
    with recorder.installed():
        yield recorder.trace


def gather_traces(trace: Trace) -> list[Trace]:
    """Every rank's trace, on every rank (a collective: call it after recording, on all ranks)."""
    traces: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(traces, trace)
    return traces


class _Recorder:
    def __init__(self) -> None:
        self.trace: Trace = []
        self._works: dict[int, tuple[int, dist.Work]] = {}  # id(work) -> (call position, work kept alive)
        self._comms: dict[int, tuple[Comm, dist.ProcessGroup]] = {}  # id(group) -> its Comm
        self._names: dict[str, Comm] = {}
        self._depth = threading.local()

    @contextmanager
    def installed(self) -> Iterator[None]:
        # One wrapper per function, set on both modules: P2POp accepts only the isend/irecv c10d holds.
        wrappers = {name: self._wrap(getattr(c10d, name), functools.partial(self._p2p, name, sends))
                    for name, sends in _P2P.items()}  # fmt: skip
        wrappers["batch_isend_irecv"] = self._wrap(c10d.batch_isend_irecv, self._batch)
        wrappers |= self._wrappers(c10d, _COLLECTIVES, self._pg)
        replaced = [(module, name, wrapper) for module in (dist, c10d) for name, wrapper in wrappers.items()]
        replaced += [
            (funcol, name, wrapper) for name, wrapper in self._wrappers(funcol, _FUNCTIONAL, _functional_group).items()
        ]
        replaced.append((dist.Work, "wait", self._wait_wrapper(dist.Work.wait)))
        originals = [(owner, name, getattr(owner, name)) for owner, name, _ in replaced]
        for owner, name, wrapper in replaced:
            setattr(owner, name, wrapper)
        try:
            yield
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)

    def _wrappers(
        self, source: ModuleType, table: dict[str, tuple[str, str | None]], resolve: _Resolve
    ) -> dict[str, Callable]:
        wrappers = {}
        for name, (kind, contributed) in table.items():
            original = getattr(source, name, None)
            if original is not None:  # not every torch version has every function
                wrappers[name] = self._wrap(original, functools.partial(self._collective, kind, contributed, resolve))
        return wrappers

    # -- wrappers ---------------------------------------------------------------------------------

    def _wrap(self, original: Callable, describe: Callable[[inspect.BoundArguments], Call]) -> Callable:
        """``original``, recording its outermost calls as ``describe`` says."""
        signature = inspect.signature(original)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            depth = getattr(self._depth, "value", 0)
            if depth:
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            call = describe(bound)
            self._depth.value = 1
            try:
                result = original(*args, **kwargs)
            finally:
                self._depth.value = 0
            self._record(call, result)
            return result

        return recorded

    def _record(self, call: Call, result: Any) -> None:
        position = len(self.trace)
        self.trace.append(call)
        works = result if isinstance(result, list) else [result]
        if call.kind in ("send", "recv") or not all(isinstance(work, dist.Work) for work in works):
            self.trace.append(Wait(position))  # it waited already
            return
        for work in works:
            self._works[id(work)] = (position, work)

    def _wait_wrapper(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def wait(work: dist.Work, *args, **kwargs):
            known = self._works.get(id(work))
            if known is not None and known[1] is work:
                self.trace.append(Wait(known[0]))
            return original(work, *args, **kwargs)

        return wait

    # -- what a call is ---------------------------------------------------------------------------

    def _p2p(self, name: str, sends: bool, bound: inspect.BoundArguments) -> Call:
        args = bound.arguments
        group = args.get("group")
        peer = args.get("dst" if sends else "src")
        group_peer = args.get("group_dst" if sends else "group_src")
        if peer is None and group_peer is not None:
            peer = dist.get_global_rank(self._pg(group), group_peer)
        if peer is None:
            raise NotImplementedError(f"{name} from any source: the NCCL replay needs to know the peer.")
        return Call(name, self._group(group), (_message(sends, peer, args["tensor"]),), site=_site())

    def _batch(self, bound: inspect.BoundArguments) -> Call:
        ops = bound.arguments["p2p_op_list"]
        messages = tuple(_message(op.op.__name__ == "isend", op.peer, op.tensor) for op in ops)
        return Call("batch_isend_irecv", self._group(ops[0].group), messages, site=_site())

    def _collective(self, kind: str, contributed: str | None, resolve: _Resolve, bound: inspect.BoundArguments) -> Call:
        args = bound.arguments
        group = resolve(args.get("group"))
        comm = self._group(group)
        agree: dict[str, object] = {}
        for name in _ROOTS:
            if args.get(name) is not None:
                agree["root"] = dist.get_global_rank(group, args[name]) if name.startswith("group_") else args[name]
        if contributed is not None:
            tensors = args[contributed]
            tensors = tensors if isinstance(tensors, list | tuple) else [tensors]
            agree["numel"] = sum(t.numel() for t in tensors)
            agree["dtype"] = str(tensors[0].dtype).removeprefix("torch.") if tensors else ""
        return Call(kind, comm, agree=tuple(sorted(agree.items())), site=_site())

    def _pg(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
        return group if group is not None else dist.group.WORLD

    def _group(self, group: dist.ProcessGroup | None) -> Comm:
        pg = self._pg(group)
        known = self._comms.get(id(pg))
        if known is None:
            desc = getattr(pg, "group_desc", "")
            comm = Comm(tuple(dist.get_process_group_ranks(pg)), pg.group_name, "" if desc == "undefined" else desc)
            if self._names.setdefault(comm.name, comm) != comm:
                raise RuntimeError(f"Two process groups are named {comm.name!r}: {self._names[comm.name]} and {comm}.")
            known = self._comms[id(pg)] = (comm, pg)  # keeps pg alive: its id stays its own
        return known[0]


def _functional_group(group: Any) -> dist.ProcessGroup:
    """The process group behind a functional collective's ``group`` (a group, a mesh, (mesh, dim) or a name)."""
    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, DeviceMesh):
        return group.get_group()
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return group[0].get_group(group[1])
    return c10d._resolve_process_group(funcol._resolve_group_name(group))


def _message(sends: bool, peer: int, tensor: torch.Tensor) -> Message:
    return Message(sends, peer, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))


def _site() -> str:
    """``file:line function`` of the first caller outside torch and this module (else outside this module)."""
    frame, fallback = sys._getframe(2), None
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_SKIP_FRAMES):
            return _where(frame)
        if fallback is None and name != __file__ and "distributed_c10d" not in name:
            fallback = frame
        frame = frame.f_back
    return _where(fallback) if fallback is not None else ""


def _where(frame) -> str:
    """The frame's file relative to the import root it came from (``lightning_sppo/...``, ``torch/...``)."""
    path = frame.f_code.co_filename
    roots = [
        root.rstrip(os.sep) + os.sep for root in sys.path if root and path.startswith(root.rstrip(os.sep) + os.sep)
    ]
    if roots:
        path = path[len(max(roots, key=len)) :]
    return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"
