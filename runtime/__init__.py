"""Compute and data, no actors: model loading, ModelCacheSpec, the batched Q4
KV cache, the engine, the cache file format, prefix matching, sampling.

The fast BLAS must be in place before anything imports ``mlx.core``, so this
package activates it first.
"""

from . import blas as _blas

_blas.activate()
