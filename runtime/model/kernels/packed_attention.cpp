// Attention over a sequence's packed past on the CPU (runtime/model/attention.py,
// PackedPast): the scores of query rows against keys stored by channel (a block's
// D channels of B token codes, groups along the tokens) and the mix of values
// stored by token (D channel codes, groups along the channels), 4 or 8 bits,
// MLX's affine format. MLX's CPU quantized matmul runs these layouts
// (transpose=False) one element at a time; here a group is unpacked into a few
// vector registers and summed into accumulators that stay in registers.
#include <algorithm>

#include "common.h"

namespace kernels {
namespace {

constexpr int ROWS = 4;  // query rows whose sums a pass keeps in registers

// A group of GS codes (GS * bits / 32 words) dequantized in lane order: deq[k * wpg
// + i] is code k of word i, element i * per + k, so each k is one vector loop.
template <int bits, int GS>
INLINE void dequantize_group(const uint32_t* __restrict__ w, float scale, float bias, float* __restrict__ deq) {
  constexpr int per = 32 / bits, wpg = GS / per;
  constexpr uint32_t mask = (1u << bits) - 1;
  for (int k = 0; k < per; ++k)
    for (int i = 0; i < wpg; ++i) deq[k * wpg + i] = scale * float((w[i] >> (k * bits)) & mask) + bias;
}

// sums[r][lane order] -> out[r * stride + element order], for `rows` rows.
template <int bits, int GS>
INLINE void store_rows(const float (&sums)[ROWS][GS], float* __restrict__ out, int64_t stride, int rows) {
  constexpr int per = 32 / bits, wpg = GS / per;
  for (int r = 0; r < rows; ++r)
    for (int k = 0; k < per; ++k)
      for (int i = 0; i < wpg; ++i) out[r * stride + i * per + k] = sums[r][k * wpg + i];
}

// sums[r] = sum over i < n of x[r * x_stride + i] times group g of item i's codes
// (codes + i * W, scale and bias [i * G + g]), for up to ROWS rows: an item is a
// key channel (scores: x the queries) or a token's values (mix: x the weights).
template <int bits, int GS>
INLINE void sum_group(const float* __restrict__ x, int64_t x_stride, int rows, int n, const uint32_t* __restrict__ codes,
                      const float* __restrict__ scales, const float* __restrict__ biases, int W, int G, int g,
                      float (&sums)[ROWS][GS]) {
  constexpr int wpg = GS * bits / 32;
  float deq[GS];
  for (int i = 0; i < n; ++i) {
    dequantize_group<bits, GS>(codes + int64_t(i) * W + g * wpg, scales[int64_t(i) * G + g],
                               biases[int64_t(i) * G + g], deq);
    for (int r = 0; r < ROWS; ++r) {
      const float a = r < rows ? x[r * x_stride + i] : 0.f;
      for (int c = 0; c < GS; ++c) sums[r][c] += a * deq[c];
    }
  }
}

// One KV head. q (R, D); kw (NB, D, W); ks, kb (NB, D, G); out (R, NB * B).
template <int bits, int GS>
KERNEL void head_scores(const float* q, int R, int D, const uint32_t* kw, const float* ks, const float* kb, int NB,
                        int B, float* out) {
  const int W = B * bits / 32, G = B / GS;
  for (int blk = 0; blk < NB; ++blk)
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; r += ROWS) {
        float sums[ROWS][GS] = {};
        sum_group<bits, GS>(q + int64_t(r) * D, D, std::min(ROWS, R - r), D, kw + int64_t(blk) * D * W,
                            ks + int64_t(blk) * D * G, kb + int64_t(blk) * D * G, W, G, g, sums);
        store_rows<bits, GS>(sums, out + int64_t(r) * NB * B + int64_t(blk) * B + g * GS, int64_t(NB) * B,
                             std::min(ROWS, R - r));
      }
}

// One KV head. w (R, T); vw (T, W); vs, vb (T, G); out (R, D).
template <int bits, int GS>
KERNEL void head_mix(const float* w, int R, int T, const uint32_t* vw, const float* vs, const float* vb, int D,
                     float* out) {
  const int W = D * bits / 32, G = D / GS;
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; r += ROWS) {
      float sums[ROWS][GS] = {};
      sum_group<bits, GS>(w + int64_t(r) * T, T, std::min(ROWS, R - r), T, vw, vs, vb, W, G, g, sums);
      store_rows<bits, GS>(sums, out + int64_t(r) * D + g * GS, D, std::min(ROWS, R - r));
    }
}

template <int bits>
void dispatch_scores(int gs, const float* q, int R, int D, const uint32_t* kw, const float* ks, const float* kb,
                     int NB, int B, float* out) {
  if (gs == 32) head_scores<bits, 32>(q, R, D, kw, ks, kb, NB, B, out);
  else if (gs == 64) head_scores<bits, 64>(q, R, D, kw, ks, kb, NB, B, out);
  else head_scores<bits, 128>(q, R, D, kw, ks, kb, NB, B, out);
}

