"""The batched engine: many sequences, each with its own Q4 KV cache,
run together, each row computed exactly as it would be alone.

* ``engine``: ``Engine``, which the GPU actor drives step by step;
* ``engine_options``: the engine's settings a server chooses
  (``EngineOptions``);
* ``prefill``: the prefill queue: prompts fed a chunk a forward;
* ``decode``: the decode batch: every decoding sequence's next token and
  drafts, a step built while the last computes;
* ``sequence``: a running sequence, each step's news and its end;
* ``sampling``: per-sequence sampling, its grammar and log-probabilities;
* ``speculation``: exact speculative decoding: drafts from an agent's own
  memory, verified inside the batch;
* ``evaluator``: decode steps evaluated on a thread of their own;
* ``batch_cache``: many sequences' Q4 caches in one forward;
* ``rowwise``: attention per sequence inside a batched forward;
* ``row_plans``: how each matmul takes its rows, the same at every count;
* ``row_counts``: which row counts a decode forward may use, measured when
  a model loads;
* ``calibration``: which batches leave a sequence's logits as alone,
  measured through the engine's forwards.

``engine`` is over ``prefill`` and ``decode`` (which do not import each
other), over ``sequence``, over the KV cache. Imports ``kv``, ``model``,
``text`` and the runtime's top modules, never ``store`` or ``memory``;
``memory`` and the packages above import it.
"""
