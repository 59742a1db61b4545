"""ModelCacheSpec: the shape of a model's KV cache, read off an mlx-lm model.

Built from a constructed model, not its weights: MLX parameters are lazy, so a
full-size model class built from its real config allocates nothing until a
parameter is evaluated, and only parameter *shapes* are read here.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import asdict, dataclass

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache

from .errors import SemanticError

__all__ = ["LayerKind", "ModelCacheSpec", "UnsupportedModel", "build_model", "kv_bytes_per_token"]

FULL = "full"
SLIDING = "sliding"


class UnsupportedModel(SemanticError, ValueError):
    """A model whose cache kind Semantic cannot batch or persist (yet)."""


@dataclass(frozen=True)
class LayerKind:
    kind: str  # FULL or SLIDING
    window: int | None = None  # tokens kept by a sliding layer


def kv_bytes_per_token(n_kv_heads: int, head_dim: int, bits: int | None, group_size: int = 64) -> float:
    """Bytes one token costs in one layer (keys + values).

    ``bits=None`` means fp16.  A quantized element costs ``bits / 8`` bytes plus
    an fp16 scale and bias per group.
    """
    elements = 2 * n_kv_heads * head_dim
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
            else:
                raise UnsupportedModel(
                    f"model type {model_type!r} is not supported yet: layer {i} keeps a {type(c).__name__} "
                    "(a recurrent or linear-attention state), which Semantic cannot batch or persist yet"
                )
        attn = layers[0].self_attn
        if not hasattr(attn, "k_proj"):
            raise UnsupportedModel(
                f"model type {model_type!r} is not supported yet: its attention ({type(attn).__name__}) has no "
                "k_proj, a compressed latent (MLA) cache, which Semantic cannot quantize or persist yet"
            )
        k_out = attn.k_proj.weight.shape[0]
        n_kv = _n_kv_heads(model, attn)
        head_dim = k_out // n_kv
        sinks = any("sinks" in layer.self_attn for layer in layers)
        return cls(
            model_type=model_type,
            n_layers=len(layers),
            n_kv_heads=n_kv,
            head_dim=head_dim,
            layers=tuple(kinds),
            attention_sinks=sinks,
        )

    @property
    def n_full(self) -> int:
        return sum(1 for k in self.layers if k.kind == FULL)

    @property
    def n_sliding(self) -> int:
        return sum(1 for k in self.layers if k.kind == SLIDING)

    def bytes_per_token(self, bits: int | None = 4, group_size: int = 64) -> float:
        """Bytes a cached token costs across the full-attention layers."""
        return self.n_full * kv_bytes_per_token(self.n_kv_heads, self.head_dim, bits, group_size)

    def sliding_bytes(self, bits: int | None = None, group_size: int = 64) -> float:
        """Bytes of the sliding-window layers when full (bounded by their windows)."""
        per = kv_bytes_per_token(self.n_kv_heads, self.head_dim, bits, group_size)
        return sum(per * k.window for k in self.layers if k.kind == SLIDING)

    @property
    def hash(self) -> str:
        """Stable hash that tags cache files: a cache is only valid for an equal spec."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def summary(self) -> str:
        parts = [f"{self.n_full} full"]
        if self.n_sliding:
            windows = sorted({k.window for k in self.layers if k.kind == SLIDING})
            parts.append(f"{self.n_sliding} sliding({','.join(map(str, windows))})")
        sinks = ", sinks" if self.attention_sinks else ""
        return (
            f"{self.model_type}: {self.n_layers} layers ({' + '.join(parts)}), "
            f"{self.n_kv_heads} KV heads, head dim {self.head_dim}{sinks}"
        )


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

