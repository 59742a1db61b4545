"""Recurrent layers (linear attention: Qwen3-Next's and Qwen3.5's Gated
DeltaNet): ``StateCache``, a fixed-size state with checkpoints to go back to."""

from __future__ import annotations

from mlx_lm.models.cache import ArraysCache

from ..cache_records import FLOATS
from ..model.model_spec import STATE_CHECKPOINTS
from .kinds import register

__all__ = ["StateCache"]

STATE = "state"


@register
class StateCache(ArraysCache):
    """A recurrent layer's state (linear attention: Qwen3-Next's and Qwen3.5's
    Gated DeltaNet) for one sequence: mlx-lm's ``ArraysCache``, counting the
    tokens it has seen (the layer calls ``advance``). A fixed size whatever the
    context, full precision.

    A state cannot be cut back, so it keeps checkpoints instead: the engine
    ``mark``s it when a turn starts (the cached conversation so far) and when
    the turn's prompt is in (before the reply); the last ``STATE_CHECKPOINTS``
    are kept. A turn that diverges from the cached text goes back (``rewind``) to
    the latest checkpoint at or before the divergence -- the reply re-rendered
    differently, the last message edited -- instead of starting cold. The
    arrays are values: a checkpoint holds references, no copy."""

    KINDS = (STATE,)
    recurrent, float_keys, attends_new, blocked = True, False, False, False

    def __init__(self, size: int):
        super().__init__(size)
        self.offset = 0
        self.checkpoints: list[tuple[int, list]] = []  # (tokens seen, the state then), oldest first
        self.trail: list[list] = []  # the state after each slot of a decode step with drafts, until ``cut``

    def advance(self, N):
        super().advance(N)
        self.offset += N

    def mark(self) -> None:
        if self.offset and (not self.checkpoints or self.checkpoints[-1][0] != self.offset):
            self.checkpoints = [*self.checkpoints, (self.offset, list(self.cache))][-STATE_CHECKPOINTS:]

    def rewind(self, tokens: int) -> None:
        """Go back to the checkpoint at ``tokens`` (or stay, if already there)."""
        if self.offset == tokens:
            return
        state = dict(self.checkpoints).get(tokens)
        if state is None:
            raise ValueError(f"no checkpoint at {tokens} tokens to go back to")
        self.offset, self.cache = tokens, list(state)
        self.checkpoints = [c for c in self.checkpoints if c[0] <= tokens]

    def cut(self, n: int) -> None:
        """Go back ``n`` tokens within the last decode step (drafts rejected:
        ``runtime.engine.speculation``), to the state after its slot before them;
        the step's trail is forgotten either way."""
        if not 0 <= n < max(len(self.trail), 1):
            raise ValueError(f"the last step ran {len(self.trail)} tokens here: {n} cannot be cut")
        if n:
            self.cache, self.offset = list(self.trail[-1 - n]), self.offset - n
        self.trail = []

    def make_mask(self, N: int, **kwargs):
        return None  # one sequence, no padding: nothing to mask

    def is_trimmable(self):
        return False

    def trim(self, n):
        return 0

    @property
    def arrays(self) -> list:
        """The state's arrays, and its checkpoints'."""
        held = [*self.cache, *(x for _, state in self.checkpoints for x in state)]
        return [x for x in held if x is not None]

    @property
    def nbytes(self):
        return sum(x.nbytes for x in {id(x): x for x in self.arrays}.values())

    @property
    def trimmable_tokens(self) -> int:
        return 0

    def rewind_points(self) -> list[int]:
        return [at for at, _ in self.checkpoints]

    def can_rewind(self, tokens: int) -> bool:
        return tokens == self.offset or tokens in self.rewind_points()

    def view(self, float_head=None):
        return self

    def describe(self):
        entry = {"kind": STATE, "offset": self.offset, "size": len(self.cache),
                 "checkpoints": self.rewind_points()}
        held = [self.cache, *(state for _, state in self.checkpoints)]
        rings = zip(self.ring_names(entry), (x for state in held for x in state))
        return entry, {}, {name: x for name, x in rings if x is not None}

    @classmethod
    def rebuild(cls, entry, arrays):
        c = cls(entry["size"])
        c.cache = [arrays.get(str(j)) for j in range(entry["size"])]
        c.offset = entry["offset"]
        c.checkpoints = [(at, [arrays.get(f"c{k}.{j}") for j in range(entry["size"])])
                         for k, at in enumerate(entry["checkpoints"])]
        return c

    @classmethod
    def check_entry(cls, entry, n):
        tensors, size, marks = entry["tensors"], entry.get("size"), entry.get("checkpoints")
        if not (type(size) is int and 0 < size <= 16 and isinstance(marks, list) and len(marks) <= 16
                and all(type(at) is int and 0 < at <= n for at in marks) and marks == sorted(set(marks))
                and set(tensors) <= set(cls.ring_names(entry))):
            raise ValueError("bad state entries")
        if any(t[0] not in FLOATS for t in tensors.values()) or bool(tensors) != bool(n):
            raise ValueError("missing or bad state tensors")

    @classmethod
    def blocked_names(cls, entry):
        return []

    @classmethod
    def ring_names(cls, entry):
        """The state's arrays, then its checkpoints'."""
        n = range(entry["size"])
        return [*map(str, n), *(f"c{k}.{j}" for k in range(len(entry["checkpoints"])) for j in n)]

    @classmethod
    def replacing(cls, cache, bits, group_size):
        return cls(len(cache.cache)) if type(cache) is ArraysCache else None
