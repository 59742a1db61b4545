// Closing and opening a quantized cache's blocks on the CPU (runtime/kv/quantize.py):
// a full block's float32 keys quantized per channel (groups along its tokens) and
// its values per token, in one pass each, bit for bit what mx.quantize makes of
// them (MLX's CPU `quantize`, reproduced step by step, with scales and biases
// stored as float16); and blocks unpacked back to float32, bit for bit what
// mx.dequantize makes: a code times its scale, then plus its bias (this file is
// compiled without contracting the two into one fused multiply-add).
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

#include <nanobind/stl/vector.h>

#include "common.h"

namespace kernels {
namespace {

static_assert(std::endian::native == std::endian::little, "a word's codes are read as bytes, low nibble first");

constexpr int MAX_D = 512;  // head size a block's channels are kept on the stack for

// std::min and std::max on values, which vectorise where the references do not.
INLINE float lesser(float a, float b) { return b < a ? b : a; }
INLINE float greater(float a, float b) { return a < b ? b : a; }

// MLX's affine scale and bias of a group with extremes lo and hi (its CPU quantize).
INLINE void scale_bias(float lo, float hi, float n_bins, float& scale, float& bias) {
  const bool mask = std::abs(lo) > std::abs(hi);
  float s = greater((hi - lo) / n_bins, 1e-7f);
  s = mask ? s : -s;
  const float edge = mask ? lo : hi;
  const float q0 = std::rint(edge / s);
  scale = q0 != 0 ? edge / q0 : s;
  bias = q0 != 0 ? edge : 0.f;
}

INLINE uint32_t code(float x, float scale, float bias, float n_bins) {
  return uint32_t(lesser(greater(std::rint((x - bias) / scale), 0.f), n_bins));
}

// The least and greatest of GS floats, in LANES running extremes (vectors) then
// across them: the same two values as one pass in order, as neither the order
// nor a zero's sign changes what scale_bias makes of them.
template <int GS>
INLINE void extremes(const float* x, float& lo, float& hi) {
  constexpr int LANES = 16;
  float l[LANES], h[LANES];
  std::fill(l, l + LANES, std::numeric_limits<float>::infinity());
  std::fill(h, h + LANES, -std::numeric_limits<float>::infinity());
  for (int e = 0; e < GS; e += LANES)
    for (int i = 0; i < LANES; ++i) {
      h[i] = greater(h[i], x[e + i]);
      l[i] = lesser(l[i], x[e + i]);
    }
  lo = l[0], hi = h[0];
  for (int i = 1; i < LANES; ++i) lo = lesser(lo, l[i]), hi = greater(hi, h[i]);
}

// One head's block: keys (B, D) and values (B, DV) rows (row t of keys at k + t * D;
// rows before `sinks` read as row `sinks`). Keys out by channel: kw (D, B * bits / 32),
// ks and kb (D, B / GS); values by token: vw (B, DV * bits / 32), vs and vb (B, DV / GS).
template <int bits, int GS>
KERNEL void close_head(const float* k, const float* v, int B, int D, int DV, int sinks, uint32_t* kw, mx::float16_t* ks,
                       mx::float16_t* kb, uint32_t* vw, mx::float16_t* vs, mx::float16_t* vb) {
  constexpr int per = 32 / bits;
  constexpr float n_bins = (1 << bits) - 1;
  const int KW = B / per, KG = B / GS;
  float lo[MAX_D], hi[MAX_D], scale[MAX_D], bias[MAX_D];
  uint32_t word[MAX_D];
  auto row = [&](int t) { return k + int64_t(std::max(t, sinks)) * D; };
  for (int g = 0; g < KG; ++g) {  // keys: each channel's group of GS tokens, every channel at once
    std::fill(lo, lo + D, std::numeric_limits<float>::infinity());
    std::fill(hi, hi + D, -std::numeric_limits<float>::infinity());
    for (int t = g * GS; t < (g + 1) * GS; ++t) {
      const float* x = row(t);
      for (int c = 0; c < D; ++c) {
        hi[c] = greater(hi[c], x[c]);
        lo[c] = lesser(lo[c], x[c]);
      }
    }
    for (int c = 0; c < D; ++c) {
      scale_bias(lo[c], hi[c], n_bins, scale[c], bias[c]);
      ks[c * KG + g] = mx::float16_t(scale[c]);
      kb[c * KG + g] = mx::float16_t(bias[c]);
    }
    for (int j = g * GS / per; j < (g + 1) * GS / per; ++j) {
      std::fill(word, word + D, 0u);
      for (int i = 0; i < per; ++i) {
        const float* x = row(j * per + i);
        for (int c = 0; c < D; ++c) word[c] |= code(x[c], scale[c], bias[c], n_bins) << (i * bits);
      }
      for (int c = 0; c < D; ++c) kw[int64_t(c) * KW + j] = word[c];
    }
  }
  const int VW = DV / per, VG = DV / GS;
  uint32_t codes[GS];
  for (int t = 0; t < B; ++t) {  // values: each token's groups of GS channels
    for (int g = 0; g < VG; ++g) {
      const float* x = v + int64_t(t) * DV + g * GS;
      float l, h, s, b;
      extremes<GS>(x, l, h);
      scale_bias(l, h, n_bins, s, b);
      vs[int64_t(t) * VG + g] = mx::float16_t(s);
      vb[int64_t(t) * VG + g] = mx::float16_t(b);
      for (int e = 0; e < GS; ++e) codes[e] = code(x[e], s, b, n_bins);
      for (int j = 0; j < GS / per; ++j) {
        uint32_t w = 0;
        for (int i = 0; i < per; ++i) w |= codes[j * per + i] << (i * bits);
        vw[int64_t(t) * VW + g * GS / per + j] = w;
      }
    }
  }
}

// One head's blocks unpacked: NB blocks of keys by channel (kw (NB, D, B * bits / 32),
// scales and biases (NB, D, B / GS)) into token rows k (NB * B, D); values by token
// (vw (T, DV * bits / 32), scales and biases (T, DV / GS)) into v (T, DV).
template <int bits, int GS>
KERNEL void open_head(const uint32_t* kw, const float* ks, const float* kb, const uint32_t* vw, const float* vs,
                      const float* vb, int NB, int B, int D, int DV, float* k, float* v) {
  constexpr int per = 32 / bits;
  constexpr uint32_t mask = (1u << bits) - 1;
  const int KW = B / per, KG = B / GS;
  uint32_t word[MAX_D];
  float scale[MAX_D], bias[MAX_D];
  for (int blk = 0; blk < NB; ++blk) {  // keys: a word of every channel at a time, then its tokens' rows
    const int64_t first = int64_t(blk) * D;
    for (int j = 0; j < KW; ++j) {
      if (j * per % GS == 0)
        for (int c = 0; c < D; ++c) {
          scale[c] = ks[(first + c) * KG + j * per / GS];
          bias[c] = kb[(first + c) * KG + j * per / GS];
        }
      for (int c = 0; c < D; ++c) word[c] = kw[(first + c) * KW + j];
      for (int i = 0; i < per; ++i) {
        float* out = k + (int64_t(blk) * B + j * per + i) * D;
        for (int c = 0; c < D; ++c) out[c] = float((word[c] >> (i * bits)) & mask) * scale[c] + bias[c];
      }
    }
  }
  const int64_t T = int64_t(NB) * B;
  const int VG = DV / GS;
  for (int64_t t = 0; t < T; ++t) {  // values: a token's codes (bytes, low nibble first), then scaled
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(vw + t * DV / per);
    float* out = v + t * DV;
    if constexpr (bits == 4)
      for (int m = 0; m < DV / 2; ++m) out[2 * m] = float(bytes[m] & 15), out[2 * m + 1] = float(bytes[m] >> 4);
    else
      for (int m = 0; m < DV; ++m) out[m] = float(bytes[m]);
    for (int g = 0; g < VG; ++g) {
      const float s = vs[t * VG + g], b = vb[t * VG + g];
      for (int e = g * GS; e < (g + 1) * GS; ++e) out[e] = out[e] * s + b;
    }
  }
}

template <template <int, int> class F, typename... A>
void by_format(int bits, int gs, A... args) {
  auto run = [&](auto tag) {
    constexpr int b = decltype(tag)::value;
    if (gs == 32) F<b, 32>::run(args...);
    else if (gs == 64) F<b, 64>::run(args...);
    else F<b, 128>::run(args...);
  };
  if (bits == 4) run(std::integral_constant<int, 4>{});
  else run(std::integral_constant<int, 8>{});
}

template <int bits, int GS>
struct Close {
  template <typename... A>
  static void run(A... args) { close_head<bits, GS>(args...); }
};

template <int bits, int GS>
struct Open {
  template <typename... A>
  static void run(A... args) { open_head<bits, GS>(args...); }
};

// close (what = 0): inputs keys (1, H, B, D), values (1, H, B, DV); outputs close_block's six rows.
// open (what = 1): inputs those six rows of whole blocks, float32 keys and values of the first S rows to
// take the place of theirs (the sinks), then of N rows to follow them; outputs keys (1, H, R, D) and values
// (1, H, R, DV): the T rows unpacked (the first S replaced), the N rows, then R - T - N rows not written.
class PackedBlocks : public mx::Primitive {
 public:
  PackedBlocks(mx::Stream s, int what, int group_size, int bits, int block, int sinks)
      : mx::Primitive(s), what_(what), group_size_(group_size), bits_(bits), block_(block), sinks_(sinks) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    for (auto& out : outputs) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      encoder.set_output_array(out);
    }
    encoder.dispatch([inputs, outputs, what = what_, gs = group_size_, bits = bits_, block = block_,
                      sinks = sinks_]() mutable {
      const int H = inputs[0].shape(1);
      if (what == 0) {
        Heads<float> k(inputs[0]), v(inputs[1]);
        const int B = inputs[0].shape(2), D = inputs[0].shape(3), DV = inputs[1].shape(3);
        auto at = [&](int i, int h) { return outputs[i].size() / H * h; };
        for (int h = 0; h < H; ++h)
          by_format<Close>(bits, gs, k[h], v[h], B, D, DV, sinks, outputs[0].data<uint32_t>() + at(0, h),
                           outputs[1].data<mx::float16_t>() + at(1, h), outputs[2].data<mx::float16_t>() + at(2, h),
                           outputs[3].data<uint32_t>() + at(3, h), outputs[4].data<mx::float16_t>() + at(4, h),
                           outputs[5].data<mx::float16_t>() + at(5, h));
      } else {
        Heads<uint32_t> kw(inputs[0]), vw(inputs[3]);
        Heads<float> sk(inputs[6]), sv(inputs[7]), tk(inputs[8]), tv(inputs[9]);
        auto ks = floats(inputs[1]), kb = floats(inputs[2]), vs = floats(inputs[4]), vb = floats(inputs[5]);
        const int64_t T = inputs[0].shape(2), S = inputs[6].shape(2), N = inputs[8].shape(2);
        const int64_t R = outputs[0].shape(2);
        const int64_t D = outputs[0].shape(3), DV = outputs[1].shape(3);
        const int64_t k_groups = ks.size() / H, v_groups = vs.size() / H;
        for (int h = 0; h < H; ++h) {
          float* k = outputs[0].data<float>() + h * R * D;
          float* v = outputs[1].data<float>() + h * R * DV;
          by_format<Open>(bits, gs, kw[h], ks.data() + h * k_groups, kb.data() + h * k_groups, vw[h],
                          vs.data() + h * v_groups, vb.data() + h * v_groups, int(T / block), block, int(D),
                          int(DV), k, v);
          std::copy_n(sk[h], S * D, k);  // the first rows' floats, kept beside the blocks
          std::copy_n(sv[h], S * DV, v);
          std::copy_n(tk[h], N * D, k + T * D);  // the rows after the blocks, as they are
          std::copy_n(tv[h], N * DV, v + T * DV);
        }  // (rows from T + N on are left unwritten: room to write into, never read before)
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("packed block kernels run on the CPU");
  }

  const char* name() const override { return "PackedBlocks"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const PackedBlocks&>(other);
    return what_ == o.what_ && group_size_ == o.group_size_ && bits_ == o.bits_ && block_ == o.block_ &&
           sinks_ == o.sinks_;
  }

 private:
  int what_, group_size_, bits_, block_, sinks_;
};

void check_format(int group_size, int bits, int block, int D) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("packed blocks: bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128)
    throw std::invalid_argument("packed blocks: group size must be 32, 64 or 128");
  if (block <= 0 || block % group_size || block > 1024 || D <= 0 || D % group_size || D > MAX_D)
    throw std::invalid_argument("packed blocks: a block and a head size of whole groups, at most 1024 and 512");
}

std::vector<mx::array> close_block(const mx::array& keys, const mx::array& values, int group_size, int bits,
                                   int sinks) {
  if (keys.ndim() != 4 || values.ndim() != 4 || keys.shape(0) != 1 || keys.shape(1) != values.shape(1) ||
      keys.shape(2) != values.shape(2) || keys.dtype() != mx::float32 || values.dtype() != mx::float32)
    throw std::invalid_argument("close_block: one sequence's float32 keys and values (1, H, block, D)");
  const int H = keys.shape(1), B = keys.shape(2), D = keys.shape(3), DV = values.shape(3);
  check_format(group_size, bits, B, D);
  check_format(group_size, bits, B, DV);
  if (sinks < 0 || sinks >= group_size) throw std::invalid_argument("close_block: sinks within the first group");
  const int per = 32 / bits, groups = D / group_size, v_groups = DV / group_size;
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::Shape> shapes = {{1, H, B, D / per}, {1, H, B, groups}, {1, H, B, groups},
                                   {1, H, B, DV / per}, {1, H, B, v_groups}, {1, H, B, v_groups}};
  std::vector<mx::Dtype> dtypes = {mx::uint32, mx::float16, mx::float16, mx::uint32, mx::float16, mx::float16};
  return mx::array::make_arrays(std::move(shapes), dtypes,
                                std::make_shared<PackedBlocks>(s, 0, group_size, bits, B, sinks), {keys, values});
}

std::vector<mx::array> open_blocks(const mx::array& kw, const mx::array& ks, const mx::array& kb,
                                   const mx::array& vw, const mx::array& vs, const mx::array& vb,
                                   const mx::array& sinks_k, const mx::array& sinks_v, const mx::array& tail_k,
                                   const mx::array& tail_v, int rows, int group_size, int bits, int block) {
  if (kw.ndim() != 4 || vw.ndim() != 4 || kw.shape(0) != 1 || kw.dtype() != mx::uint32 ||
      vw.dtype() != mx::uint32 || vw.shape(0) != 1 || vw.shape(1) != kw.shape(1) || vw.shape(2) != kw.shape(2))
    throw std::invalid_argument("open_blocks: one sequence's packed rows (1, H, tokens, words)");
  const int H = kw.shape(1), T = kw.shape(2), D = kw.shape(3) * 32 / bits, DV = vw.shape(3) * 32 / bits;
  check_format(group_size, bits, block, D);
  check_format(group_size, bits, block, DV);
  const mx::Shape groups = {1, H, T, D / group_size}, v_groups = {1, H, T, DV / group_size};
  if (T % block || ks.shape() != groups || kb.shape() != groups || vs.shape() != v_groups || vb.shape() != v_groups)
    throw std::invalid_argument("open_blocks: whole blocks, a scale and a bias a group");
  auto rows_of = [&](const mx::array& k, const mx::array& v) {
    const int n = k.ndim() == 4 ? k.shape(2) : -1;
    const bool ok = n >= 0 && k.dtype() == mx::float32 && v.dtype() == mx::float32 &&
                    k.shape() == mx::Shape{1, H, n, D} && v.shape() == mx::Shape{1, H, n, DV};
    return ok ? n : -1;
  };
  const int S = rows_of(sinks_k, sinks_v), N = rows_of(tail_k, tail_v);
  if (S < 0 || N < 0 || S > T || rows < T + N)
    throw std::invalid_argument("open_blocks: float32 rows (1, H, n, D) for the first rows and to follow, "
                                "and room for them");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays({{1, H, rows, D}, {1, H, rows, DV}}, {mx::float32, mx::float32},
                                std::make_shared<PackedBlocks>(s, 1, group_size, bits, block, 0),
                                {kw, ks, kb, vw, vs, vb, sinks_k, sinks_v, tail_k, tail_v});
}

}  // namespace

void add_blocks(nb::module_& m) {
  using namespace nb::literals;
  m.def("close_block", &close_block, "keys"_a, "values"_a, "group_size"_a, "bits"_a, "sinks"_a,
        "A full block's float32 keys (1, H, B, D) and values (1, H, B, DV) as runtime.kv.quantize.close_block lays them out.");
  m.def("open_blocks", &open_blocks, "kw"_a, "ks"_a, "kb"_a, "vw"_a, "vs"_a, "vb"_a, "sinks_k"_a, "sinks_v"_a,
        "tail_k"_a, "tail_v"_a, "rows"_a, "group_size"_a, "bits"_a, "block"_a,
        "Whole blocks of close_block's rows unpacked, their first rows those of sinks_k and sinks_v (1, H, S, "
        "D), then the rows of tail_k and tail_v (1, H, N, D): float32 keys (1, H, rows, D) and values (1, H, "
        "rows, DV), the rows after those not written.");
}

}  // namespace kernels
