"""Agents' caches on disk, kept between turns: the files, what names them,
and the directory they are kept in.

* ``cache_file``: one directory per (agent, model): immutable token blocks
  and a manifest that names them, written and read;
* ``cache_manifest``: the manifest: its bytes sealed, read back, checked;
* ``cache_codec``: the MLX side: a cache's tensors as the bytes of blocks
  and a ring, and caches rebuilt from them;
* ``cache_v1``: version 1 files: listed, verified and archived, never loaded;
* ``disk``: the cache directory: what it holds, how much it may hold, what
  to prune.

The format's names, records and errors are the runtime's ``cache_records``,
which the KV cache shares. Imports ``kv``, ``text`` and the runtime's top
modules, never ``engine`` or ``memory``; ``memory`` and the packages above
import it.
"""
