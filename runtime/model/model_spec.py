"""ModelCacheSpec: the shape of a model's KV cache, read off an mlx-lm model.

Built from a constructed model, not its weights: MLX parameters are lazy, so a
full-size model class built from its real config allocates nothing until a
parameter is evaluated, and only parameter *shapes* are read here.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
from dataclasses import asdict, dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from ..errors import SemanticError

__all__ = ["LayerKind", "ModelCacheSpec", "UnsupportedModel", "build_model", "kv_bytes_per_token"]

FULL = "full"
SLIDING = "sliding"
RECURRENT = "recurrent"  # a fixed-size state per sequence (linear attention, SSM)
WINDOW_SPARE = 256  # tokens a sliding layer keeps beyond its window, so a turn can be cut back (``WindowKVCache``)
STATE_CHECKPOINTS = 2  # checkpoints a recurrent layer keeps beside its state (``StateCache``)


class UnsupportedModel(SemanticError, ValueError):
    """A model whose cache kind Semantic cannot batch or persist (yet)."""


@dataclass(frozen=True)
class LayerKind:
    kind: str  # FULL, SLIDING or RECURRENT
    window: int | None = None  # tokens kept by a sliding layer
    state: int | None = None  # elements of a recurrent layer's state (one sequence)


def kv_bytes_per_token(n_kv_heads: int, head_dim: int, bits: int | None, group_size: int = 64,
                       v_head_dim: int | None = None) -> float:
    """Bytes one token costs in one layer (keys + values; values ``v_head_dim``
    wide when it is given).

    ``bits=None`` means fp16.  A quantized element costs ``bits / 8`` bytes plus
    an fp16 scale and bias per group.
    """
    elements = n_kv_heads * (head_dim + (v_head_dim or head_dim))
    if bits is None:
        return elements * 2.0
    return elements * (bits / 8 + 4 / group_size)


@dataclass(frozen=True)
class ModelCacheSpec:
    model_type: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    layers: tuple[LayerKind, ...]
    attention_sinks: bool
    v_head_dim: int | None = None  # MLA (DeepSeek): the cached values' width; None: as wide as the keys
    shard: tuple[int, int] | None = None  # (rank, ranks) of a tensor-parallel shard: its KV heads only

    @classmethod
    def from_model(cls, model: nn.Module) -> "ModelCacheSpec":
        caches = model.make_cache() if hasattr(model, "make_cache") else None
        layers = model.layers
        if caches is None:
            caches = [KVCache() for _ in layers]
        model_type = model.model_type if hasattr(model, "model_type") else type(model).__module__.rsplit(".", 1)[-1]
        kinds = []
        for i, c in enumerate(caches):
            if isinstance(c, RotatingKVCache):
                kinds.append(LayerKind(SLIDING, c.max_size))
            elif isinstance(c, KVCache):
                kinds.append(LayerKind(FULL))
            elif type(c) is ArraysCache and "linear_attn" in layers[i]:
                kinds.append(LayerKind(RECURRENT, state=_state_elements(model_type, layers[i], len(c.cache))))
            else:
                raise UnsupportedModel(
                    f"model type {model_type!r} is not supported yet: layer {i} keeps a {type(c).__name__} "
                    "(a recurrent state of a kind Semantic cannot batch or persist yet)"
                )
        attending = [layer for layer in layers if "self_attn" in layer]
        if not attending:
            raise UnsupportedModel(f"model type {model_type!r} is not supported yet: no layer attends")
        attn = attending[0].self_attn
        if hasattr(attn, "k_proj"):
            n_kv = _n_kv_heads(model, attn)
            head_dim, v_head_dim = attn.k_proj.weight.shape[0] // n_kv, None
        else:  # MLA and other layouts: read what the attention writes to its cache
            n_kv, head_dim, v_head_dim = _cache_write_shape(model_type, attending[0])
        sinks = any("sinks" in layer.self_attn for layer in attending)
        return cls(
            model_type=model_type,
            n_layers=len(layers),
            n_kv_heads=n_kv,
            head_dim=head_dim,
            layers=tuple(kinds),
            attention_sinks=sinks,
            v_head_dim=v_head_dim,
        )

    @property
    def n_full(self) -> int:
        return sum(1 for k in self.layers if k.kind == FULL)

    @property
    def n_sliding(self) -> int:
        return sum(1 for k in self.layers if k.kind == SLIDING)

    @property
    def n_recurrent(self) -> int:
        return sum(1 for k in self.layers if k.kind == RECURRENT)

    def state_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes of every recurrent layer's state of one sequence (an agent holds
        it and ``STATE_CHECKPOINTS`` checkpoints of it: a fixed cost)."""
        return sum(k.state for k in self.layers if k.kind == RECURRENT) * dtype_bytes

    def bytes_per_token(self, bits: int | None = 4, group_size: int = 64) -> float:
        """Bytes a cached token costs across the full-attention layers."""
        return self.n_full * kv_bytes_per_token(self.n_kv_heads, self.head_dim, bits, group_size, self.v_head_dim)

    def sliding_bytes(self, bits: int | None = None, group_size: int = 64) -> float:
        """Bytes of the sliding-window layers when full (bounded by their windows
        and ``WINDOW_SPARE``)."""
        per = kv_bytes_per_token(self.n_kv_heads, self.head_dim, bits, group_size, self.v_head_dim)
        return sum(per * (k.window + WINDOW_SPARE) for k in self.layers if k.kind == SLIDING)

    @property
    def kv_width(self) -> int:
        """Elements of one token in one KV head: its key and its value."""
        return self.head_dim + (self.v_head_dim or self.head_dim)

    @property
    def hash(self) -> str:
        """Stable hash that tags cache files: a cache is only valid for an equal spec."""
        fields = asdict(self)
        for d in (fields, *fields["layers"]):  # fields added later count only when set: older files stay valid
            for name in ("v_head_dim", "state", "shard"):
                if d.get(name, 0) is None:
                    del d[name]
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def summary(self) -> str:
        parts = [f"{self.n_full} full"]
        if self.n_sliding:
            windows = sorted({k.window for k in self.layers if k.kind == SLIDING})
            parts.append(f"{self.n_sliding} sliding({','.join(map(str, windows))})")
        if self.n_recurrent:
            parts.append(f"{self.n_recurrent} recurrent")
        sinks = ", sinks" if self.attention_sinks else ""
        dims = f"head dim {self.head_dim}" + (f" (values {self.v_head_dim})" if self.v_head_dim else "")
        return (
            f"{self.model_type}: {self.n_layers} layers ({' + '.join(parts)}), "
            f"{self.n_kv_heads} KV heads, {dims}{sinks}"
        )


