"""A ZeRO gradient partition as PowerSGD's matrices: which elements form which matrix.

PowerSGD (Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019) compresses gradient *matrices*; PyTorch's ``powerSGD_hook`` views a parameter's
gradient as ``(shape[0], numel / shape[0])``. :func:`split` maps each fragment of a
:class:`ftbridge.zero.layout.PartitionLayout`: its whole rows form a contiguous ``rows x cols`` matrix (a view,
no copy), compressed when :func:`should_compress` holds; partial rows, 1-D parameters and matrices that fail the
test are sent uncompressed; padding is not sent (zero on every replica). The mapping and its cost per ZeRO
stage: docs/comm_hooks.md, "PowerSGD on ZeRO partitions".
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
