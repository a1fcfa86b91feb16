// Linear layers in bf16 on CPUs with AMX tiles (Intel Sapphire Rapids and later):
// y = x . W^T (+ b), fp32 sums, rounded to bf16 once.
//
// Why not oneDNN, which the model uses elsewhere: at the row counts of decoding (1 to a few
// hundred rows) its bf16 product costs 25-45 us a call even for a 256 x 256 weight with
// the weight prepacked (the demo models' shapes; measured in docs/benchmarks.md), several
// times what the tiles take, and a forward makes 4 such calls a layer.
//
// The weight is packed once, at load: W [N, K] becomes [ceil(N/16)][ceil(K/32) * 16][16][2],
// zero-padded: for each block of 16 output features, each pair of input features (k, k+1)
// is one 64-byte row holding the 16 features' two weights side by side, the layout of a
// tile's second operand (B). A tile product then takes 16 rows of x by 32 inputs (A) and
// such a block's 16 rows (B), adding to a 16 x 16 fp32 block of y (C).
//
// Each row of y is computed the same way whatever the other rows are: 32 inputs a tile
// product, in order, into fp32. So a token's result does not depend on how many rows its
// batch has (a decode step or a verification window, one row or sixty-four), which oneDNN
// does not promise; a test holds the op to it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"