class _ShapeProbe:
    """A cache that records what an attention module writes to it."""

    offset = 0
    shapes: tuple = ()

    def update_and_fetch(self, keys, values):
        self.shapes = keys.shape, values.shape
        return keys, values


def _one_token(layer: nn.Module, module: nn.Module, cache) -> None:
    """One token through ``module`` (of ``layer``) into ``cache``: the graph is built
    and never evaluated (MLX is lazy), so no weight is touched."""
    module(mx.zeros((1, 1, layer.input_layernorm.weight.shape[0])), None, cache)


def _cache_write_shape(model_type: str, layer: nn.Module) -> tuple[int, int, int]:
    """(heads, key width, value width) of what ``layer``'s attention caches per
    token: one token through it. DeepSeek-V2 caches every head's key and
    value; DeepSeek-V3 one compressed latent (512) and its rope key (64)."""
    attn = layer.self_attn
    probe = _ShapeProbe()
    try:
        _one_token(layer, attn, probe)
        (_, heads, _, k_width), (_, v_heads, _, v_width) = probe.shapes
    except Exception as e:
        raise UnsupportedModel(f"model type {model_type!r} is not supported yet: cannot tell what its attention "
                               f"({type(attn).__name__}) caches ({e!r})") from None
    if heads != v_heads:
        raise UnsupportedModel(f"model type {model_type!r} is not supported yet: its attention caches keys of "
                               f"{heads} heads and values of {v_heads}")
    return heads, k_width, v_width


def _state_elements(model_type: str, layer: nn.Module, size: int) -> int:
    """Elements of a recurrent layer's state for one sequence: one token through it."""
    probe = ArraysCache(size)
    try:
        _one_token(layer, layer.linear_attn, probe)
        return sum(math.prod(x.shape) for x in probe.cache if x is not None)
    except Exception as e:
        raise UnsupportedModel(f"model type {model_type!r} is not supported yet: cannot tell the size of its "
                               f"recurrent state ({e!r})") from None


def _n_kv_heads(model: nn.Module, attn: nn.Module) -> int:
    for name in ("n_kv_heads", "num_key_value_heads", "num_kv_heads"):
        value = getattr(attn, name, None)
        if isinstance(value, int):
            return value
    args = getattr(model, "args", None)
    for name in ("num_key_value_heads", "n_kv_heads"):
        value = getattr(args, name, None)
        if isinstance(value, int):
            return value
    raise ValueError("cannot tell the number of KV heads of this model")


def build_model(config: dict) -> nn.Module:
    """Construct an mlx-lm model from its config, weights left lazy and random."""
    from mlx_lm.utils import MODEL_REMAPPING

    model_type = MODEL_REMAPPING.get(config["model_type"], config["model_type"])
    try:
        arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError as e:
        raise ValueError(f"model type {model_type!r} is not supported by mlx-lm") from e
    return arch.Model(arch.ModelArgs.from_dict(config))