template <int bits>
void dispatch_mix(int gs, const float* w, int R, int T, const uint32_t* vw, const float* vs, const float* vb, int D,
                  float* out) {
  if (gs == 32) head_mix<bits, 32>(w, R, T, vw, vs, vb, D, out);
  else if (gs == 64) head_mix<bits, 64>(w, R, T, vw, vs, vb, D, out);
  else head_mix<bits, 128>(w, R, T, vw, vs, vb, D, out);
}

// Scores (what = 0) or mix (what = 1): inputs (x, w, scales, biases), each (1, H, ...).
class PackedAttention : public mx::Primitive {
 public:
  PackedAttention(mx::Stream s, int what, int group_size, int bits)
      : mx::Primitive(s), what_(what), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([inputs, out, what = what_, gs = group_size_, bits = bits_]() mutable {
      Heads<float> x(inputs[0]);
      Heads<uint32_t> w(inputs[1]);
      auto s = floats(inputs[2]), b = floats(inputs[3]);
      const int H = inputs[0].shape(1);
      const int64_t sh = s.size() / H, oh = out.size() / H;
      for (int h = 0; h < H; ++h) {
        const float *sp = s.data() + h * sh, *bp = b.data() + h * sh;
        float* op = out.data<float>() + h * oh;
        if (what == 0) {  // x (1, H, R, D); w (1, H, NB, D, W)
          const int R = inputs[0].shape(2), D = inputs[0].shape(3), NB = inputs[1].shape(2);
          const int B = inputs[1].shape(4) * 32 / bits;
          (bits == 4 ? dispatch_scores<4> : dispatch_scores<8>)(gs, x[h], R, D, w[h], sp, bp, NB, B, op);
        } else {  // x (1, H, R, T); w (1, H, T, W)
          const int R = inputs[0].shape(2), T = inputs[0].shape(3), D = inputs[1].shape(3) * 32 / bits;
          (bits == 4 ? dispatch_mix<4> : dispatch_mix<8>)(gs, x[h], R, T, w[h], sp, bp, D, op);
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("packed attention kernels run on the CPU");
  }

  const char* name() const override { return "PackedAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const PackedAttention&>(other);
    return what_ == o.what_ && group_size_ == o.group_size_ && bits_ == o.bits_;
  }

 private:
  int what_, group_size_, bits_;
};

// What both kernels read: one sequence (1, H, ...), uint32 codes, a scale and
// a bias for each group of codes.
void check(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
           int group_size, int bits) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("packed attention: bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128)
    throw std::invalid_argument("packed attention: group size must be 32, 64 or 128");
  if (w.dtype() != mx::uint32) throw std::invalid_argument("packed attention: packed codes must be uint32");
  auto groups = w.shape();
  groups.back() = groups.back() * 32 / bits / group_size;
  if (x.ndim() < 2 || x.shape(0) != 1 || w.shape(0) != 1 || x.shape(1) != w.shape(1) ||
      scales.shape() != groups || biases.shape() != groups)
    throw std::invalid_argument("packed attention: one sequence's (1, H, ...) inputs, a scale and bias a group");
}

mx::array packed_scores(const mx::array& queries, const mx::array& w, const mx::array& scales,
                        const mx::array& biases, int group_size, int bits) {
  if (queries.ndim() != 4 || w.ndim() != 5 || queries.shape(3) != w.shape(3))
    throw std::invalid_argument("packed_scores: queries (1, H, R, D), keys (1, H, blocks, D, words)");
  check(queries, w, scales, biases, group_size, bits);
  auto s = mx::default_stream(mx::Device::cpu);
  mx::Shape shape = {queries.shape(0), queries.shape(1), queries.shape(2), w.shape(2) * w.shape(4) * 32 / bits};
  return mx::array(shape, mx::float32, std::make_shared<PackedAttention>(s, 0, group_size, bits),
                   {mx::astype(queries, mx::float32, s), w, scales, biases});
}

mx::array packed_mix(const mx::array& weights, const mx::array& w, const mx::array& scales, const mx::array& biases,
                     int group_size, int bits) {
  if (weights.ndim() != 4 || w.ndim() != 4 || weights.shape(3) != w.shape(2))
    throw std::invalid_argument("packed_mix: weights (1, H, R, T), values (1, H, T, words)");
  check(weights, w, scales, biases, group_size, bits);
  auto s = mx::default_stream(mx::Device::cpu);
  mx::Shape shape = {weights.shape(0), weights.shape(1), weights.shape(2), w.shape(3) * 32 / bits};
  return mx::array(shape, mx::float32, std::make_shared<PackedAttention>(s, 1, group_size, bits),
                   {mx::astype(weights, mx::float32, s), w, scales, biases});
}

}  // namespace

void add_attention(nb::module_& m) {
  using namespace nb::literals;
  m.def("packed_scores", &packed_scores, "queries"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a,
        "Scores (1, H, R, blocks * B) of queries (1, H, R, D) against keys packed by channel.");
  m.def("packed_mix", &packed_mix, "weights"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a,
        "Weights (1, H, R, T) times values packed by token: (1, H, R, D).");
}

}  // namespace kernels
