"""Compute and data, no actors or event loops: a model loaded, its KV
caches, the batched engine, the cache files, agents' memory. Each room is
a subpackage with one job, over the rooms it imports:

* ``memory/``: agents' working memory on one model: the hot set, its block
  budget, a loaded model's caches, and a turn run over them;
* ``engine/``: the batched engine: sequences prefilled and decoded
  together, sampled and drafted, each row computed as it would be alone;
* ``store/``: agents' caches on disk: the files, their manifest, version 1
  files, the directory's budget;
* ``kv/``: a sequence's KV cache, one class a kind;
* ``model/``: a model loaded, and what it computes with: the BLAS, the
  device, the embedded model, ``ModelCacheSpec``, fast CPU forms of its ops;
* ``text/``: text in and out: JSON read from outside, the grammar a reply
  follows, a reply's text as it streams, a prompt's prefix matched on text;
* ``errors``: errors meant for users;
* ``outcome``: what a finished turn reports;
* ``paths``: where Semantic keeps its files;
* ``files``: files a crash never leaves half written, and trees of them;
* ``cache_records``: what an agent's cache on disk is: the format's names
  and limits, its records and errors (the KV cache and the store share it).

``memory`` is over ``engine`` and ``store`` (which do not import each
other), over ``kv``, over ``model`` and ``text`` (which do not either);
the modules at this top import only one another (``lint-imports``,
contracts in ``pyproject.toml``; ``docs/architecture.md``, "Packages").

The fast BLAS must be in place before anything imports ``mlx.core``, so this
package activates it first.
"""

from .model import blas as _blas

_blas.activate()
