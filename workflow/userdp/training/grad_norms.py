"""Per-unit gradient norms and clipped gradient sums from layer activations.

The math behind `userdp.training.clipping`. A "unit" is what DP-SGD clips:
one example (ELS) or one user (ULS, all of the user's rows together). For a
parameter used by a layer, the gradient of unit u is a sum over the unit's
tokens t of per-token pieces built from the layer input a_t and the output
gradient g_t; three shapes occur:

- outer, dense: a matrix W (Linear [out, in], GPT-2 Conv1D [in, out], lm_head)
  with grad_u = sum_t row_t (x) col_t, e.g. row = g_t, col = a_t for Linear;
- outer, index: an embedding table [V, d] with row_t = onehot(id_t), col = g_t;
- vector: biases and norm weights, grad_u = sum_t v_t, so only per-row sums
  v_r = sum_{t in r} v_t are kept.

Norms come from one of three exact formulas:

- ghost norm (Li et al. 2022): ||grad_u||^2 = sum_{t,s} (row_t.row_s)(col_t.col_s),
  cost ~ T_u^2 (r + c) for a unit of T_u tokens; the weight gradient is then
  formed once more with rows reweighted by their clip factors;
- instantiation (Bu et al. 2023, "book-keeping" with mixed ghost norm): the
  per-unit gradients [U, r, c] come from one batched matmul with the same
  FLOPs as the ordinary weight gradient, and the clipped sum is a weighted
  sum of them, so nothing is computed twice. It is used for a group of units
  when their per-unit gradients take no more memory than the activations the
  ghost norm would keep (r c <= T_u (r + c)): in practice for ULS users with
  many tokens, and for all units in small models;
- sparse rows for embeddings: sum the g_t of equal (unit, token id) pairs and
  take squared norms, cost ~ T d.

Units are grouped by their number of rows (rows are sorted that way), so each
group is a plain reshape of the batch, [n_units, rows * L, features], with no
padding. A parameter shared by several layers (tied input/output embeddings)
gets the cross terms between its pieces, so its norm is that of the sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

# Upper bound on elements of one transient work tensor (Gram matrices, per-unit
# gradients of a chunk of units): bounds the extra memory of the norm computation.
WORK_ELEMS = 1 << 24


def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for norm arithmetic: at least float32 (bf16/fp16 inputs are upcast)."""
    return torch.promote_types(dtype, torch.float32)


