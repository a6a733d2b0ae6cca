"""Clipped per-example (ELS) and per-user (ULS) gradient sums for causal LMs.

`ClippedGradients(model, clip_norm).accumulate(...)` adds sum_u clip(g_u) to
the `.grad` of every trainable parameter, where g_u is the gradient of unit u
(an example, or a user's rows weighted 1/m_u). It never forms per-example
gradients of the big matrices blindly and never runs one backward per unit:

1. forward with hooks on every parameterised module of a registered layer
   type (`userdp.training.layers`: Linear, GPT-2 Conv1D, Embedding, Gemma's scaled
   Embedding, OPT's offset positions, LayerNorm, Llama's and Gemma's
   RMSNorm, also per head as in Qwen3 ([B, L, H, D]) and Gemma 3
   ([B, H, L, D]); layers that flatten tokens to
   [B * L, ...] are seen per token too): the layer inputs are kept and the outputs get a tensor hook that
   receives the output gradient, which the layer's handler turns into
   gradient pieces;
2. one backward with all trainable parameters temporarily frozen, so autograd
   computes activation gradients only (no weight gradient is computed twice);
3. per-unit norms from (input, output-gradient) pairs, by the cheapest exact
   formula per parameter and unit size (`grad_norms`: ghost norm, or
   per-unit gradients instantiated in the backward hook), with shared
   parameters (tied embeddings) grouped by identity so cross terms count;
4. clip factors, then the weight gradients once: a weighted sum of the
   instantiated per-unit gradients, or the ordinary weight-gradient matmul
   with each row reweighted by its unit's factor.

Containment (docs/method.md section 3): a unit whose gradient norm is not
finite (a NaN or inf anywhere in its gradient makes it so) gets factor 0 and
its rows are zeroed before they enter any sum, so it contributes exactly
zero and cannot turn the step into NaN; `accumulate` counts such units
(`nonfinite_units`). Normalized clipping gives a unit whose norm is zero, or
below the underflow floor `norm_floor`, factor 0 instead of C / 0. The
masking runs only in micro-batches that have a non-finite unit; otherwise
the only extra work is an isfinite over the [U] norms.

Rows are sorted by (size of their unit, unit id) so a user's rows are
contiguous and users of equal size reshape into one batch without padding.

This is the "book-keeping" scheme with mixed ghost norms of fastDP (Bu et al.,
ICML 2023). Broadcast position ids (GPT-2 builds them as [1, L]) are expanded
to the batch in the hook, so each example gets its own position-embedding
gradient. With clip_norm=None it is an ordinary backward (non-private
reference).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from userdp.errors import ConfigError
from userdp.training import grad_norms as gn
from userdp.training.gradients import MicroBatchStats
from userdp.training.layers import DENSE, INDEX, LAYER_HANDLERS, LayerHandler, handler_for

NORM_METHODS = ("auto", "ghost", "instantiate")


class UnsupportedModelError(ConfigError):
    """The model has trainable parameters in layers whose per-unit norms we cannot compute."""


@dataclass(frozen=True)
class _Use:
    """One (module, parameter) pair: the layer's handler forms the parameter's gradient there."""

    module: nn.Module
    handler: LayerHandler
    role: str  # the parameter's name in the module (weight | bias)
    param: nn.Parameter

    @property
    def form(self) -> str:
        """DENSE, INDEX or VECTOR: the kind of gradient piece this use produces."""
        return self.handler.roles[self.role]


def _collect_uses(model: nn.Module) -> tuple[list[nn.Parameter], list[_Use]]:
    """Find every trainable parameter and each module that uses it; raise on unsupported layers."""
    uses: list[_Use] = []
    bad: list[str] = []
    for name, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        handler = handler_for(module)
        for pname, p in own:
            if handler is not None and pname in handler.roles:
                uses.append(_Use(module, handler, pname, p))
            else:
                bad.append(f"{name or '<root>'}.{pname} ({type(module).__module__}.{type(module).__qualname__})")
    if bad:
        raise UnsupportedModelError(
            "DP clipping cannot compute per-unit gradient norms for these trainable parameters: "
            + ", ".join(bad)
            + ". Supported layers: " + ", ".join(h.label for h in LAYER_HANDLERS) + ". Freeze these "
            "parameters (requires_grad=False), train LoRA adapters instead (model.lora), or use one of the "
            "architectures of tests/test_architectures.py."
        )
    return list({id(u.param): u.param for u in uses}.values()), uses  # each parameter once, in order of first use


def _unflatten(batch_length: tuple[int, int], g: Tensor) -> Tensor:
    return g.reshape(*batch_length, *g.shape[1:])


def _heads_last(g: Tensor) -> Tensor:
    return g.transpose(1, 2)


def _reentrant_checkpointing(model: nn.Module) -> bool:
    """Whether a model's gradient checkpointing (transformers') is the reentrant kind (or of unknown kind)."""
    for module in model.modules():
        fn = getattr(module, "_gradient_checkpointing_func", None)
        if fn is not None:
            return getattr(fn, "keywords", {}).get("use_reentrant", True) is not False
    return True


def row_losses(logits: Tensor, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor | None = None,
               labels: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Mean next-token cross-entropy per row [B] and the number of valid targets per row [B].

    Target position t+1 counts when both t and t+1 are inside the attention
    mask and, with `loss_mask` [B, L] (chat and instruction data), when token
    t+1 is a loss target. `labels` [B, L]: the target tokens, aligned with
    input_ids (default: the input ids themselves, the next-token targets);
    positions outside the targets are ignored whatever they hold. Computed on
    the full logits tensor (labels shifted, invalid ones ignored) to avoid
    copying the [B, L, V] logits.
    """
    b, length, vocab = logits.shape
    valid = torch.zeros_like(attention_mask, dtype=torch.bool)
    valid[:, :-1] = (attention_mask[:, 1:] != 0) & (attention_mask[:, :-1] != 0)
    if loss_mask is not None:
        valid[:, :-1] &= loss_mask[:, 1:].to(torch.bool)
    targets = input_ids if labels is None else labels
    shifted = torch.full_like(input_ids, -100)
    shifted[:, :-1] = targets[:, 1:]
    shifted = shifted.masked_fill(~valid, -100)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    ce = F.cross_entropy(logits.reshape(-1, vocab), shifted.reshape(-1), ignore_index=-100, reduction="none")
    n_valid = valid.sum(1)
    return ce.view(b, length).sum(1) / n_valid.clamp(min=1).to(ce.dtype), n_valid


