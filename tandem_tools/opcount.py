"""Counting what a piece of engine code asks of the device, on any device: the ATen ops it launches and
the host syncs among them (the points where the host waits for the device).

    with OpCounter() as ops:
        engine.verify(...)
    ops.ops, ops.syncs, ops.sync_ops    # total ops, host syncs, {kind: count} of the syncs
    ops.uploads, ops.reads              # the syncs that are uploads, and the others

Host syncs of every kind are counted, the same on a CPU as on a GPU, by what the code asks for rather than by
what the CPU does (on a CPU none of them waits, and most are no ops at all):

  reads      `.item()`, `int(t)`, `bool(t)`, `.tolist()`, `.numpy()`, `.cpu()` of a device tensor, and a copy
             into a host tensor (`host.copy_(device)`); on a GPU also `_to_copy` to the CPU
  uploads    `.to(device)`, `.cuda()`, `device.copy_(host)` of a host tensor, unless non_blocking from pinned
             memory (on a machine without CUDA nothing can be pinned: a non_blocking upload counts as one from
             pinned memory, as the same code pins where CUDA is); `torch.tensor(data, device=...)` always
             (torch stages the data in pageable memory and waits for the copy)
  sizes      ops whose output size the host needs: `nonzero`, `masked_select`, boolean-mask indexing, ...
  waits      `torch.cuda.synchronize()`, `Event.synchronize()`, `Stream.synchronize()`

A host tensor is one the code made from host data inside the counted region: `torch.tensor`, `from_numpy`,
a factory given no device, `pin_memory()`, `.cpu()`, and what ops make of host tensors alone. Every other
tensor (the model's weights, the KV pool, whatever a factory made with `device=`, an upload's result) is
a device tensor, also on a CPU. Counted with a TorchFunctionMode, which sees each call with its Python
arguments before it reaches ATen (`.to(cpu)` on a CPU never does), over a TorchDispatchMode that sees every
op that reaches ATen, those inside transformers' modules too. A compiled region counts as the ops its graph
launches at dispatch (a CUDA graph replay counts as none).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

# ops whose output size or value the host needs before it can go on
DATA_DEPENDENT = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item",
                  "repeat_interleave"}
# ops that are views or metadata only: no kernel is launched for them
NO_KERNEL = {"view", "_unsafe_view", "expand", "as_strided", "t", "transpose", "permute", "unsqueeze", "squeeze",
             "slice", "select", "alias", "detach", "split", "chunk", "unbind", "reshape", "lift_fresh",
             "_reshape_alias", "diagonal", "narrow", "split_with_sizes", "view_as", "expand_as"}
READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"}
FROM_DATA = {"tensor", "as_tensor"}
UPLOADS = {"to from pageable memory", "cuda from pageable memory", "copy_ from pageable memory",
           "tensor(data, device=)", "as_tensor(data, device=)"}
WAITS = ((torch.cuda, "synchronize", "cuda.synchronize"), (torch.cuda.Event, "synchronize", "Event.synchronize"),
         (torch.cuda.Stream, "synchronize", "Stream.synchronize"))


def _name(func) -> str:
    if hasattr(func, "overloadpacket"):
        return func.overloadpacket.__name__
    return getattr(func, "__name__", str(func))


def _tensors(args, kwargs) -> list[torch.Tensor]:
    found = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    for a in args:
        if isinstance(a, (list, tuple)):
            found += [t for t in a if isinstance(t, torch.Tensor)]
    return found


def _pinned(src: torch.Tensor, non_blocking: bool) -> bool:
    """Whether an upload of `src` leaves the host free: non_blocking from pinned memory."""
    return non_blocking and (not torch.cuda.is_available() or src.is_pinned())


class _Calls(TorchFunctionMode):
    """The function-level half of OpCounter: host tensors tagged, reads and uploads counted."""

    def __init__(self, counter: OpCounter):
        super().__init__()
        self.counter = counter
        self.host = WeakTensorKeyDictionary()
        self.read = WeakTensorKeyDictionary()  # device tensors `.cpu()` returned as they are (on a CPU): read once

    def is_host(self, t: torch.Tensor) -> bool:
        return t in self.host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        inputs = _tensors(args, kwargs)
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        sync = None
        if name in READS and src is not None:
            sync = None if self.is_host(src) or src in self.read else name
        elif name in ("to", "cuda") and src is not None and self.is_host(src) and self._moves(name, args, kwargs):
            if not _pinned(src, bool(kwargs.get("non_blocking", False))):
                sync = f"{name} from pageable memory"
        elif name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            dst, source = args[0], args[1]
            if self.is_host(dst) and not self.is_host(source):
                sync = "copy_ to the host"
            elif not self.is_host(dst) and self.is_host(source):
                non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
                sync = None if _pinned(source, non_blocking) else "copy_ from pageable memory"
        elif name in FROM_DATA and kwargs.get("device") is not None and not (
                args and isinstance(args[0], torch.Tensor) and not self.is_host(args[0])):
            sync = f"{name}(data, device=)"
        if sync is not None:
            self.counter.sync_ops[sync] += 1
        quiet = name in READS or sync is not None or name in FROM_DATA
        self.counter._quiet += quiet  # the ops under a call counted here (or a host read) are not counted again
        try:
            out = func(*args, **kwargs)
        finally:
            self.counter._quiet -= quiet
        moves = name in ("to", "cuda") and self._moves(name, args, kwargs)
        self._tag(name, out, inputs, kwargs, moves)
        return out

    @staticmethod
    def _moves(name: str, args, kwargs) -> bool:
        """Whether `.to(...)` names a device (not a dtype alone)."""
        if name == "cuda":
            return True
        if "device" in kwargs:
            return True
        return any(isinstance(a, (str, torch.device)) for a in args[1:])

    def _tag(self, name: str, out, inputs: list[torch.Tensor], kwargs, moves: bool) -> None:
        """Marks `out` a host tensor or not (an upload's result is the device's, also where it is `self`)."""
        outs = [t for t in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(t, torch.Tensor)]
        if not outs:
            return
        if name == "cpu" and outs[0] is (inputs[0] if inputs else None):
            self.read[outs[0]] = True  # still the device's tensor for the ops that use it
            return
        if moves:
            host = False
        elif name in ("cpu", "pin_memory"):
            host = True
        elif name in FROM_DATA or not inputs:
            host = kwargs.get("device") is None
        else:
            host = all(self.is_host(t) for t in inputs)
        for t in outs:
            if host:
                self.host[t] = True
            else:
                self.host.pop(t, None)


class OpCounter(TorchDispatchMode):
    """ops: kernels launched (views excluded); syncs: host syncs; sync_ops / op_names: counts by name."""

    def __init__(self):
        super().__init__()
        self.op_names: Counter[str] = Counter()
        self.sync_ops: Counter[str] = Counter()
        self._quiet = 0
        self._calls = _Calls(self)

    @property
    def ops(self) -> int:
        return sum(self.op_names.values())

    @property
    def syncs(self) -> int:
        return sum(self.sync_ops.values())

    @property
    def uploads(self) -> int:
        """The syncs that are copies to the device from pageable memory (or blocking ones)."""
        return sum(n for kind, n in self.sync_ops.items() if kind in UPLOADS)

    @property
    def reads(self) -> int:
        """The syncs but the uploads: reads of device data, data-dependent sizes, waits."""
        return self.syncs - self.uploads

    def __enter__(self):
        self._saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in WAITS]
        for (owner, attr, kind), (_, _, method) in zip(WAITS, self._saved, strict=True):
            setattr(owner, attr, self._waiting(kind, method))
        self._from_numpy = torch.from_numpy
        torch.from_numpy = self._numpy_made
        self._calls.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._calls.__exit__(*exc)
            torch.from_numpy = self._from_numpy
            for owner, attr, method in self._saved:
                setattr(owner, attr, method)

    def _waiting(self, kind: str, method):
        def counted(*args, **kwargs):
            self.sync_ops[kind] += 1
            return method(*args, **kwargs)

        return counted

    def _numpy_made(self, array):
        t = self._from_numpy(array)
        self._calls.host[t] = True
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name not in NO_KERNEL:
            self.op_names[name] += 1
        if self._quiet or _all_host(self._calls, args, kwargs):
            pass
        elif name in DATA_DEPENDENT or (name == "index" and _has_bool_index(args)):
            self.sync_ops[name] += 1
        elif _to_host(name, args, kwargs):
            self.sync_ops[f"{name} to cpu"] += 1
        return func(*args, **kwargs)


def _all_host(calls: _Calls, args, kwargs) -> bool:
    tensors = _tensors(args, kwargs)
    return bool(tensors) and all(calls.is_host(t) for t in tensors)


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _to_host(name: str, args, kwargs) -> bool:
    """A copy from an accelerator to the CPU: `_to_copy(src, device=cpu)` or `dst.copy_(src)`."""
    if name == "_to_copy" and args:
        src, dst = args[0], kwargs.get("device")
    elif name == "copy_" and len(args) > 1:
        src, dst = args[1], args[0].device
    else:
        return False
    return (isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst is not None
            and torch.device(dst).type == "cpu")