namespace {

constexpr int64_t K_TILE = 32;    // inputs per tile product (bf16 pairs: 16 rows of 64 bytes)
constexpr int64_t N_BLOCK = 16;   // output features per block of the packed weight
// Rows of x whose products run over all features in turn: as many as fill half of L1 (32
// KB), since the tiles read them again for every pair of feature blocks; at least 32
inline int64_t row_chunk(int64_t Kp) { return std::max<int64_t>(32, (16384 / Kp) / 32 * 32); }

// [N, K] -> the packed layout above (any CPU: it is plain indexing)
at::Tensor pack_linear_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "pack_linear_weight: needs a 2-d bf16 weight [out, in]");
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t Np = (N + N_BLOCK - 1) / N_BLOCK * N_BLOCK;
  const int64_t Kp = (K + K_TILE - 1) / K_TILE * K_TILE;
  auto padded = at::zeros({Np, Kp}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({Np / N_BLOCK, N_BLOCK, Kp / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(BS_HAVE_AMX_TILES)
#define BS_AMX_LINEAR \
  __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

// Tiles: 0, 1 rows of x (A); 2, 3 blocks of the weight (B); 4..7 blocks of y (C).

// 16 fp32 values rounded to bf16 (to nearest even) at y, the first `count` of them: as bf16
// (Out uint16_t), or as the fp32 values of those bf16 numbers (Out float: what .float() of
// the bf16 result gives, without a second pass over it)
template <typename Out>
BS_AMX_LINEAR inline void store_row(Out* y, const float* c, const float* bias, int64_t count) {
  __m512 v = _mm512_load_ps(c);
  if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
  const __mmask16 mask = count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
  const __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  if constexpr (std::is_same_v<Out, float>)
    _mm512_mask_storeu_epi32(y, mask, _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
  else
    _mm256_mask_storeu_epi16(y, mask, b);
}

// Features' blocks [nb0, nb1) of y. rows(r): the address of x's row r, r a multiple of 16
// (16 rows at a stride of lda elements from there); bias fp32 [Np] or null.
template <typename Rows, typename Out>
BS_AMX_LINEAR void linear_blocks(Rows rows, int64_t M, int64_t Kp, const uint16_t* wp,
                                 int64_t nb0, int64_t nb1, const float* bias, Out* y,
                                 int64_t N) {
  bs::configure_tiles();
  alignas(64) float c[4][16 * 16];
  const int64_t kt = Kp / K_TILE, block = Kp / 2 * 32;   // elements of one packed block
  const int64_t chunk = row_chunk(Kp);
  for (int64_t mc = 0; mc < M; mc += chunk) {
    const int64_t mend = std::min(M, mc + chunk);
    for (int64_t nb = nb0; nb < nb1; nb += 2) {
      const bool two = nb + 1 < nb1;
      const uint16_t* b0 = wp + nb * block;
      const uint16_t* b1 = b0 + block;
      for (int64_t m = mc; m < mend; m += 32) {
        const bool pair = m + 16 < mend;
        const auto [a0, lda0] = rows(m);
        const uint16_t* a1 = (pair ? rows(m + 16) : rows(m)).first;
        // (a pair's rows share a stride: both in place in x, or both in the padded copy)
        void* const tiles[4] = {c[0], c[1], c[2], c[3]};
        bs::tile_products_2x2<false>(reinterpret_cast<const uint8_t*>(a0),
                                     reinterpret_cast<const uint8_t*>(a1), lda0 * 2,
                                     reinterpret_cast<const uint8_t*>(b0),
                                     reinterpret_cast<const uint8_t*>(b1), kt, pair, two, tiles);
        for (int t = 0; t < 4; ++t) {
          if (((t & 1) && !two) || ((t & 2) && !pair)) continue;
          const int64_t n = (nb + (t & 1)) * N_BLOCK, r0 = m + (t & 2 ? 16 : 0);
          const int64_t r1 = std::min(r0 + 16, M);
          for (int64_t r = r0; r < r1; ++r)
            store_row(y + r * N + n, c[t] + (r - r0) * 16, bias ? bias + n : nullptr, N - n);
        }
      }
    }
  }
  _tile_release();
}
#endif

// x [..., in_features] bf16 -> [..., out_features]; packed from pack_linear_weight of
// [out_features, in_features]. float_out: the result as fp32 (each value still rounded to
// bf16), for logits, which the engine reads in fp32
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, int64_t in_features,
                         int64_t out_features, const std::optional<at::Tensor>& bias,
                         bool float_out) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  packed.dim() == 4 && packed.is_contiguous(),
              "linear_packed: bf16 input and a weight from pack_linear_weight");
  const int64_t K = x.size(-1), Kp = packed.size(1) * 2, NB = packed.size(0);
  TORCH_CHECK(K == in_features && K <= Kp && Kp - K < K_TILE && out_features <= NB * N_BLOCK &&
                  NB * N_BLOCK - out_features < N_BLOCK,
              "linear_packed: the input's width or out_features does not match the weight");
#if defined(BS_HAVE_AMX_TILES)
  TORCH_CHECK(bs::amx_permitted(), "linear_packed: this CPU or process cannot use AMX tiles");
  const auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0), N = out_features;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  auto y = at::empty(shape, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
  std::vector<float> b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "linear_packed: bias must have out_features values");
    auto bf = bias->to(at::kFloat).contiguous();
    b.assign(bf.data_ptr<float>(), bf.data_ptr<float>() + N);
    b.resize(NB * N_BLOCK, 0.f);
  }
  // x's rows as tiles read them: in place where its width is whole tiles, except the last
  // 16 rows when they are fewer (those, or all of x when its width is not, are copied to a
  // zero-padded buffer)
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x2.data_ptr());
  const int64_t whole = K == Kp ? M / 16 * 16 : 0;
  std::vector<uint16_t> pad((M - whole + 15) / 16 * 16 * Kp, 0);
  for (int64_t r = whole; r < M; ++r)
    std::memcpy(pad.data() + (r - whole) * Kp, xs + r * K, K * 2);
  auto rows = [&](int64_t r) -> std::pair<const uint16_t*, int64_t> {
    if (r < whole) return {xs + r * K, K};
    return {pad.data() + (r - whole) * Kp, Kp};
  };
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bp = b.empty() ? nullptr : b.data();
  // pairs of feature blocks per task: about a million products each, so that small calls
  // stay on one thread
  const int64_t pairs = (NB + 1) / 2;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 20) / ((M + 15) / 16 * 16 * Kp * 32));
  at::parallel_for(0, pairs, grain, [&](int64_t p0, int64_t p1) {
    if (float_out)
      linear_blocks(rows, M, Kp, wp, 2 * p0, std::min(2 * p1, NB), bp, y.data_ptr<float>(), N);
    else
      linear_blocks(rows, M, Kp, wp, 2 * p0, std::min(2 * p1, NB), bp,
                    reinterpret_cast<uint16_t*>(y.data_ptr()), N);
  });
  return y;
#else
  TORCH_CHECK(false, "linear_packed: built without AMX tiles");
  return {};
#endif
}

bool linear_amx_available() {
#if defined(BS_HAVE_AMX_TILES)
  return bs::amx_permitted();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(BS_NS, m) {
  m.def("pack_linear_weight(Tensor w) -> Tensor");
  m.def("linear_packed(Tensor x, Tensor packed, int in_features, int out_features, "
        "Tensor? bias, bool float_out=False) -> Tensor");
  m.def("linear_amx_available() -> bool", &linear_amx_available);
}

TORCH_LIBRARY_IMPL(BS_NS, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("linear_packed", &linear_packed);
}
