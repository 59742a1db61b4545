"""A model loaded, and what it computes with on this machine.

* ``blas``: a fast BLAS for MLX, picked and loaded before MLX is first
  imported (the runtime's ``__init__`` activates it);
* ``device``: what this machine computes with: device, MLX, BLAS, speed;
* ``embedded``: the embedded SmolLM2, prepared once from its GGUF;
* ``models``: a model's name resolved, and the model loaded for the device;
* ``model_spec``: ``ModelCacheSpec``, the shape of a model's KV cache, read
  off the model;
* ``fastmath``: ``exp`` the way MLX's CPU runs it fast, and what is built
  from it;
* ``attention``: attention over float keys and values on the CPU, and over
  a packed past;
* ``kernels/``: the CPU kernels that read a packed past and close and open
  its blocks (C++, an MLX extension ``setup.py`` builds as ``_packed``);
* ``rotary``: rotary position embeddings at a few ops a call;
* ``lean``: CPU forms of RMSNorm, the SwiGLU MLP and linear weights.

Imports nothing of the runtime but the modules at its top. Every other
room of the runtime may import it, and so may the packages above.
"""
