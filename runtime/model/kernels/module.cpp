// The module setup.py builds: runtime/model/_packed.
#include "common.h"

NB_MODULE(_packed, m) {
  m.attr("mlx_version") = MLX_PYTHON_VERSION;  // the MLX this was built against
  kernels::add_attention(m);
  kernels::add_blocks(m);
}
