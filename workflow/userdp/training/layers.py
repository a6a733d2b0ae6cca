"""Layer handlers: how DP clipping forms the per-token gradient pieces of each supported layer type.

`ClippedGradients` (clipping.py) hooks every module that has trainable
parameters. Each such module needs a handler, the first in `LAYER_HANDLERS`
whose `matches` accepts it (`handler_for`); a trainable parameter of a
module no handler matches, or one a handler does not list in its `roles`,
makes the model unsupported (`UnsupportedModelError`, raised before
training, naming the parameter).

A handler says which modules it matches (the support check: it must accept
only modules whose parameter gradients it computes exactly, so checks are
strict, or numerical where a layer is recognised by what it computes), which
of their parameters it handles, and how a parameter's per-token gradient
piece is formed from (layer input x, output gradient g). A piece has one of
three forms, and the per-unit norms and clipped sums of each form are
computed in `grad_norms`, whatever layer produced it:

- gn.DenseRecord (a matrix: grad = sum_t row_t (x) col_t),
- gn.IndexRecord (an embedding table: grad = sum_t onehot(id_t) (x) g_t),
- a Tensor [B, L, *shape] (a vector: biases and norm weights, grad = sum_t v_t).

Adding a new architecture's layer is one decorated class, here or in any
module imported before `ClippedGradients` is built::

    @register_layer
    class MyLayerHandler(LayerHandler):
        kind, label, roles = "mylayer", "MyLayer", {"weight": DENSE, "bias": VECTOR}
        def matches(self, module): ...                   # only modules piece() is exact for
        def piece(self, module, role, x, g, dtype): ...  # e.g. gn.DenseRecord(row=g, col=x)

(a worked example, checked against brute force: tests/test_layers.py).
`register_layer` instantiates the class and appends the instance to
`LAYER_HANDLERS`; handlers are tried in registration order, which for the
built-in ones below is their order in this file. Override `module_input`
when the gradient is a function of something other than the layer's first
input (OPT's positions), and `layer_input` to reshape what the hooks see
(GPT-2's broadcast position ids). Then add the architecture to
tests/test_architectures.py, which checks the clipped sums against one
backward per unit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from userdp.training import grad_norms as gn

DENSE, INDEX, VECTOR = "dense", "index", "vector"


class LayerHandler:
    """How DP clipping treats one layer type (subclass it and decorate the subclass with `register_layer`)."""

    kind: str = ""                    # a short name (linear, conv1d, ...)
    label: str = ""                   # how the unsupported-model error names it
    roles: dict[str, str] = {}        # parameter name -> piece form (DENSE, INDEX or VECTOR)

    def matches(self, module: nn.Module) -> bool:
        """Whether this handler computes the parameter gradients of `module` exactly."""
        raise NotImplementedError

    def module_input(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        """The tensor the layer's gradient is a function of: its first input (override for other layers)."""
        return args[0] if args else (next(iter(kwargs.values())) if len(kwargs) == 1 else None)

    def layer_input(self, x: Tensor, output: Tensor, batch: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """(input, output, replacement output or None) as the forward hook should see them."""
        return x, output, None

    def piece(self, module: nn.Module, role: str, x: Tensor, g: Tensor,
              dtype: torch.dtype) -> gn.DenseRecord | gn.IndexRecord | Tensor:
        """The gradient piece of parameter `role` from layer input x and output gradient g.

        Vector pieces are per token, in `dtype` (the parameter's norm dtype).
        """
        raise NotImplementedError


LAYER_HANDLERS: list[LayerHandler] = []


def register_layer(cls: type[LayerHandler]) -> type[LayerHandler]:
    """Class decorator: add an instance of a LayerHandler subclass to the registry (tried in registration order)."""
    if not (isinstance(cls, type) and issubclass(cls, LayerHandler)):
        raise TypeError(f"register_layer decorates a LayerHandler subclass, got {cls!r}")
    LAYER_HANDLERS.append(cls())
    return cls


def handler_for(module: nn.Module) -> LayerHandler | None:
    """The registered handler of `module`, or None if no handler supports it."""
    for handler in LAYER_HANDLERS:
        if handler.matches(module):
            return handler
    return None


def _plain(module: nn.Module, cls: type) -> bool:
    """`module` is a `cls` whose forward is not overridden (so its gradient is the known one)."""
    return isinstance(module, cls) and type(module).forward is cls.forward


def _conv1d_class() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is a dependency, but keep the module importable without it
        return None
    return Conv1D


def _rms_eps(module: nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = getattr(module, "eps", None)
    if eps is None and isinstance(module, nn.RMSNorm):
        return None  # torch uses finfo(dtype).eps
    return eps


def _rms_normalized(module: nn.Module, x: Tensor, dtype: torch.dtype) -> Tensor:
    """The normalised input x / rms(x) of an RMSNorm layer (its output is weight * that)."""
    eps = _rms_eps(module)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    # LlamaRMSNorm: x in float32, x * rsqrt(mean(x^2) + eps), cast back to the input dtype;
    # torch's nn.RMSNorm computes in the input dtype.
    xs = x.to(gn.norm_dtype(x.dtype)) if isinstance(module, nn.RMSNorm) else x.to(torch.float32)
    out = xs * torch.rsqrt(xs.square().mean(-1, keepdim=True) + eps)
    return out.to(x.dtype).to(dtype)


@torch.no_grad()
def _rms_matches(module: nn.Module, offset: float = 0.0) -> bool:
    """Check numerically that an RMSNorm-like module computes (offset + weight) * x / rms(x).

    offset 0 is Llama's RMSNorm, offset 1 Gemma's (1 + weight); any other
    variant fails both checks and is reported as unsupported rather than
    clipped wrongly.
    """
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return False
    if any(n != "weight" for n, _ in module.named_parameters(recurse=False)):
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, weight.numel(), generator=gen).to(weight.device, weight.dtype)
    try:
        got = module(x)
    except Exception:
        return False
    want = (offset + weight) * _rms_normalized(module, x, weight.dtype)
    tol = 1e-2 if weight.dtype in (torch.bfloat16, torch.float16) else 1e-4
    return got.shape == want.shape and torch.allclose(got, want, rtol=tol, atol=tol)


def _per_token(piece: Tensor) -> Tensor:
    """A vector piece [B, L, ..., D] of a norm applied per head ([B, L, H, D], Qwen3's q/k norms) summed to
    [B, L, D]: the weight is shared by the heads, so its per-token gradient is the sum over them."""
    return piece if piece.dim() <= 3 else piece.sum(dim=tuple(range(2, piece.dim() - 1)))


class _BiasHandler(LayerHandler):
    """Layers with a bias whose gradient piece is the output gradient itself."""

    def piece(self, module, role, x, g, dtype):
        if role == "bias":
            return g.to(dtype)
        return self.weight_piece(module, x, g, dtype)

    def weight_piece(self, module: nn.Module, x: Tensor, g: Tensor, dtype: torch.dtype):
        raise NotImplementedError


@register_layer
class LinearHandler(_BiasHandler):
    """nn.Linear, y = x W^T + b, W [out, in]: grad W = sum_t g_t (x) x_t."""

    kind, label, roles = "linear", "nn.Linear", {"weight": DENSE, "bias": VECTOR}

    def matches(self, module):
        return _plain(module, nn.Linear)

    def weight_piece(self, module, x, g, dtype):
        return gn.DenseRecord(row=g, col=x)


@register_layer
class Conv1DHandler(_BiasHandler):
    """GPT-2's Conv1D, y = x W + b, W [in, out]: grad W = sum_t x_t (x) g_t."""

    kind, label, roles = "conv1d", "transformers Conv1D", {"weight": DENSE, "bias": VECTOR}

    def matches(self, module):
        conv1d = _conv1d_class()
        return conv1d is not None and _plain(module, conv1d)

    def weight_piece(self, module, x, g, dtype):
        return gn.DenseRecord(row=x, col=g)


@register_layer
class EmbeddingHandler(LayerHandler):
    """nn.Embedding (also tied with an output layer: the parameter then has dense pieces too)."""

    kind, label, roles = "embedding", "nn.Embedding (no max_norm/sparse/scale_grad_by_freq)", {"weight": INDEX}

    def matches(self, module):
        return (_plain(module, nn.Embedding) and module.max_norm is None and not module.scale_grad_by_freq
                and not module.sparse)

    def layer_input(self, x, output, batch):
        if x.shape[0] == 1 and batch > 1:
            # GPT-2 builds position ids as [1, L]; expand so each row gets its own gradient.
            x = x.expand(batch, *x.shape[1:])
            if not output.requires_grad:
                output.requires_grad_(True)
            output = output.expand(batch, *output.shape[1:])
            return x, output, output
        return x, output, None

    def piece(self, module, role, x, g, dtype):
        pad = module.padding_idx
        return gn.IndexRecord(ids=x, g=g if pad is None else g.masked_fill((x == pad)[..., None], 0))


@register_layer
class ScaledEmbeddingHandler(EmbeddingHandler):
    """An embedding whose output is scaled by a constant (Gemma's `embed_scale`): grad rows = scale * g."""

    kind, label = "scaled_embedding", "scaled nn.Embedding (Gemma: table * embed_scale)"

    def matches(self, module):
        if not (isinstance(module, nn.Embedding) and hasattr(module, "embed_scale") and module.max_norm is None
                and not module.scale_grad_by_freq and not module.sparse):
            return False
        with torch.no_grad():
            ids = torch.arange(min(4, module.num_embeddings), device=module.weight.device)[None]
            try:
                got = module(ids)
            except Exception:
                return False
            return torch.allclose(got, F.embedding(ids, module.weight) * self._scale(module), rtol=1e-4, atol=1e-6)

    @staticmethod
    def _scale(module: nn.Module) -> float:
        return float(module.embed_scale)  # a 0-d buffer (Gemma) or a float

    def piece(self, module, role, x, g, dtype):
        return super().piece(module, role, x, g * self._scale(module), dtype)


@register_layer
class OffsetPositionsHandler(EmbeddingHandler):
    """OPT's learned positions: the table row of token t is its position (from the attention mask or the
    position ids it is given) plus a fixed offset; checked numerically against that rule."""

    kind, label = "offset_positions", "OPT learned positional embedding (position + offset)"

    def matches(self, module):
        if not (isinstance(module, nn.Embedding) and isinstance(getattr(module, "offset", None), int)
                and type(module).__name__.endswith("LearnedPositionalEmbedding")):
            return False
        mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], device=module.weight.device)
        with torch.no_grad():
            try:
                got = module(mask, 0, position_ids=None)
            except Exception:
                return False
            want = F.embedding(self._ids(module, (mask, 0), {}), module.weight)
            return got.shape == want.shape and torch.equal(got, want)

    @staticmethod
    def _ids(module: nn.Module, args: tuple, kwargs: dict) -> Tensor:
        mask = args[0] if args else kwargs["attention_mask"]
        cache = int(args[1]) if len(args) > 1 else int(kwargs.get("cache_length", 0) or 0)
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = ((torch.cumsum(mask, dim=1) * mask) - 1).long()[:, cache:]
        return pos + module.offset

    def module_input(self, module, args, kwargs):
        return self._ids(module, args, kwargs)


