"""A ZeRO gradient partition as PowerSGD's matrices: which elements form which matrix.

PowerSGD compresses a gradient *matrix* (Vogels, Karimireddy, Jaggi,
"PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019); PyTorch's ``powerSGD_hook`` views each
parameter's gradient as ``(shape[0], numel / shape[0])``. A ZeRO partition is
a flat slice of the concatenated parameters cut at arbitrary offsets, so a
rank holds *fragments*: ZeRO-1/2 hold whole parameters plus at most a tail
of the parameter straddling the partition start and a head of the one
straddling its end; ZeRO-3 holds ``1/group_size`` of every parameter.

Mapping (this module):

* a fragment of a parameter with ``ndim >= 2`` and ``cols = numel / shape[0]``
  covers elements ``[a, b)`` of the parameter. Its **whole rows**
  ``ceil(a / cols) .. floor(b / cols)`` form a ``rows x cols`` matrix, a
  contiguous view of the partition (no copy), compressed when PyTorch's test
  ``(rows + cols) * r * min_compression_rate < rows * cols`` holds;
* the partial row before and after them (fewer than ``cols`` elements each)
  and every fragment of a 1-D parameter (biases, norms) are sent uncompressed;
* alignment padding is not sent at all (it is zero on every replica).

Cost: at most ``2 * cols`` uncompressed elements per cut parameter. ZeRO-1/2
cut at most two parameters per partition; ZeRO-3 cuts every parameter into
``group_size`` fragments, so its uncompressed share grows with the group size
(each fragment also has fewer rows: PowerSGD's saving ``rows*cols / ((rows+cols)*r)``
drops when ``rows`` is small, and the compression test then falls back to
uncompressed). ``batched_power_sgd`` needs no layout: it compresses the whole
partition as one square matrix (PyTorch's ``batched_powerSGD_hook``), cheaper
to run but a worse approximation.

The layout (:class:`ftbridge.zero.layout.PartitionLayout`) is read once from DeepSpeed's own
bookkeeping by the ZeRO adapter; this module only computes with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

from ftbridge.zero.layout import Fragment, PartitionLayout


@dataclass(frozen=True)
class Matrix:
    """A ``rows x cols`` matrix stored contiguously at ``offset`` of the flat partition."""

    offset: int
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def split(layout: PartitionLayout, rank: int,
          min_compression_rate: float) -> Tuple[List[Matrix], List[Tuple[int, int]]]:
    """PowerSGD's view of ``layout``: matrices to compress and ``(offset, numel)`` spans to send uncompressed.

    Args:
        rank: PowerSGD's ``matrix_approximation_rank``.
        min_compression_rate: compress a matrix only if it shrinks at least this much.

    Returns:
        ``(matrices, plain_spans)``; elements in neither are padding.
    """
    matrices: List[Matrix] = []
    plain: List[Tuple[int, int]] = []
    for f in layout.fragments:
        m, spans = _split_fragment(f, rank, min_compression_rate)
        if m is not None:
            matrices.append(m)
        plain.extend(spans)
    return matrices, _merge(plain)


def _split_fragment(f: Fragment, rank: int, min_rate: float) -> Tuple[Any, List[Tuple[int, int]]]:
    if f.numel <= 0:
        return None, []
    if len(f.shape) < 2 or f.shape[0] == 0:
        return None, [(f.offset, f.numel)]
    cols = math.prod(f.shape) // f.shape[0]
    first_row = -(-f.param_start // cols)
    end_row = (f.param_start + f.numel) // cols
    rows = end_row - first_row
    if rows <= 0 or not should_compress(rows, cols, rank, min_rate):
        return None, [(f.offset, f.numel)]
    head = first_row * cols - f.param_start
    body = rows * cols
    spans = [(f.offset, head)] if head else []
    tail = f.numel - head - body
    if tail:
        spans.append((f.offset + head + body, tail))
    return Matrix(f.offset + head, rows, cols), spans


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """PyTorch's test: ``(rows + cols) * r * min_compression_rate < rows * cols``, ``r = min(rows, cols, rank)``."""
    r = min(rows, cols, rank)
    return (rows + cols) * r * min_compression_rate < rows * cols


def _merge(spans: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for off, n in sorted(spans):
        if n <= 0:
            continue
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return out
