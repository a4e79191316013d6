"""The tensor wire codec: torch tensors <-> `tandem.v1.Tensor` / chunked `tandem.v1.Features`.

A Tensor message is a dtype name, a shape and the raw little-endian bytes in row-major order, so
encoding is one copy and decoding is one copy into a preallocated tensor. Features of a step
[n, 3H] are cut into chunks of whole rows of at most `chunk_bytes` each: a 4096-token prefill of an
8B target in bf16 is 96 MiB, far past any sensible gRPC message limit, and chunks also let the
coordinator forward the first rows to the draft while later ones are still arriving.

torch is imported inside the functions that need it: the coordinator uses this module only for
the torch-free chunk bookkeeping (`is_last_chunk`) and never decodes a feature.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

from tandem.dtypes import DTYPES, ITEMSIZE, TensorDtype, name_of
from tandem.v1 import common_pb2

if TYPE_CHECKING:
    import torch

# 2 MiB chunks: well under the 16 MiB message limit the services set, and small enough that a
# relay holds little at a time; per-message overhead is negligible at this size.
DEFAULT_CHUNK_BYTES = 2 << 20

if sys.byteorder != "little":  # the raw bytes are little-endian; every supported host is
    raise ImportError("tandem.wire assumes a little-endian host")


class WireError(ValueError):
    """A tensor message that does not describe a tensor (bad dtype, size, or chunk order)."""


def _torch_dtype(name: str) -> torch.dtype:
    return _known(name).torch


def _dtype_name(dtype: torch.dtype) -> str:
    return _known(name_of(dtype)).name


def _known(name: str) -> TensorDtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise WireError(f"unsupported tensor dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def _raw_bytes(t: torch.Tensor) -> bytes:
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def encode_tensor(t: torch.Tensor) -> common_pb2.Tensor:
    return common_pb2.Tensor(dtype=_dtype_name(t.dtype), shape=list(t.shape), data=_raw_bytes(t))


def decode_tensor(msg: common_pb2.Tensor) -> torch.Tensor:
    import torch

    dtype = _torch_dtype(msg.dtype)
    shape = list(msg.shape)
    _check_size(msg, shape)
    out = torch.empty(shape, dtype=dtype)
    _copy_into(out, msg.data)
    return out


def _check_size(msg: common_pb2.Tensor, shape: list[int]) -> None:
    if any(d < 0 for d in shape):
        raise WireError(f"negative dimension in tensor shape {shape}")
    expected = math.prod(shape) * ITEMSIZE[msg.dtype]
    if len(msg.data) != expected:
        raise WireError(f"a {msg.dtype} tensor of shape {shape} needs {expected} bytes, got {len(msg.data)}")


def _copy_into(out: torch.Tensor, data: bytes) -> None:
    import numpy as np
    import torch

    if out.numel():
        # numpy assignment reads the immutable bytes without the copy torch.frombuffer would warn about
        out.view(-1).view(torch.uint8).numpy()[:] = np.frombuffer(data, dtype=np.uint8)


# -- features: rows of [n, 3H], chunked ---------------------------------------------------------


def encode_features(features: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[common_pb2.Features]:
    """features [n, C] -> messages of whole rows, each with at most `chunk_bytes` of data (at least one row)."""
    if features.dim() != 2:
        raise WireError(f"features must be [rows, width], got shape {list(features.shape)}")
    features = features.detach().cpu().contiguous()
    n = features.shape[0]
    row_bytes = features.shape[1] * features.element_size()
    rows_per_chunk = max(1, chunk_bytes // max(row_bytes, 1))
    chunks = []
    for start in range(0, max(n, 1), rows_per_chunk):
        rows = features[start : start + rows_per_chunk]
        chunks.append(
            common_pb2.Features(
                tensor=encode_tensor(rows), row_offset=start, num_rows=rows.shape[0], total_rows=n
            )
        )
    return chunks


def is_last_chunk(chunk: common_pb2.Features) -> bool:
    """Whether this chunk completes its step's features (torch-free: the coordinator relays with it)."""
    return chunk.row_offset + chunk.num_rows >= chunk.total_rows


class FeatureAssembler:
    """Collects the chunks of one step into one tensor [total_rows, C], copying each chunk once."""

    def __init__(self) -> None:
        self._out: torch.Tensor | None = None
        self._rows = 0

    @property
    def started(self) -> bool:
        return self._out is not None

    def add(
        self, chunk: common_pb2.Features, rows: int | None = None, width: int | None = None
    ) -> torch.Tensor | None:
        """Add the next chunk; returns the whole tensor when this chunk completes it, else None.

        `rows`/`width`, when known, bound the step before anything is allocated: a header claiming
        more rows than the step has tokens is refused, not allocated."""
        import torch

        if chunk.WhichOneof("payload") != "tensor":
            raise WireError(f"feature payload {chunk.WhichOneof('payload')!r} is not supported by the gRPC transport")
        msg = chunk.tensor
        dtype = _torch_dtype(msg.dtype)
        shape = list(msg.shape)
        _check_size(msg, shape)
        if len(shape) != 2 or shape[0] != chunk.num_rows:
            raise WireError(f"a feature chunk of {chunk.num_rows} rows has tensor shape {shape}")
        if chunk.row_offset != self._rows:
            raise WireError(f"feature chunk starts at row {chunk.row_offset}, expected row {self._rows}")
        if self._out is None:
            if chunk.total_rows < chunk.num_rows:
                raise WireError(f"feature chunk of {chunk.num_rows} rows in a step of {chunk.total_rows}")
            if (rows is not None and chunk.total_rows != rows) or (width is not None and shape[1] != width):
                raise WireError(
                    f"features [{chunk.total_rows}, {shape[1]}] do not fit a step of {rows} tokens x {width}"
                )
            self._out = torch.empty((chunk.total_rows, shape[1]), dtype=dtype)
        elif (chunk.total_rows, shape[1], dtype) != (self._out.shape[0], self._out.shape[1], self._out.dtype):
            raise WireError("feature chunks of one step disagree on total rows, width or dtype")
        if chunk.row_offset + chunk.num_rows > chunk.total_rows:
            raise WireError(f"feature chunk rows [{chunk.row_offset}, +{chunk.num_rows}) pass {chunk.total_rows}")
        _copy_into(self._out[self._rows : self._rows + chunk.num_rows], msg.data)
        self._rows += chunk.num_rows
        if self._rows < chunk.total_rows:
            return None
        out, self._out, self._rows = self._out, None, 0
        return out


def decode_features(chunks: Iterable[common_pb2.Features]) -> torch.Tensor:
    """All chunks of one step -> [total_rows, C]."""
    assembler = FeatureAssembler()
    for chunk in chunks:
        out = assembler.add(chunk)
        if out is not None:
            return out
    raise WireError("the feature chunks ended before the step was complete")