@register_layer
class LayerNormHandler(_BiasHandler):
    """nn.LayerNorm, y = w * xhat + b: grad w = sum_t g_t * xhat_t."""

    kind, label, roles = "layernorm", "nn.LayerNorm", {"weight": VECTOR, "bias": VECTOR}

    def matches(self, module):
        return _plain(module, nn.LayerNorm)

    def weight_piece(self, module, x, g, dtype):
        return g.to(dtype) * F.layer_norm(x.to(dtype), module.normalized_shape, eps=module.eps)


@register_layer
class RMSNormHandler(LayerHandler):
    """Llama-style RMSNorm, y = w * x / rms(x), checked numerically; also applied per head (Qwen3)."""

    kind, label, roles = "rmsnorm", "Llama-style RMSNorm (weight * x / rms(x))", {"weight": VECTOR}
    offset = 0.0

    def matches(self, module):
        return ((isinstance(module, nn.RMSNorm) or type(module).__name__.endswith("RMSNorm"))
                and _rms_matches(module, self.offset))

    def piece(self, module, role, x, g, dtype):
        # d/dw of (offset + w) * xhat is xhat, for both variants
        return _per_token(g.to(dtype) * _rms_normalized(module, x, dtype))


@register_layer
class OffsetRMSNormHandler(RMSNormHandler):
    """Gemma-style RMSNorm, y = (1 + w) * x / rms(x) (Gemma, Gemma 2/3), checked numerically."""

    kind, label = "rmsnorm_offset", "Gemma-style RMSNorm ((1 + weight) * x / rms(x))"
    offset = 1.0
