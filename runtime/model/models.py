"""Resolve a model name and load it for the device we run on.

``smollm2`` is the embedded model; anything else is a local mlx-lm model
directory or a Hugging Face repo id (downloaded by mlx-lm where a hub is
reachable).  On the CPU, weights are dequantized and everything computes in
float32 (MLX's CPU quantized matmul and half-precision math are slow); on
Metal the 4-bit weights stay as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from . import embedded
from ..errors import ModelError
from .model_spec import ModelCacheSpec

__all__ = ["LoadedModel", "catalogue", "load", "load_tokenizer", "resolve"]

_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class LoadedModel:
    name: str  # what the user asked for
    path: Path
    model: nn.Module
    tokenizer: object  # mlx_lm TokenizerWrapper
    config: dict
    spec: ModelCacheSpec
    dtype: mx.Dtype

    @property
    def context_length(self) -> int:
        return int(self.config.get("max_position_embeddings") or self.config.get("max_seq_len") or 4096)


def catalogue(entries) -> dict[str, str | LoadedModel]:
    """The models a server may run, by the name requests use: each entry is a
    ``LoadedModel`` (its ``name``), a model as ``--model`` takes it (named as
    given), or ``NAME=MODEL`` to give it a shorter name.  Raises ``ValueError``
    for an empty or repeated name."""
    out: dict[str, str | LoadedModel] = {}
    for entry in entries:
        if isinstance(entry, LoadedModel):
            name, source = entry.name, entry
        else:
            name, eq, source = str(entry).partition("=")
            if not eq:
                source = name
        if not name or not source:
            raise ValueError(f"a model needs a name and a model: {entry!r} (try NAME=DIR)")
        if name in out:
            raise ValueError(f"two models are named {name!r}; name one NAME=MODEL")
        out[name] = source
    return out


def resolve(name: str, progress: bool = True) -> Path | str:
    """A local model directory, or a Hugging Face repo id left for mlx-lm to fetch."""
    if name == embedded.NAME:
        return embedded.prepare(progress=progress)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is not an mlx-lm model directory: it has no config.json")
        return path
    if path.exists():
        raise ModelError(f"{path} is a file; --model takes a model directory, a repo id or 'smollm2'")
    if _HF_REPO.match(name) and not name.startswith((".", "/", "~")):
        return name
    raise ModelError(
        f"unknown model {name!r}: use 'smollm2' (embedded), a local mlx-lm model directory, "
        "or a Hugging Face repo id such as mlx-community/Llama-3.2-1B-Instruct-4bit"
    )


def load(name: str = embedded.NAME, progress: bool = True, group: mx.distributed.Group | None = None) -> LoadedModel:
    """Load a model and its tokenizer for this device; with a ``group`` of more
    than one rank, only this rank's tensor-parallel shard (mlx-lm's ``shard``:
    its share of the heads and of the MLP; the layers' outputs meet in an
    all-reduce).  Raises ModelError."""
    from mlx_lm.utils import dequantize_model
    from mlx_lm.utils import load as mlx_lm_load

    where = resolve(name, progress)
    try:
        model, tokenizer, config = mlx_lm_load(str(where), return_config=True)
    except Exception as e:  # network, missing files, unsupported architecture
        if isinstance(where, str):
            raise ModelError(
                f"could not fetch {where!r} from Hugging Face ({type(e).__name__}): "
                "use a local model directory or 'smollm2'"
            ) from None
        raise ModelError(f"could not load the model in {where}: {e}") from None
    if mx.default_device() == mx.cpu:
        model = dequantize_model(model)
        model.set_dtype(mx.float32)
        dtype = mx.float32
    else:
        dtype = _param_dtype(model)
    spec = ModelCacheSpec.from_model(model)
    if group is not None and group.size() > 1:
        spec = _shard(model, spec, group, name)
    mx.eval(model.parameters())
    path = Path(where) if isinstance(where, Path) else Path(getattr(tokenizer, "name_or_path", where))
    return LoadedModel(name, path, model, tokenizer, config, spec, dtype)


def _shard(model: nn.Module, spec: ModelCacheSpec, group: mx.distributed.Group, name: str) -> ModelCacheSpec:
    """Keep this rank's shard of ``model`` (in place); the spec of its cache."""
    ranks = group.size()
    if not hasattr(model, "shard"):
        raise ModelError(f"{name}: mlx-lm's {spec.model_type} model cannot be sharded (it has no shard())")
    if spec.n_kv_heads % ranks:
        raise ModelError(f"{name}: its {spec.n_kv_heads} KV heads do not split evenly over {ranks} ranks")
    model.shard(group)
    return replace(ModelCacheSpec.from_model(model), shard=(group.rank(), ranks))


def load_tokenizer(name: str):
    """The tokenizer (and chat template) of a model, without its weights."""
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    where = resolve(name, progress=False)
    try:
        return mlx_lm_load_tokenizer(str(where))
    except Exception as e:
        raise ModelError(f"could not load the tokenizer of {name!r}: {e}") from None


def _param_dtype(model: nn.Module) -> mx.Dtype:
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32
