"""Counting what a piece of engine code asks of the device, on any device: the ATen ops it launches and
the host syncs among them (the points where the host waits to read device data).

    with OpCounter() as ops:
        engine.verify(...)
    ops.ops, ops.syncs, ops.sync_ops    # total ops, host syncs, {op name: count} of the syncs

A host sync is an op whose result the host must read before going on: `.item()` / `int(t)` / `bool(t)`
(aten._local_scalar_dense), boolean-mask indexing and `nonzero` (the output's size is data-dependent),
a copy from an accelerator to the CPU (`.cpu()`), and `.tolist()` / `.numpy()` (counted by hand: on a
CPU they read memory without an op). On a CPU none of them waits for
anything, but they are the same ops that stall a GPU, so counting them on a CPU tells what a GPU would
do. Counted with a TorchDispatchMode: every op that reaches ATen is seen, including those inside
transformers' modules; a compiled region counts as the ops its graph launches at dispatch (a CUDA
graph replay counts as none).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops whose output size or value the host needs before it can go on
DATA_DEPENDENT = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item",
                  "repeat_interleave"}
# ops that are views or metadata only: no kernel is launched for them
NO_KERNEL = {"view", "_unsafe_view", "expand", "as_strided", "t", "transpose", "permute", "unsqueeze", "squeeze",
             "slice", "select", "alias", "detach", "split", "chunk", "unbind", "reshape", "lift_fresh",
             "_reshape_alias", "diagonal", "narrow", "split_with_sizes", "view_as", "expand_as"}


def _name(func) -> str:
    return func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)


class OpCounter(TorchDispatchMode):
    """ops: kernels launched (views excluded); syncs: host syncs; sync_ops / op_names: counts by name."""

    def __init__(self):
        super().__init__()
        self.op_names: Counter[str] = Counter()
        self.sync_ops: Counter[str] = Counter()

    @property
    def ops(self) -> int:
        return sum(self.op_names.values())

    @property
    def syncs(self) -> int:
        return sum(self.sync_ops.values())

    def __enter__(self):
        # .tolist() and .numpy() of a CPU tensor read its memory without an op: count them by hand
        self._saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, self._counting(name, method))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def _counting(self, name: str, method):
        def counted(tensor, *args, **kwargs):
            if tensor.device.type == "cpu":  # an accelerator's tensor shows as its copy to the CPU
                self.sync_ops[name] += 1
            return method(tensor, *args, **kwargs)

        return counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name not in NO_KERNEL:
            self.op_names[name] += 1
        if name in DATA_DEPENDENT or (name == "index" and _has_bool_index(args)):
            self.sync_ops[name] += 1
        elif _to_host(name, args, kwargs):
            self.sync_ops[f"{name} to cpu"] += 1
        return func(*args, **kwargs)


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