class ClippedGradients:
    """Adds clipped per-unit gradient sums into `.grad` of a causal LM's trainable parameters.

    clip_norm=None gives the non-private reference (plain gradient of
    sum_r w_r loss_r, no norms computed). normalize=True uses normalized
    clipping C * g_u / ||g_u||. norm_method forces the per-parameter norm
    formula ("ghost" or "instantiate") for matrices; "auto" picks the cheaper.
    The set of trainable parameters is fixed at construction.
    """

    def __init__(self, model: nn.Module, clip_norm: float | None, normalize: bool = False,
                 norm_method: str = "auto") -> None:
        if clip_norm is not None and not clip_norm > 0:
            raise ConfigError(f"clip norm must be positive or None (non-private), got {clip_norm!r}")
        if norm_method not in NORM_METHODS:
            raise ConfigError(f"norm_method must be one of {NORM_METHODS}, got {norm_method!r}")
        self.model = model
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.normalize = bool(normalize)
        self.norm_method = norm_method
        self.params, self._uses = _collect_uses(model)
        ckpt = getattr(model, "is_activation_checkpointing", None)
        if ckpt is None:
            ckpt = getattr(model, "is_gradient_checkpointing", False)
        if self.clip_norm is not None and ckpt and _reentrant_checkpointing(model):
            raise ConfigError("DP clipping supports only non-reentrant gradient checkpointing (the reentrant kind "
                              "runs the first forward without a graph, so no per-unit gradient reaches the "
                              "hooks); enable it with gradient_checkpointing_kwargs={'use_reentrant': False}, as "
                              "training.gradient_checkpointing does")
        self._ids = {id(p) for p in self.params}
        self.norm_floor = norm_floor(self.params)
        # per-call state
        self._states: dict[int, gn.ParamState] = {}
        self._layout: gn.UnitLayout | None = None
        self._batch = (0, 0)
        self._in_backward = False
        self._low: torch.dtype | None = None

    # ------------------------------------------------------------------ API
    def accumulate(self, input_ids: Tensor, attention_mask: Tensor, unit_ids: Tensor,
                   row_weights: Tensor, loss_mask: Tensor | None = None,
                   labels: Tensor | None = None) -> MicroBatchStats:
        """Add sum_u clip(g_u) into p.grad; rows with unit_ids == -1 are ignored.

        loss_mask [B, L] bool: the loss targets (chat data: the assistant's tokens), None: every token;
        labels [B, L]: the target tokens (default the input ids); see `row_losses`.

        Returns loss_sum (sum of row losses), n_rows, n_units, unit_ids (the
        units, ascending), unit_norms (their pre-clip gradient norms, same
        order; empty when clip_norm is None), clipped_fraction (units whose
        factor is below 1, dropped ones included) and nonfinite_units (units
        whose norm was NaN or inf: they contributed zero, and their rows are
        left out of loss_sum and n_rows; always 0 when clip_norm is None).
        """
        self._check_trainable()
        device = next(self.model.parameters()).device
        keep = (unit_ids >= 0).to(input_ids.device)

        def kept(t: Tensor | None) -> Tensor | None:  # the real rows, on the model's device
            return None if t is None else t.to(keep.device)[keep].to(device)

        input_ids, attention_mask, unit_ids, row_weights, loss_mask, labels = (
            kept(t) for t in (input_ids, attention_mask, unit_ids, row_weights, loss_mask, labels))
        n_rows = int(input_ids.shape[0])
        empty = torch.empty(0, device=device)
        if n_rows == 0:
            self._ensure_grads()
            return self._stats(0.0, 0, unit_ids, empty, 0.0, 0)
        lengths = attention_mask.sum(1)
        if not torch.equal(attention_mask.cumprod(1).sum(1), lengths):
            raise ValueError("attention_mask rows must be right-padded (ones, then zeros)")
        # Right padding + causal attention: positions past the longest row never
        # influence a loss, so drop them (same for the non-private path).
        max_len = max(int(lengths.max()), 1)
        input_ids, attention_mask = input_ids[:, :max_len], attention_mask[:, :max_len]
        targets = {"loss_mask": None if loss_mask is None else loss_mask[:, :max_len],
                   "labels": None if labels is None else labels[:, :max_len]}
        units, inverse, counts = torch.unique(unit_ids, return_inverse=True, return_counts=True)

        if self.clip_norm is None:
            losses = self._forward_losses(input_ids, attention_mask, **targets)
            (losses * row_weights.to(losses.dtype)).sum().backward()
            self._ensure_grads()
            return self._stats(float(losses.detach().sum()), n_rows, units, empty, 0.0, 0)

        # Sort rows by (rows of their unit, unit id): each unit's rows become
        # contiguous and units of equal size form reshape-able groups.
        rank = torch.empty_like(counts)
        rank[torch.argsort(counts, stable=True)] = torch.arange(counts.numel(), device=device)
        row_unit = rank[inverse]
        perm = torch.argsort(row_unit, stable=True)
        layout = gn.UnitLayout.from_sorted_rows(row_unit[perm], max_len)
        targets = {k: None if v is None else v[perm] for k, v in targets.items()}
        loss_sum, loss_rows, norms = self._clipped_pass(input_ids[perm], attention_mask[perm], row_weights[perm],
                                                        layout, targets)
        norms = norms[rank]  # back to ascending unit id
        clipped = float((~(norms <= self.clip_norm)).float().mean())  # NaN norms count as clipped (to zero)
        nonfinite = int((~torch.isfinite(norms)).sum())
        return self._stats(loss_sum, loss_rows, units, norms, clipped, nonfinite)

    # ------------------------------------------------------------ internals
    @staticmethod
    def _stats(loss_sum: float, n_rows: int, units: Tensor, norms: Tensor, clipped: float,
               nonfinite: int) -> MicroBatchStats:
        return MicroBatchStats(loss_sum=loss_sum, n_rows=n_rows, n_units=int(units.numel()), unit_ids=units,
                               unit_norms=norms.detach(), clipped_fraction=clipped, nonfinite_units=nonfinite)

    def _check_trainable(self) -> None:
        now = {id(p) for p in self.model.parameters() if p.requires_grad}
        if now != self._ids:
            raise RuntimeError("the set of trainable parameters changed after ClippedGradients was built; "
                               "build a new one after freezing/unfreezing")

    def _ensure_grads(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def _forward_losses(self, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor | None = None,
                        labels: Tensor | None = None) -> Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return row_losses(out.logits, input_ids, attention_mask, loss_mask, labels)[0]

    def _clipped_pass(self, input_ids: Tensor, attention_mask: Tensor, row_weights: Tensor,
                      layout: gn.UnitLayout, targets: dict[str, Tensor | None]) -> tuple[float, int, Tensor]:
        self._layout = layout
        # Under autocast, instantiated per-unit gradients are stored in the
        # autocast dtype (memory); norms are reduced in float32 or wider from
        # exactly the stored values, and every clipped sum (f_u times those
        # values, or the reweighted weight-gradient matmul of the ghost path)
        # is formed in float32 or wider, so a clipped unit has norm <= C up to
        # float32 rounding, never bf16 rounding.
        dev = input_ids.device.type
        self._low = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        self._batch = tuple(input_ids.shape)
        has_dense = {id(u.param) for u in self._uses if u.form == DENSE}
        has_index = {id(u.param) for u in self._uses if u.form == INDEX}
        self._states = {id(p): gn.plan_param(p, id(p) in has_dense, id(p) in has_index, layout, self.norm_method)
                        for p in self.params}
        for st in self._states.values():
            # embedding rows add up over repeated tokens: keep those buffers in float32 or wider
            low_ok = self._low is not None and id(st.param) not in has_index
            st.inst_dtype = self._low if low_ok else gn.norm_dtype(st.param.dtype)
        handles = []
        try:
            for p in self.params:
                p.requires_grad_(False)
            by_module: dict[int, list[_Use]] = {}
            for u in self._uses:
                by_module.setdefault(id(u.module), []).append(u)
            for uses in by_module.values():
                handles.append(uses[0].module.register_forward_hook(functools.partial(self._forward_hook, uses),
                                                                    with_kwargs=True))
            losses = self._forward_losses(input_ids, attention_mask, **targets)
            weighted = (losses * row_weights.to(losses.dtype)).sum()
            for h in handles:
                h.remove()
            handles = []
            if weighted.requires_grad:
                # Non-reentrant activation checkpointing reruns blocks' forwards inside this backward to rebuild
                # their saved tensors; the gradient flows through the first forward's graph, whose hooks are the
                # ones that fire, so the reruns are not hooked again.
                self._in_backward = True
                try:
                    weighted.backward()
                finally:
                    self._in_backward = False
            losses = losses.detach()
            del weighted
            with _no_autocast(input_ids.device):
                norms = self._unit_norms()
                factors, dropped = self._clip_factors(norms)
                # One host sync per micro-batch; the masking below runs only when a unit is dropped.
                drop = dropped if bool(dropped.any()) else None
                self._add_clipped_grads(factors, drop)
            if drop is None:
                return float(losses.sum()), layout.n_rows, norms
            kept_rows = ~drop[layout.row_unit]
            return float(losses[kept_rows].sum()), int(kept_rows.sum()), norms
        finally:
            for h in handles:
                h.remove()
            for p in self.params:
                p.requires_grad_(True)
            self._states = {}
            self._layout = None

    def _forward_hook(self, uses: list[_Use], module: nn.Module, args: tuple, kwargs: dict,
                      output: Tensor) -> Tensor | None:
        """Keep the layer input; hook the output so its gradient reaches `_on_grad`."""
        if self._in_backward:  # a checkpointed block's forward rerun (see accumulate)
            return None
        b, length = self._batch
        x = uses[0].handler.module_input(module, args, kwargs)
        if not isinstance(x, Tensor) or not isinstance(output, Tensor):
            raise RuntimeError(f"DP clipping: could not find the input/output tensor of {type(module).__name__}")
        x, output, replaced = uses[0].handler.layer_input(x, output, b)
        fix_g = None  # how the output gradient is brought to the [B, L, ...] layout x is brought to here
        if x.dim() >= 2 and x.shape[0] == b * length and tuple(x.shape[:2]) != (b, length):
            # tokens flattened to [B * L, ...] (OPT's feed-forward block): the rows are still the tokens
            x = x.reshape(b, length, *x.shape[1:])
            fix_g = functools.partial(_unflatten, (b, length))
        elif x.dim() == 4 and x.shape[0] == b and x.shape[2] == length and x.shape[1] != length:
            # heads before tokens, [B, H, L, D] (Gemma 3's q/k norms after the transpose)
            x = x.transpose(1, 2)
            fix_g = _heads_last
        if tuple(x.shape[:2]) != (b, length):
            raise RuntimeError(f"DP clipping: layer {type(module).__name__} saw input of shape {tuple(x.shape)}, "
                               f"expected leading dims {(b, length)} (batch, sequence)")
        if not output.requires_grad:
            # nothing trainable upstream (e.g. the input embedding): make this output a graph input
            output.requires_grad_(True)
        x = x.detach()
        version = x._version  # noqa: SLF001 - torch's in-place version counter, as autograd checks it
        output.register_hook(functools.partial(self._on_grad, uses, module, x, version, fix_g))
        return replaced

    def _on_grad(self, uses: list[_Use], module: nn.Module, x: Tensor, version: int,
                 fix_g: Callable[[Tensor], Tensor] | None, g: Tensor) -> None:
        """Turn (layer input, output gradient) into per-parameter records, or reduce them at once."""
        if x._version != version:  # noqa: SLF001 - see _forward_hook
            raise RuntimeError(f"DP clipping: the input of {type(module).__name__} was modified in place after "
                               "the layer ran; its per-unit gradients would be wrong")
        layout = self._layout
        with _no_autocast(g.device):
            g = g.detach()
            if fix_g is not None:
                g = fix_g(g)
            for use in uses:
                st = self._states[id(use.param)]
                piece = use.handler.piece(module, use.role, x, g, gn.norm_dtype(use.param.dtype))
                if isinstance(piece, gn.DenseRecord):
                    gn.instantiate_dense(piece, layout, st, st.inst_dtype)
                    if st.n_ghost:
                        st.dense.append(piece)
                elif isinstance(piece, gn.IndexRecord):
                    if st.kind == "matrix":
                        gn.instantiate_index(piece, layout, st, st.inst_dtype)
                    if st.kind == "sparse" or st.n_ghost:
                        st.index.append(piece)
                else:  # vector pieces: biases and norm weights, keep per-row sums only
                    rs = piece.reshape(piece.shape[0], piece.shape[1], -1).sum(1)
                    st.row_sums = rs if st.row_sums is None else st.row_sums + rs

    def _unit_norms(self) -> Tensor:
        """Per-unit gradient norms over all trainable parameters jointly [U] (sorted unit order)."""
        layout = self._layout
        device = self.params[0].device
        dt = gn.norm_dtype(self.params[0].dtype)
        sq = torch.zeros(layout.n_units, dtype=dt, device=device)
        # vectors (biases, norm weights): one segment sum over all of them at once
        vec = [st.row_sums for st in self._states.values() if st.kind == "vector" and st.row_sums is not None]
        if vec:
            rows = torch.cat([v.to(dt) for v in vec], dim=1)
            per_unit = torch.zeros(layout.n_units, rows.shape[1], dtype=dt, device=device)
            per_unit.index_add_(0, layout.row_unit, rows)
            sq += per_unit.square().sum(1)
        for st in self._states.values():
            if st.kind == "vector":
                continue
            part = torch.zeros(layout.n_units, dtype=gn.norm_dtype(st.param.dtype), device=device)
            gn.ghost_sq_norms(st, layout, part)
            for grp, ug in zip(layout.groups[st.n_ghost:], st.unit_grads):
                if ug is not None:
                    part[grp.unit_lo: grp.unit_hi] += torch.linalg.vector_norm(
                        ug.reshape(grp.n_units, -1), dim=1, dtype=part.dtype).square()
            sq += part.to(dt)
        return sq.clamp(min=0).sqrt()

    def _clip_factors(self, norms: Tensor) -> tuple[Tensor, Tensor]:
        """Per-unit clip factors [U] and the units dropped for a non-finite norm [U] bool.

        Flat: min(1, C / ||g_u||). Normalized: C / ||g_u||, and 0 when the
        norm is at most `norm_floor` (a zero gradient has no direction; C / 0
        would overflow to inf and 0 * inf is NaN) or C / ||g_u|| overflows.
        Either way a NaN or inf norm gives 0: `_add_clipped_grads` then zeroes
        the unit's rows, so it contributes exactly zero.
        """
        c = self.clip_norm
        finite = torch.isfinite(norms)
        safe = torch.where(finite & (norms > 0), norms, torch.ones_like(norms))
        zero = torch.zeros_like(norms)
        if self.normalize:
            f = c / safe
            return torch.where(finite & (norms > self.norm_floor) & torch.isfinite(f), f, zero), ~finite
        f = torch.where(norms > c, c / safe, torch.ones_like(norms))
        return torch.where(finite, f, zero), ~finite

    def _add_clipped_grads(self, factors: Tensor, drop: Tensor | None = None) -> None:
        """Add sum_u factor_u * g_u into p.grad for every trainable parameter.

        drop [U] bool: units whose gradient is not finite. Their factor is 0,
        but 0 * NaN is NaN, so their rows (and per-unit gradients) are zeroed
        before they enter a sum; None (no such unit) skips the masking.
        """
        layout = self._layout
        row_f = factors[layout.row_unit]
        row_drop = None if drop is None else drop[layout.row_unit]
        for st in self._states.values():
            p = st.param
            dt = gn.norm_dtype(p.dtype)
            parts: list[Tensor] = []
            if st.kind == "vector":
                if st.row_sums is not None:
                    rs = st.row_sums if row_drop is None else st.row_sums.masked_fill(row_drop[:, None], 0)
                    parts.append((row_f.to(dt) @ rs.to(dt)).view(p.shape))
            else:
                n_rows = st.ghost_rows(layout)
                for grp, ug in zip(layout.groups[st.n_ghost:], st.unit_grads):
                    if ug is not None:
                        f = factors[grp.unit_lo: grp.unit_hi].to(dt)
                        ug = ug.reshape(grp.n_units, -1)
                        if drop is not None:
                            ug = ug.masked_fill(drop[grp.unit_lo: grp.unit_hi, None], 0)
                        parts.append((f @ ug.to(dt)).view(p.shape))
                st.unit_grads = []
                if n_rows:
                    for rec in st.dense:
                        parts.append(gn.weighted_dense_grad(rec, row_f, n_rows, row_drop))
                    if st.index:
                        n_vocab = p.shape[0]
                        uniq, rows = gn.sparse_index_rows(st.index, layout, n_rows, n_vocab, dt)
                        unit = torch.div(uniq, n_vocab, rounding_mode="floor")
                        rows = rows * factors.to(dt)[unit][:, None]
                        if drop is not None:
                            rows = rows.masked_fill(drop[unit][:, None], 0)
                        emb = torch.zeros(p.shape, dtype=dt, device=p.device)
                        emb.index_add_(0, uniq - unit * n_vocab, rows)
                        parts.append(emb)
                st.dense, st.index = [], []
            st.row_sums = None
            for part in parts:
                if p.grad is None:
                    p.grad = part.to(p.dtype)
                else:
                    p.grad.add_(part)
            if p.grad is None:
                p.grad = torch.zeros_like(p)


def norm_floor(params: list[nn.Parameter]) -> float:
    """The smallest per-unit norm normalized clipping trusts: sqrt(d * tiny * 2^20).

    Norms are sums of squares in the norm dtype (float32 for float32, bf16
    and fp16 parameters). A squared coordinate below that dtype's smallest
    normal number `tiny` is subnormal or flushed to zero, so over d
    coordinates the squared norm can be off by up to d * tiny in absolute
    terms. Above this floor that is a relative error of at most 2^-20, so
    C g / ||g|| has norm C to float rounding; below it the direction is
    numerically meaningless and C / ||g|| could exceed what the gradient
    supports, so such a unit contributes zero. About 2e-14 for a tiny model,
    2e-12 for GPT-2 medium in float32; real gradient norms are many orders of
    magnitude larger.
    """
    if not params:
        return 0.0
    d = sum(p.numel() for p in params)
    tiny = torch.finfo(gn.norm_dtype(params[0].dtype)).tiny
    return float((d * tiny * 2.0**20) ** 0.5)


def _no_autocast(device: torch.device):
    """Disable autocast for norm arithmetic (the caller may run accumulate under autocast)."""
    try:
        return torch.autocast(device_type=device.type, enabled=False)
    except RuntimeError:
        return contextlib.nullcontext()
