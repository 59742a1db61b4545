"""Agents' working memory on one model: which caches are hot, what they
cost, and a turn run over them.

* ``agent_cache``: the hot set (``AgentCaches``): agents' Q4 caches in
  memory inside a byte budget, warm ones on disk, shared prefixes;
* ``block_pool``: which owners' caches fit in memory at once, in blocks;
* ``model_caches``: a loaded model's caches: whose they are on disk, the KV
  budget, the hot set opened on them;
* ``turns``: one agent turn over its cache: render, match the prefix, run,
  store.

The runtime's top room: imports ``engine``, ``store``, ``kv``, ``model``,
``text`` and the top modules; nothing else of the runtime imports it, the
packages above do.
"""
