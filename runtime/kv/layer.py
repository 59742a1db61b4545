"""What every kind of layer cache answers (``LayerCache``), and one sequence's
caches as one object (``SequenceCache``).

A layer cache is first mlx-lm's cache protocol -- ``update_and_fetch``,
``make_mask``, ``offset``, ``trim``, ``is_trimmable``, ``state`` -- which the
model's own layers call. The rest is ours: how far it can go back (trimming,
or a checkpoint), what a step evaluates, how attention sees it, and how it is
written to its files, checked and rebuilt from them, and which of mlx-lm's
caches it takes the place of. Code outside ``runtime/kv/`` asks these, never
which kind it is: a new kind is its module here, whose class ``register``s
itself (``runtime.kv.kinds``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import ClassVar, Protocol

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import _BaseCache

__all__ = ["LayerCache", "SequenceCache", "Trimmed"]


class LayerCache(Protocol):
    KINDS: ClassVar[tuple[str, ...]]  # the manifest kinds it is written as (first) and read from
    blocked: ClassVar[bool]  # some of its tensors are cut into blocks: their entries end with the tokens they hold
    recurrent: ClassVar[bool]  # a state the layer itself runs per sequence (``runtime.engine.rowwise``); cut by checkpoints
    float_keys: ClassVar[bool]  # attention reads float keys and values from it
    attends_new: ClassVar[bool]  # takes a decode step's Q4 rows from the batch (``attend_new``)
    offset: int  # tokens seen

    @property
    def trimmable_tokens(self) -> int:
        """Tokens it can drop from its end."""

    def rewind_points(self) -> list[int]:
        """Token counts it can go back to besides trimming (its checkpoints)."""

    def can_rewind(self, tokens: int) -> bool:
        """Whether ``rewind(tokens)`` can go back there."""

    def rewind(self, tokens: int) -> None:
        """Go back to its first ``tokens`` tokens; ``ValueError`` where it cannot."""

    def mark(self) -> None:
        """Remember this point to rewind to, where trimming cannot."""

    def view(self, float_head: int | None = None) -> LayerCache:
        """Itself as a forward attends over it (a quantized record: through a
        float working copy of its first ``float_head`` closed tokens (None:
        all) and its open block, the rest packed); writes reach the record."""

    @property
    def arrays(self) -> list:
        """Every array it holds: what a step evaluates so graphs never grow."""

    def describe(self) -> tuple[dict, dict[str, mx.array], dict[str, mx.array]]:
        """Its manifest entry (``kind``, ``offset`` and its own fields), its tensors
        cut into blocks (full length, token axis 2) and its ring tensors."""

    @classmethod
    def rebuild(cls, entry: Mapping, arrays: Mapping[str, mx.array]) -> LayerCache:
        """The cache as it was after ``entry['offset']`` tokens, from its manifest
        entry and its tensors by name."""

    @classmethod
    def check_entry(cls, entry: Mapping, n: int) -> None:
        """Check a manifest entry of its kinds that covers ``n`` tokens, its
        tensors' entries already lists of a known dtype and sizes: raise
        ``ValueError`` saying what does not fit."""

    @classmethod
    def blocked_names(cls, entry: Mapping) -> list[str]:
        """The names of its tensors cut into the block files, in file order."""

    @classmethod
    def ring_names(cls, entry: Mapping) -> list[str]:
        """The names of its tensors in the ring file, in file order."""

    @classmethod
    def replacing(cls, cache: _BaseCache, bits: int, group_size: int) -> LayerCache | None:
        """Its empty cache in place of mlx-lm's ``cache`` (what the model makes
        for a layer), or None when that is not its kind's. Raises
        ``ValueError`` for one of its kind's that it cannot hold."""


class Trimmed:
    """Going back by trimming: the kinds whose tokens are held in order."""

    recurrent: ClassVar[bool] = False

    def rewind_points(self) -> list[int]:
        return []

    def can_rewind(self, tokens: int) -> bool:
        return self.offset - self.trimmable_tokens <= tokens <= self.offset

    def rewind(self, tokens: int) -> None:
        self.trim(self.offset - tokens)
        if self.offset != tokens:
            raise ValueError(f"a {type(self).__name__} cannot be cut back to {tokens} tokens")

    def mark(self) -> None:
        pass


class SequenceCache(list):
    """One sequence's caches, a ``LayerCache`` per layer in layer order: what
    mlx-lm's models take as ``cache``, and what an agent's memory holds."""

    def __init__(self, layers: Iterable[LayerCache] = ()):
        super().__init__(layers)

    @property
    def offset(self) -> int:
        return self[0].offset if self else 0

    @property
    def trimmable_tokens(self) -> int:
        """Tokens every layer can drop from its end."""
        return min((c.trimmable_tokens for c in self), default=0)

    def checkpoints(self) -> list[int]:
        """Where every layer can go back to besides trimming: the recurrent
        layers' checkpoints that the other layers can be cut back to."""
        points = {at for c in self for at in c.rewind_points()}
        return sorted(at for at in points if all(c.can_rewind(at) for c in self))

    def rewind(self, tokens: int) -> None:
        """Cut back to the first ``tokens`` tokens: trim, or go back to the
        recurrent layers' checkpoint there (``checkpoints``)."""
        for c in self:
            c.rewind(tokens)

    def mark(self) -> None:
        """Checkpoint the layers that cannot be trimmed (recurrent states)."""
        for c in self:
            c.mark()

    def view(self, float_head: int | None = None) -> SequenceCache:
        """The caches as the engine attends over them (``LayerCache.view``): writes
        go to these records, so ``self`` is what a finished sequence hands back;
        the working copies go with the view."""
        return SequenceCache(c.view(float_head) for c in self)

    def arrays(self) -> list:
        """Every array the layers hold: what a step evaluates so graphs never grow."""
        return [c.arrays for c in self]

    def clone(self) -> SequenceCache:
        """An independent copy, cheap: MLX arrays are values, so fresh array
        objects share the data until either side writes."""

        def fresh(c):
            c = copy.copy(c)
            for name, value in vars(c).items():
                if isinstance(value, _BaseCache):
                    setattr(c, name, fresh(value))
                elif isinstance(value, (mx.array, tuple, list)):
                    setattr(c, name, tree_map(lambda x: x[...] if isinstance(x, mx.array) else x, value))
            return c

        return SequenceCache(fresh(c) for c in self)
