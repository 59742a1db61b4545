"""The engine's settings a server chooses (``EngineOptions``): one frozen
object from ``semantic serve``'s flags through ``Runtime.open`` and the GPU
actor to ``Engine``, one name each."""

from __future__ import annotations

from dataclasses import dataclass

from .engine import DECODE_ROWS

__all__ = ["EngineOptions"]


@dataclass(frozen=True)
class EngineOptions:
    """``Engine``'s keywords of the same names say what they do.
    ``prefill_chunk`` is 256 here, where the engine's own default is 512:
    docs/architecture.md, "Choices worth knowing"."""

    prefill_chunk: int = 256
    kv_bits: int = 4  # the agents' KV caches: 4 or 8 bits, or float (16); each keeps its own files
    decode_rows: int = DECODE_ROWS
    batch_prefill: bool = True
    speculation: bool = True

    def __post_init__(self):
        if self.kv_bits not in (4, 8, 16):
            raise ValueError(f"kv_bits must be 4, 8 or 16, not {self.kv_bits!r}")
        if self.decode_rows < 1:
            raise ValueError("decode_rows must be at least 1")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")