def unit_chunks(n_units: int, elems_per_unit: int, budget: int = WORK_ELEMS) -> list[tuple[int, int]]:
    """Split [0, n_units) into contiguous chunks whose work tensors stay under `budget` elements."""
    step = max(1, budget // max(1, elems_per_unit))
    return [(lo, min(n_units, lo + step)) for lo in range(0, n_units, step)]


@dataclass(frozen=True)
class UnitGroup:
    """Units that have the same number of rows; their rows are contiguous."""

    row_lo: int
    row_hi: int
    unit_lo: int
    unit_hi: int
    rows_per_unit: int

    @property
    def n_units(self) -> int:
        return self.unit_hi - self.unit_lo


@dataclass
class UnitLayout:
    """How the rows of a micro-batch group into units.

    Rows are sorted by (rows of their unit, unit id), so each unit's rows are
    contiguous and units with equal row counts form a `UnitGroup`, ordered by
    ascending row count. `row_unit[r]` is the unit index (0..U-1) of row r.
    """

    n_rows: int
    seq_len: int
    n_units: int
    row_unit: Tensor
    groups: list[UnitGroup]

    @classmethod
    def from_sorted_rows(cls, row_unit: Tensor, seq_len: int) -> "UnitLayout":
        """Build from the unit index of each sorted row (non-decreasing, 0..U-1)."""
        counts = torch.bincount(row_unit).tolist()
        groups: list[UnitGroup] = []
        row = unit = 0
        while unit < len(counts):
            m, start_unit, start_row = counts[unit], unit, row
            while unit < len(counts) and counts[unit] == m:
                row += m
                unit += 1
            groups.append(UnitGroup(start_row, row, start_unit, unit, m))
        return cls(int(row_unit.numel()), seq_len, len(counts), row_unit, groups)

    def block(self, x: Tensor, grp: UnitGroup, lo: int, hi: int, dtype: torch.dtype | None = None) -> Tensor:
        """Per-token x [B, L, *f] -> blocks [hi - lo, rows * L, *f] for units lo..hi-1 of a group."""
        m = grp.rows_per_unit
        part = x[grp.row_lo + lo * m: grp.row_lo + hi * m]
        out = part.reshape((hi - lo, m * self.seq_len) + tuple(x.shape[2:]))
        return out if dtype is None else out.to(dtype)


@dataclass
class DenseRecord:
    """One use of a matrix parameter: grad = sum_t row_t (x) col_t, row [B, L, r], col [B, L, c]."""

    row: Tensor
    col: Tensor


@dataclass
class IndexRecord:
    """One use of an embedding table [V, d]: grad = sum_t onehot(ids_t) (x) g_t.

    ids [B, L] long, g [B, L, d]; tokens whose gradient the layer drops
    (padding_idx) already have g zeroed.
    """

    ids: Tensor
    g: Tensor


@dataclass
class ParamState:
    """What is collected for one trainable parameter during one accumulate call.

    kind: "matrix" (used by at least one Linear/Conv1D, maybe also as an
    embedding), "sparse" (embeddings only) or "vector" (biases, norm weights).
    For matrices the first `n_ghost` unit groups use the ghost norm and the
    rest instantiation (`unit_grads[i]` for group n_ghost + i).
    """

    param: torch.nn.Parameter
    kind: str
    n_ghost: int = 0
    dense: list[DenseRecord] = field(default_factory=list)
    index: list[IndexRecord] = field(default_factory=list)
    unit_grads: list[Tensor | None] = field(default_factory=list)
    inst_dtype: torch.dtype | None = None  # dtype of unit_grads
    row_sums: Tensor | None = None  # [B, numel] for vectors

    def ghost_rows(self, layout: UnitLayout) -> int:
        """Rows [0, n) belong to ghost-norm groups (all rows for sparse/vector parameters)."""
        if self.kind != "matrix" or self.n_ghost == len(layout.groups):
            return layout.n_rows
        return layout.groups[self.n_ghost].row_lo


def plan_param(param: torch.nn.Parameter, has_dense: bool, has_index: bool, layout: UnitLayout,
               requested: str) -> ParamState:
    """Pick the formula per unit group for a parameter (see the module docstring).

    A group is instantiated when the per-unit gradients take no more memory
    than the layer input and output gradient the ghost norm would keep
    (r c <= T_u (r + c), T_u the unit's token count); then it is also the
    faster choice, because it replaces the weight-gradient matmul.
    """
    if not has_dense:
        return ParamState(param, "sparse" if has_index else "vector")
    n_groups = len(layout.groups)
    if requested == "ghost":
        n_ghost = n_groups
    elif requested == "instantiate":
        n_ghost = 0
    else:
        r, c = param.shape
        n_ghost = sum(1 for g in layout.groups if r * c > g.rows_per_unit * layout.seq_len * (r + c))
    st = ParamState(param, "matrix", n_ghost)
    st.unit_grads = [None] * (n_groups - n_ghost)
    return st


def instantiate_dense(rec: DenseRecord, layout: UnitLayout, st: ParamState, dtype: torch.dtype) -> None:
    """Add per-unit gradients sum_t row_t col_t^T of one record to the instantiated groups of `st`."""
    r, c = rec.row.shape[-1], rec.col.shape[-1]
    for i, grp in enumerate(layout.groups[st.n_ghost:]):
        out = st.unit_grads[i]
        first = out is None
        if first:
            out = st.unit_grads[i] = torch.empty((grp.n_units, r, c), dtype=dtype, device=rec.row.device)
        tokens = grp.rows_per_unit * layout.seq_len
        for lo, hi in unit_chunks(grp.n_units, tokens * (r + c)):
            rows = layout.block(rec.row, grp, lo, hi, dtype).transpose(1, 2)
            cols = layout.block(rec.col, grp, lo, hi, dtype)
            if first:
                torch.bmm(rows, cols, out=out[lo:hi])
            else:
                out[lo:hi].baddbmm_(rows, cols)


def instantiate_index(rec: IndexRecord, layout: UnitLayout, st: ParamState, dtype: torch.dtype) -> None:
    """Add per-unit embedding gradients of one record to the instantiated groups of `st`."""
    n_vocab, d = st.param.shape
    for i, grp in enumerate(layout.groups[st.n_ghost:]):
        if st.unit_grads[i] is None:
            st.unit_grads[i] = torch.zeros((grp.n_units, n_vocab, d), dtype=dtype, device=rec.g.device)
        unit = layout.row_unit[grp.row_lo: grp.row_hi, None] - grp.unit_lo
        keys = unit * n_vocab + rec.ids[grp.row_lo: grp.row_hi]
        g = rec.g[grp.row_lo: grp.row_hi]
        st.unit_grads[i].view(-1, d).index_add_(0, keys.reshape(-1), g.reshape(-1, d).to(dtype))


def sparse_index_rows(records: list[IndexRecord], layout: UnitLayout, n_rows: int, n_vocab: int,
                      dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Sum token gradients of rows [0, n_rows) with equal (unit, id).

    Returns keys [n] (unit * V + id) and the summed rows [n, d].
    """
    unit = layout.row_unit[:n_rows, None]
    keys = torch.cat([(unit * n_vocab + r.ids[:n_rows]).reshape(-1) for r in records])
    vals = torch.cat([r.g[:n_rows].reshape(-1, r.g.shape[-1]) for r in records])
    uniq, inverse = torch.unique(keys, return_inverse=True)
    rows = torch.zeros(uniq.numel(), vals.shape[-1], dtype=dtype, device=vals.device)
    rows.index_add_(0, inverse, vals.to(dtype))
    return uniq, rows


def ghost_sq_norms(st: ParamState, layout: UnitLayout, out: Tensor) -> None:
    """Add per-unit squared norms of a sparse or matrix parameter's ghost groups into out [U].

    Sums the ghost Gram terms over all pairs of dense records, the sparse norm
    of the sum of the index records, and twice the index-dense cross terms
    (tied embeddings: <onehot(x_t) (x) g_t, row_s (x) col_s> = row_s[x_t] (g_t . col_s)).
    """
    dtype = out.dtype
    n_rows = st.ghost_rows(layout)
    if n_rows == 0:
        return
    if st.index:
        n_vocab = st.param.shape[0]
        uniq, rows = sparse_index_rows(st.index, layout, n_rows, n_vocab, dtype)
        out.index_add_(0, torch.div(uniq, n_vocab, rounding_mode="floor"), rows.square().sum(1))
    dense, index = st.dense, st.index
    if not dense:
        return
    width = sum(d.row.shape[-1] + d.col.shape[-1] for d in dense) + sum(i.g.shape[-1] for i in index)
    for grp in layout.groups[: st.n_ghost]:
        tpu = grp.rows_per_unit * layout.seq_len
        for lo, hi in unit_chunks(grp.n_units, max(tpu * width, 3 * tpu * tpu)):
            rows = [layout.block(d.row, grp, lo, hi, dtype) for d in dense]
            cols = [layout.block(d.col, grp, lo, hi, dtype) for d in dense]
            acc = out[grp.unit_lo + lo: grp.unit_lo + hi]
            for k in range(len(dense)):
                for m in range(k, len(dense)):
                    term = (torch.bmm(rows[k], rows[m].transpose(1, 2))
                            * torch.bmm(cols[k], cols[m].transpose(1, 2))).sum((1, 2))
                    acc += term if k == m else 2 * term
            for rec in index:
                ids = layout.block(rec.ids, grp, lo, hi)  # [n, T]
                g = layout.block(rec.g, grp, lo, hi, dtype)
                for k in range(len(dense)):
                    # picked[n, s, t] = row_s[ids_t] of the dense record
                    picked = torch.gather(rows[k], 2, ids[:, None, :].expand(-1, tpu, -1))
                    acc += 2 * (picked.transpose(1, 2) * torch.bmm(g, cols[k].transpose(1, 2))).sum((1, 2))


def weighted_dense_grad(rec: DenseRecord, row_factor: Tensor, n_rows: int, row_drop: Tensor | None = None) -> Tensor:
    """sum over rows r < n_rows of f_r sum_t row_t col_t^T: the weight-gradient matmul, rows reweighted.

    row_drop [B] bool: rows of units whose gradient is not finite; both sides
    of those rows are zeroed first (their factor is 0, but 0 * NaN is NaN).

    Always in at least float32, also under autocast: the clip factors come
    from norms of these very rows and columns in float32, and the DP bound
    needs ||f_u g_u|| <= C to float32 rounding. A bf16 matmul would round
    each unit's clipped contribution to ~1.001 C (costs a float32 matmul
    instead of a bf16 one for the ghost-norm parameters).
    """
    row, col = rec.row[:n_rows], rec.col[:n_rows]
    if row_drop is not None:
        d = row_drop[:n_rows].view(n_rows, *([1] * (row.dim() - 1)))
        row, col = row.masked_fill(d, 0), col.masked_fill(d, 0)
    dt = norm_dtype(torch.promote_types(row.dtype, col.dtype))
    row, col = row.to(dt), col.to(dt)
    f = row_factor[:n_rows].to(dt)[:, None, None]
    # scale whichever side is narrower (fewer elements to copy)
    if row.shape[-1] <= col.shape[-1]:
        row = row * f
    else:
        col = col * f
    return row.reshape(-1, row.shape[-1]).T @ col.reshape(-1, col.shape[-1])
