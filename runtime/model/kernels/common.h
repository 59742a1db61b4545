// What the CPU kernels share: MLX's extension API, the x86-64 build that
// picks its vectors at load, and inputs read head by head.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
namespace nb = nanobind;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// One build for every x86-64 CPU: the loader picks the widest vectors it has.
#define KERNEL __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define KERNEL
#endif
#define INLINE __attribute__((always_inline)) static inline

namespace kernels {

// An input head by head: its own memory where each head's elements are
// contiguous (a record's blocks sliced along the tokens are), else a copy.
template <typename T>
struct Heads {
  std::vector<T> copy;
  const T* base;
  int64_t stride;

  Heads(const mx::array& a) {  // a: (1, H, ...)
    int64_t inner = 1;
    bool contiguous = true;
    for (int d = a.ndim() - 1; d >= 2; --d) {
      contiguous &= a.shape(d) == 1 || a.strides()[d] == inner;
      inner *= a.shape(d);
    }
    if (contiguous) {
      base = a.data<T>(), stride = a.strides()[1];
      return;
    }
    copy.resize(a.size());
    std::vector<int64_t> at(a.ndim(), 0);
    for (size_t n = 0; n < a.size(); ++n) {
      int64_t offset = 0;
      for (int d = 0; d < a.ndim(); ++d) offset += at[d] * a.strides()[d];
      copy[n] = a.data<T>()[offset];
      for (int d = a.ndim() - 1; d >= 0 && ++at[d] == a.shape(d); --d) at[d] = 0;
    }
    base = copy.data(), stride = inner;
  }
  const T* operator[](int h) const { return base + h * stride; }
};

// Scales or biases (1, H, ...) as float32, head after head.
inline std::vector<float> floats(const mx::array& a) {
  auto convert = [&](auto tag) {
    using T = decltype(tag);
    Heads<T> heads(a);
    const int H = a.shape(1);
    const int64_t n = a.size() / H;
    std::vector<float> out(a.size());
    for (int h = 0; h < H; ++h)
      for (int64_t i = 0; i < n; ++i) out[h * n + i] = float(heads[h][i]);
    return out;
  };
  switch (a.dtype()) {
    case mx::float16: return convert(mx::float16_t{});
    case mx::bfloat16: return convert(mx::bfloat16_t{});
    case mx::float32: return convert(float{});
    default: throw std::invalid_argument("packed attention: scales and biases must be floats");
  }
}

void add_attention(nb::module_& m);
void add_blocks(nb::module_& m);

}  // namespace kernels
