"""The tensor dtypes Tandem computes in and sends, in one table: every other list is read from it.

    name       the spelling everywhere: config and CLI choices, `tandem.v1.Tensor.dtype`, `FeatureRef.dtype`
    itemsize   bytes per element (the wire's size check, the traffic counters)
    code       its number in the nccl header [sequence, rows, width, code]

The torch dtype is looked up on demand (`TensorDtype.torch`, `TORCH_DTYPES`): this module imports no
torch, so the coordinator and the config can read the table.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorDtype:
    name: str
    itemsize: int
    code: int

    @property
    def torch(self) -> torch.dtype:
        import torch

        return getattr(torch, self.name)


# float32 first: the default of every service and command
DTYPES: dict[str, TensorDtype] = {
    d.name: d
    for d in (
        TensorDtype("float32", itemsize=4, code=0),
        TensorDtype("bfloat16", itemsize=2, code=1),
        TensorDtype("float16", itemsize=2, code=2),
    )
}
DTYPE_NAMES = tuple(DTYPES)
ITEMSIZE = {name: d.itemsize for name, d in DTYPES.items()}
BY_CODE = {d.code: d for d in DTYPES.values()}


class _TorchDtypes(Mapping):
    """name -> torch.dtype, importing torch at the first lookup; KeyError for a name not in the table."""

    def __getitem__(self, name: str) -> torch.dtype:
        return DTYPES[name].torch

    def __iter__(self) -> Iterator[str]:
        return iter(DTYPE_NAMES)

    def __len__(self) -> int:
        return len(DTYPE_NAMES)


TORCH_DTYPES: Mapping[str, torch.dtype] = _TorchDtypes()


def name_of(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (whether or not the table has it)."""
    return str(dtype).removeprefix("torch.")
