// Linear layers on CPU with weights packed once, at load: y = x . W^T (+ b).
//
// - bf16 on CPUs with AMX tiles (Intel Sapphire Rapids and later), fp32 sums rounded to bf16
//   once. Why not oneDNN, which the model uses elsewhere: at the row counts of decoding (1 to
//   a few hundred rows) its bf16 product costs 25-45 us a call even for a 256 x 256 weight
//   with the weight prepacked (the demo models' shapes; measured in docs/benchmarks.md),
//   several times what the tiles take, and a forward makes 4 such calls a layer.
//
//   The weight becomes [ceil(N/16)][ceil(K/32) * 16][16][2], zero-padded: for each block of
//   16 output features, each pair of input features (k, k+1) is one 64-byte row holding the
//   16 features' two weights side by side, the layout of a tile's second operand (B). A tile
//   product then takes 16 rows of x by 32 inputs (A) and such a block's 16 rows (B), adding
//   to a 16 x 16 fp32 block of y (C).
//
// - bf16 on CPUs with AVX512-BF16 and no AMX tiles (AMD Zen 4 and later, Intel Cooper Lake),
//   on the same packed weight: VDPBF16PS multiplies a 64-byte row of a block (one input
//   pair, 16 features) by the pair of a row of x broadcast, adding to 16 fp32 sums; up to 6
//   rows by 4 blocks at a time (linear_bf16_products, below, says why not oneDNN). Where the
//   CPU's VDPBF16PS is the slower product (bf16_by_fma measures it), fp32 fused
//   multiply-adds of each pair widened, in VDPBF16PS's order, on the same packed weight.
//
// - fp32 on CPUs with AVX2 and FMA (what the CPU's dtype is where it has no bf16
//   arithmetic). oneDNN's fp32 product with the weight prepacked reads a weight at a third of
//   the speed the memory gives at one row (the demo target's 25 products: 2.3-2.8 ms a
//   forward against 0.8-1.1 here), about 2x slower at 5 rows, 1.2-1.3x at 32-64 and about
//   the same from 160 (benchmarks/bench_cpu_ops.py). The weight becomes [ceil(N/16)][K][16], zero-padded: each block of 16
//   features is K rows of 64 bytes, read front to back. A register block of rows x features
//   (1 x 64; 2 x 48 and 3 x 32 for fp32 storage, 2 x 32 and 3 x 16 for bf16; up to 6 x 16:
//   f32_linear_blocks) keeps 6-12 sums in registers, one fused multiply-add a row per input
//   and 8 features. A weight whose values are all bf16
//   numbers (a bf16 checkpoint run in fp32) is stored in bf16 ([ceil(N/16)][K][16], 32-byte
//   rows): the same fp32 values, exactly, from half the bytes.
//
// Each row of y is computed the same way whatever the other rows are (tiles: 32 inputs a
// product, in order, into fp32; AVX2: one fused multiply-add chain per value, inputs in
// order; pair products: one chain of pair products, in order). So a token's result does
// not depend on how many rows its batch has (a decode step or a verification window, one
// row or sixty-four), which oneDNN does not promise; tests hold every path to it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_simd.h"

namespace {

constexpr int64_t K_TILE = 32;    // inputs per tile product (bf16 pairs: 16 rows of 64 bytes)
constexpr int64_t N_BLOCK = 16;   // output features per block of the packed weight
// Rows of x whose products run over all features in turn: as many as fill half of L1 (32
// KB), since the tiles read them again for every pair of feature blocks; at least 32
inline int64_t row_chunk(int64_t Kp) { return std::max<int64_t>(32, (16384 / Kp) / 32 * 32); }

// [N, K] -> the packed layout above of its dtype (any CPU: it is plain indexing). An fp32
// weight whose every value is a bf16 number (a bf16 checkpoint run in fp32) is stored in
// bf16 unless compact is false: the same values in half the bytes, read back exactly.
at::Tensor pack_linear_weight(const at::Tensor& w, bool compact) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat),
              "pack_linear_weight: needs a 2-d bf16 or fp32 weight [out, in]");
  const int64_t N = w.size(0), K = w.size(1);
  if (w.scalar_type() == at::kFloat) {   // [NB][K][16]
    const int64_t Np = (N + N_BLOCK - 1) / N_BLOCK * N_BLOCK;
    auto padded = at::zeros({Np, K}, w.options());
    padded.narrow(0, 0, N).copy_(w);
    auto blocks = padded.view({Np / N_BLOCK, N_BLOCK, K}).permute({0, 2, 1});
    const auto bf16 = blocks.to(at::kBFloat16);
    if (!compact || !at::equal(bf16.to(at::kFloat), blocks)) return blocks.contiguous();
    // the order load_weights16 reads: features 0 and 8, 1 and 9, ..., 7 and 15
    const auto order = at::tensor({0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15},
                                  w.options().dtype(at::kLong));
    return bf16.index_select(2, order).contiguous();
  }
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

// A call's operands: x's rows as a contiguous [M, K], y [..., N] of x's leading shape in
// dtype, and the bias as fp32 zero-padded to the packed weight's Np features (empty: none)
struct Operands {
  at::Tensor x, y;
  int64_t M;
  std::vector<float> bias;
  const float* bias_ptr() const { return bias.empty() ? nullptr : bias.data(); }
};

Operands operands(const at::Tensor& x, int64_t K, int64_t N, int64_t Np, at::ScalarType dtype,
                  const std::optional<at::Tensor>& bias) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  Operands o{x.reshape({-1, K}).contiguous(), at::empty(shape, x.options().dtype(dtype)), 0, {}};
  o.M = o.x.size(0);
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "linear_packed: bias must have out_features values");
    auto bf = bias->to(at::kFloat).contiguous();
    o.bias.assign(bf.data_ptr<float>(), bf.data_ptr<float>() + N);
    o.bias.resize(size_t(Np), 0.f);
  }
  return o;
}

#if defined(BS_HAVE_AVX512_PATH)   // x86-64: the AVX512-BF16 path, taken where usable
#define BS_DP_FN __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16")))
#define BS_DP_FN_INLINE \
  __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16"), always_inline))

// MR rows of NP blocks of 16 fp32 sums (+ bias) rounded to bf16 at y (rows ldy apart; fp32
// of the bf16 values where Out is float): the first `count` features
template <int MR, int NP, typename Out>
BS_DP_FN_INLINE void store_sums(const __m512 (&acc)[MR][NP], const float* bias, Out* y,
                                int64_t ldy, int64_t count) {
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
    _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p) {
      const int64_t n = p * N_BLOCK;
      if (n >= count) break;
      __m512 v = acc[r][p];
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
      const __mmask16 mask =
          count - n >= 16 ? __mmask16(0xffff) : __mmask16((1u << (count - n)) - 1);
      const __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
      if constexpr (std::is_same_v<Out, float>)
        _mm512_mask_storeu_epi32(y + r * ldy + n, mask,
                                 _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
      else
        _mm256_mask_storeu_epi16(y + r * ldy + n, mask, b);
    }
}

// Rows [0, MR) of x (pairs of inputs: row r's pair j is the 32 bits at x + r * ldx + 2j) by
// NP blocks of 16 features of the packed weight (blocks `block` elements apart, a pair's 16
// features one 64-byte row), into y (rows ldy apart; fp32 of the bf16 values where Out is
// float): the first `count` features (+ bias). Each value is one chain of pair products
// (VDPBF16PS) over the input pairs in order, whatever MR and NP are.
template <int MR, int NP, typename Out>
BS_DP_FN void dp_block(const uint16_t* x, int64_t ldx, int64_t pairs, const uint16_t* w,
                       int64_t block, const float* bias, Out* y, int64_t ldy, int64_t count) {
  __m512 acc[MR][NP];
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
    _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    __m512i wv[NP];
    _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p)
      wv[p] = _mm512_loadu_si512(w + p * block + j * 32);
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * j, 4);
      const __m512bh xr = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p)
        acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xr, reinterpret_cast<__m512bh>(wv[p]));
    }
  }
  store_sums<MR, NP, Out>(acc, bias, y, ldy, count);
}

// Rows [0, MR) of x (fp32, rows ldx apart: the bf16 input widened, exactly) by NP blocks of the
// pair-packed bf16 weight (as dp_block reads it), into y as dp_block writes it. Each 64-byte
// row of a block holds 16 features' weights for inputs 2j and 2j + 1 in one 32-bit lane each:
// the lane shifted up 16 bits is the first's exact fp32 value, its upper half alone the
// second's. Each value is one chain of fused multiply-adds over the input pairs in order, a
// pair's second input before its first, whatever MR and NP are.
template <int MR, int NP, typename Out>
BS_DP_FN void fma_block(const float* x, int64_t ldx, int64_t K, const uint16_t* w,
                        int64_t block, const float* bias, Out* y, int64_t ldy, int64_t count) {
  __m512 acc[MR][NP];
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
    _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
  const int64_t whole = K / 2;
  for (int64_t j = 0; j < whole; ++j) {
    __m512i v[NP];
    _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p)
      v[p] = _mm512_loadu_si512(w + p * block + j * 32);
    // the pair's second input, then its first: the order of VDPBF16PS's two products (Intel
    // SDM), so that on Intel CPUs the two paths agree bit for bit but for denormals
    _Pragma("GCC unroll 2") for (int h = 1; h >= 0; --h) {
      __m512 wv[NP];
      _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p)
        wv[p] = _mm512_castsi512_ps(h == 0 ? _mm512_slli_epi32(v[p], 16)
                                           : _mm512_and_si512(v[p], high));
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
        const __m512 xr = _mm512_set1_ps(x[r * ldx + 2 * j + h]);
        _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p)
          acc[r][p] = _mm512_fmadd_ps(xr, wv[p], acc[r][p]);
      }
    }
  }
  if (K % 2 != 0) {   // the last input alone (its pair's second weight is the padding's zero)
    _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p) {
      const __m512i v = _mm512_loadu_si512(w + p * block + whole * 32);
      const __m512 first = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
        acc[r][p] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + 2 * whole]), first, acc[r][p]);
    }
  }
  store_sums<MR, NP, Out>(acc, bias, y, ldy, count);
}

// The register block of bf16 products on the pair-packed weight for x's type: pair products
// of bf16 x (depth: pairs of inputs) or multiply-adds of x widened to fp32 (depth: inputs)
template <int MR, int NP, typename X, typename Out>
BS_DP_FN_INLINE void block_products(const X* x, int64_t ldx, int64_t depth, const uint16_t* w,
                                    int64_t block, const float* bias, Out* y, int64_t ldy,
                                    int64_t count) {
  if constexpr (std::is_same_v<X, float>)
    fma_block<MR, NP, Out>(x, ldx, depth, w, block, bias, y, ldy, count);
  else
    dp_block<MR, NP, Out>(x, ldx, depth, w, block, bias, y, ldy, count);
}

// up to 6 rows by NP blocks
template <int NP, typename X, typename Out>
BS_DP_FN void block_rows(int64_t rows, const X* x, int64_t ldx, int64_t depth,
                         const uint16_t* w, int64_t block, const float* bias, Out* y,
                         int64_t ldy, int64_t count) {
  switch (rows) {
    case 1: block_products<1, NP>(x, ldx, depth, w, block, bias, y, ldy, count); break;
    case 2: block_products<2, NP>(x, ldx, depth, w, block, bias, y, ldy, count); break;
    case 3: block_products<3, NP>(x, ldx, depth, w, block, bias, y, ldy, count); break;
    case 4: block_products<4, NP>(x, ldx, depth, w, block, bias, y, ldy, count); break;
    case 5: block_products<5, NP>(x, ldx, depth, w, block, bias, y, ldy, count); break;
    default: block_products<6, NP>(x, ldx, depth, w, block, bias, y, ldy, count);
  }
}

// Feature blocks [nb0, nb1) of y [M, N]: groups of up to 4 blocks (64 features), each group
// over all rows 6 at a time (24 sums in registers; the group's weight stays in L1/L2 while
// the rows reread it), so that the weight is read from memory once a call
template <typename X, typename Out>
BS_DP_FN void block_groups(const X* x, int64_t ldx, int64_t M, int64_t depth,
                           const uint16_t* wp, int64_t block, int64_t nb0, int64_t nb1,
                           const float* bias, Out* y, int64_t N) {
  for (int64_t nb = nb0; nb < nb1; nb += 4) {
    const int64_t np = std::min<int64_t>(4, nb1 - nb);
    const uint16_t* w = wp + nb * block;
    const float* b = bias != nullptr ? bias + nb * N_BLOCK : nullptr;
    const int64_t count = N - nb * N_BLOCK;
    for (int64_t m = 0; m < M; m += 6) {
      const int64_t rows = std::min<int64_t>(6, M - m);
      const X* xm = x + m * ldx;
      Out* ym = y + m * N + nb * N_BLOCK;
      switch (np) {
        case 1: block_rows<1>(rows, xm, ldx, depth, w, block, b, ym, N, count); break;
        case 2: block_rows<2>(rows, xm, ldx, depth, w, block, b, ym, N, count); break;
        case 3: block_rows<3>(rows, xm, ldx, depth, w, block, b, ym, N, count); break;
        default: block_rows<4>(rows, xm, ldx, depth, w, block, b, ym, N, count);
      }
    }
  }
}
#endif

#if defined(BS_HAVE_AVX512_PATH)   // x86-64: the AVX2 path below, taken where avx2_usable()
#define BS_AVX2_FN __attribute__((target("avx2,fma")))

// Rows [0, MR) of x (K inputs each, contiguous) by NP blocks of 16 features from w (blocks
// K * 16 apart), into y (rows ldy apart): the first `count` features (+ bias). Each value is
// one chain of fused multiply-adds over the inputs in order, whatever MR and NP are.
// PREFETCH: ask for the weight rows PREFETCH_ROWS ahead (the next block's first rows at the
// end of a block) where the sums leave the memory time to fetch them: a block's first pass.
// The loops over registers are unrolled before scalar replacement so that the sums stay in
// registers (left to the default order, GCC stores them to the stack every input).
constexpr int64_t PREFETCH_ROWS = 32;

// 16 weights of a block's row as two vectors of 8 fp32 features: fp32 as stored, or bf16
// stored as pairs (feature i, feature i + 8), i = 0..7, one 32-bit lane each: the lane
// shifted up 16 bits is feature i's exact fp32 value, its upper half alone feature i + 8's
// (a bf16 number is the upper half of its float). A shift and an AND: interleaving with
// zeros took two shuffles, and the shuffle port bounded the one-row product
template <typename W>
BS_AVX2 void load_weights16(const W* p, __m256& lo, __m256& hi) {
  if constexpr (std::is_same_v<W, float>) {
    lo = _mm256_loadu_ps(p);
    hi = _mm256_loadu_ps(p + 8);
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u))));
  }
}

template <int MR, int NP, bool PREFETCH, typename W>
BS_AVX2 void f32_block(const float* x, int64_t K, const W* w, const float* bias, float* y,
                       int64_t ldy, int64_t count) {
  __m256 acc[MR][NP][2];
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
    _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p)
      acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  const int64_t stride = K * N_BLOCK;
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = w + k * N_BLOCK;
    if constexpr (PREFETCH)
      _mm_prefetch(reinterpret_cast<const char*>(wk + PREFETCH_ROWS * N_BLOCK), _MM_HINT_T0);
    __m256 wv[NP][2];
    _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p) {
      load_weights16(wk + p * stride, wv[p][0], wv[p][1]);
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * K + k);
      _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p) {
        acc[r][p][0] = _mm256_fmadd_ps(xr, wv[p][0], acc[r][p][0]);
        acc[r][p][1] = _mm256_fmadd_ps(xr, wv[p][1], acc[r][p][1]);
      }
    }
  }
  alignas(32) float out[MR][NP * N_BLOCK];
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
    _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p) {
      _mm256_store_ps(out[r] + p * N_BLOCK, acc[r][p][0]);
      _mm256_store_ps(out[r] + p * N_BLOCK + 8, acc[r][p][1]);
    }
  const int64_t n1 = std::min<int64_t>(count, NP * N_BLOCK);
  for (int r = 0; r < MR; ++r) {
    float* yr = y + r * ldy;
    int64_t n = 0;
    for (; n + 8 <= n1; n += 8) {
      __m256 v = _mm256_load_ps(out[r] + n);
      if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n));
      _mm256_storeu_ps(yr + n, v);
    }
    for (; n < n1; ++n) yr[n] = out[r][n] + (bias != nullptr ? bias[n] : 0.f);
  }
}

// up to 6 rows by one block of 16 features
template <bool PREFETCH, typename W>
BS_AVX2_FN void f32_rows(const float* x, int64_t rows, int64_t K, const W* w,
                         const float* bias, float* y, int64_t ldy, int64_t count) {
  switch (rows) {
    case 1: f32_block<1, 1, PREFETCH, W>(x, K, w, bias, y, ldy, count); break;
    case 2: f32_block<2, 1, PREFETCH, W>(x, K, w, bias, y, ldy, count); break;
    case 3: f32_block<3, 1, PREFETCH, W>(x, K, w, bias, y, ldy, count); break;
    case 4: f32_block<4, 1, PREFETCH, W>(x, K, w, bias, y, ldy, count); break;
    case 5: f32_block<5, 1, PREFETCH, W>(x, K, w, bias, y, ldy, count); break;
    default: f32_block<6, 1, PREFETCH, W>(x, K, w, bias, y, ldy, count); break;
  }
}

// Feature blocks [nb0, nb1) of y [M, N] for x [M, K]. A few rows: several blocks at a time,
// so that 8-12 sums are in flight with the weight read once: 1 row by 4 blocks, 2 by 3 and
// 3 by 2 for fp32 weights; 2 by 2 for bf16 ones, whose widening takes a register more (2 by
// 3 and 3 by 2 left two sums on the stack, a store and a load in their chains: half the
// speed), and 3 rows of them as more rows go. More rows: a block at a time, 6 rows after 6
// (the block stays in L1/L2 while the later rows reread it), the last 7 or 8 as 4 and 3 or
// 4 and 4 (a pass of 1 or 2 rows keeps too few sums in flight to hide the latency of a
// fused multiply-add).
template <typename W>
BS_AVX2_FN void f32_linear_blocks(const float* x, int64_t M, int64_t K, const W* wp,
                                  int64_t nb0, int64_t nb1, const float* bias, float* y,
                                  int64_t N) {
  constexpr bool fp32 = std::is_same_v<W, float>;
  const int64_t stride = K * N_BLOCK;
  auto at = [&](int64_t nb) { return bias != nullptr ? bias + nb * N_BLOCK : nullptr; };
  if (M <= (fp32 ? 3 : 2)) {
    const int64_t step = M == 1 ? 4 : M == 3 ? 2 : fp32 ? 3 : 2;
    for (int64_t nb = nb0; nb < nb1; nb += step) {
      const W* w = wp + nb * stride;
      float* yb = y + nb * N_BLOCK;
      const int64_t count = N - nb * N_BLOCK;
      if (nb + step > nb1) {   // the last blocks of the range, one at a time
        for (int64_t b = nb; b < nb1; ++b)
          f32_rows<false, W>(x, M, K, wp + b * stride, at(b), y + b * N_BLOCK, N, N - b * N_BLOCK);
      } else if (M == 1) {
        f32_block<1, 4, false, W>(x, K, w, at(nb), yb, N, count);
      } else if constexpr (fp32) {
        if (M == 2)
          f32_block<2, 3, false, W>(x, K, w, at(nb), yb, N, count);
        else
          f32_block<3, 2, false, W>(x, K, w, at(nb), yb, N, count);
      } else {
        f32_block<2, 2, false, W>(x, K, w, at(nb), yb, N, count);
      }
    }
    return;
  }
  for (int64_t nb = nb0; nb < nb1; ++nb)
    for (int64_t m = 0, rows; m < M; m += rows) {
      rows = M - m == 7 || M - m == 8 ? 4 : std::min<int64_t>(6, M - m);
      if (m == 0)
        f32_rows<true, W>(x, rows, K, wp + nb * stride, at(nb), y + nb * N_BLOCK, N, N - nb * N_BLOCK);
      else
        f32_rows<false, W>(x + m * K, rows, K, wp + nb * stride, at(nb), y + m * N + nb * N_BLOCK,
                           N, N - nb * N_BLOCK);
    }
}
#endif

// x [..., K] fp32 . the weight of pack_linear_weight's fp32 layout, stored in fp32 or bf16
// (+ bias) -> [..., out_features]
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t in_features,
                      int64_t out_features, const std::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1), NB = packed.size(0);
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == N_BLOCK,
              "linear_packed: fp32 input and a weight of pack_linear_weight's fp32 layout");
  TORCH_CHECK(K == in_features && packed.size(1) == K && out_features <= NB * N_BLOCK &&
                  NB * N_BLOCK - out_features < N_BLOCK,
              "linear_packed: the input's width or out_features does not match the weight");
#if defined(BS_HAVE_AVX512_PATH)
  TORCH_CHECK(bs::avx2_usable(), "linear_packed: fp32 weights need a CPU with AVX2 and FMA");
  const int64_t N = out_features;
  const Operands o = operands(x, K, N, NB * N_BLOCK, at::kFloat, bias);
  const int64_t M = o.M;
  const at::Tensor &x2 = o.x, &y = o.y;
  if (M == 0) return y;
  const float* bp = o.bias_ptr();
  // feature blocks per task: about two million products each, so that small calls stay on
  // one thread
  const int64_t grain = std::max<int64_t>(4, (int64_t(1) << 21) / (M * K * N_BLOCK));
  const bool compact = packed.scalar_type() == at::kBFloat16;
  at::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
    if (compact)
      f32_linear_blocks(x2.data_ptr<float>(), M, K,
                        reinterpret_cast<const uint16_t*>(packed.data_ptr()), b0, b1, bp,
                        y.data_ptr<float>(), N);
    else
      f32_linear_blocks(x2.data_ptr<float>(), M, K, packed.data_ptr<float>(), b0, b1, bp,
                        y.data_ptr<float>(), N);
  });
  return y;
#else
  TORCH_CHECK(false, "linear_packed: fp32 weights need an x86-64 build");
  return {};
#endif
}

#if defined(BS_HAVE_AVX512_PATH)
// y of the operands o from x's rows as block_products reads them (ldx apart, depth pairs of
// inputs or inputs) and the pair-packed weight: groups of 4 feature blocks per task, about a
// million products each, so that small calls stay on one thread
template <typename X>
void run_groups(const X* xs, int64_t ldx, int64_t depth, const Operands& o,
                const at::Tensor& packed, int64_t N, bool float_out) {
  const int64_t Kp = packed.size(1) * 2, NB = packed.size(0), M = o.M, block = Kp / 2 * 32;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bp = o.bias_ptr();
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 20) / (M * Kp * 64));
  at::parallel_for(0, (NB + 3) / 4, grain, [&](int64_t g0, int64_t g1) {
    const int64_t nb0 = 4 * g0, nb1 = std::min(4 * g1, NB);
    if (float_out)
      block_groups(xs, ldx, M, depth, wp, block, nb0, nb1, bp, o.y.data_ptr<float>(), N);
    else
      block_groups(xs, ldx, M, depth, wp, block, nb0, nb1, bp,
                   reinterpret_cast<uint16_t*>(o.y.data_ptr()), N);
  });
}
#endif

// x bf16 [..., K] . the bf16 packed weight (+ bias) on CPUs with AVX512-BF16 and without AMX
// tiles (AMD Zen 4 and later, Intel Cooper Lake), the tiles' layout: pair products
// (VDPBF16PS), or (fma) fp32 fused multiply-adds for CPUs whose VDPBF16PS multiply-adds at
// two thirds of the rate of their 512-bit FMAs or less (some Intel Xeons: 42 against 87
// billion a second a core; bf16_by_fma), x widened to fp32 once a call (exactly) and each
// pair of the weight as it is read. Why not oneDNN there: its product is a primitive built
// for each row count and weight shape (0.2-0.5 ms each), of which it caches 1,024. A job's steps have ragged row
// counts (verification windows of different lengths, prompts joining the batch): in a
// 32-row suffix-draft job 6% of the products built one, 4% of the job's time, and the
// demo target's weights over 268 row counts cost 1.7x this path's time and 630-730 MB of
// primitives (benchmarks/bench_cpu_ops.py --ragged).
at::Tensor linear_bf16_products(const at::Tensor& x, const at::Tensor& packed,
                                int64_t out_features, const std::optional<at::Tensor>& bias,
                                bool float_out, bool fma) {
#if defined(BS_HAVE_AVX512_PATH)
  TORCH_CHECK(bs::avx512_bf16_usable(), "linear_packed: this CPU has no AVX512-BF16");
  const int64_t K = x.size(-1), NB = packed.size(0), N = out_features;
  const Operands o = operands(x, K, N, NB * N_BLOCK, float_out ? at::kFloat : at::kBFloat16, bias);
  const int64_t M = o.M;
  if (M == 0) return o.y;
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(o.x.data_ptr());
  if (fma) {
    // x widened into this thread's buffer, not a tensor allocated each call; it keeps the
    // largest call's size (a prompt of 2,048 tokens 768 wide: 6 MB)
    thread_local std::vector<uint32_t> wide;
    wide.resize(size_t(M * K));
    uint32_t* xs32 = wide.data();
    for (int64_t i = 0; i < M * K; ++i) xs32[i] = uint32_t(xs[i]) << 16;
    run_groups(reinterpret_cast<const float*>(xs32), K, K, o, packed, N, float_out);
    return o.y;
  }
  // pairs of inputs are read as 32 bits: an odd width reads its rows from a copy with a zero
  // after each
  int64_t ldx = K;
  std::vector<uint16_t> even;
  if (K % 2 != 0) {
    ldx = K + 1;
    even.assign(M * ldx, 0);
    for (int64_t r = 0; r < M; ++r) std::memcpy(even.data() + r * ldx, xs + r * K, K * 2);
    xs = even.data();
  }
  run_groups(xs, ldx, (K + 1) / 2, o, packed, N, float_out);
  return o.y;
#else
  TORCH_CHECK(false, "linear_packed: AVX512-BF16 needs an x86-64 build");
  return {};
#endif
}

#if defined(BS_HAVE_AVX512_PATH)
// Multiply-adds a second of 24 independent chains of one instruction, one run of `iters`
template <typename Op>
BS_DP_FN double chain_rate(Op op, double macs_per_op, int64_t iters) {
  __m512 acc[24];
  for (int i = 0; i < 24; ++i) acc[i] = _mm512_set1_ps(float(i));
  __m512 a = _mm512_set1_ps(1.0f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    _Pragma("GCC unroll 24") for (int c = 0; c < 24; ++c) acc[c] = op(acc[c], a);
    asm volatile("" : "+v"(a));
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  __m512 sum = acc[0];
  for (int i = 1; i < 24; ++i) sum = _mm512_add_ps(sum, acc[i]);
  volatile float sink = _mm512_reduce_add_ps(sum);
  (void)sink;
  return double(iters) * 24 * macs_per_op / s;
}

// {fp32 FMA, VDPBF16PS} multiply-adds a second on this core: the fastest of 7 runs each,
// in turns (0.05-0.2 ms a run, about 2 ms in all), after a run of each that warms the
// 512-bit units
BS_DP_FN std::vector<double> measure_bf16_rates() {
  auto fma = [](__m512 c, __m512 a) BS_DP_FN_INLINE { return _mm512_fmadd_ps(a, a, c); };
  auto pairs = [](__m512 c, __m512 a) BS_DP_FN_INLINE {
    return _mm512_dpbf16_ps(c, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(a));
  };
  chain_rate(fma, 16, 4000);
  chain_rate(pairs, 32, 4000);
  double best_fma = 0, best_pairs = 0;
  for (int run = 0; run < 7; ++run) {
    best_fma = std::max(best_fma, chain_rate(fma, 16, 10000));
    best_pairs = std::max(best_pairs, chain_rate(pairs, 32, 10000));
  }
  return {best_fma, best_pairs};
}
#endif

// {fp32 FMA, VDPBF16PS} multiply-adds a second of one core, measured at the first call ({}
// without AVX512-BF16)
const std::vector<double>& bf16_rates() {
  static const std::vector<double> rates = [] {
#if defined(BS_HAVE_AVX512_PATH)
    if (bs::avx512_bf16_usable()) return measure_bf16_rates();
#endif
    return std::vector<double>{};
  }();
  return rates;
}

// Whether the bf16 packed weight takes fp32 multiply-adds here without AMX tiles ("fma"),
// not pair products ("pairs"): where this CPU's 512-bit FMAs multiply-add at 1.5x or more
// the rate of its VDPBF16PS (bf16_rates: about 2x on some Intel Xeons, 0.5x on AMD Zen 4;
// the fma path's widening of the weight costs about a sixth of its multiply-adds).
// BATCHSPEC_CPU_BF16_PRODUCT=pairs or fma chooses; any other value is an error.
bool bf16_by_fma() {
  static const bool fma = [] {
    const char* env = std::getenv("BATCHSPEC_CPU_BF16_PRODUCT");
    if (env != nullptr && *env != '\0') {
      TORCH_CHECK(std::strcmp(env, "fma") == 0 || std::strcmp(env, "pairs") == 0,
                  "BATCHSPEC_CPU_BF16_PRODUCT must be pairs or fma, got '", env, "'");
      return std::strcmp(env, "fma") == 0;
    }
    const std::vector<double>& r = bf16_rates();
    return !r.empty() && r[0] >= 1.5 * r[1];
  }();
  return fma;
}

#if defined(BS_HAVE_AMX_TILES)
// x bf16 [..., K] . the bf16 packed weight (+ bias) on AMX tiles
at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const std::optional<at::Tensor>& bias, bool float_out) {
  const int64_t K = x.size(-1), Kp = packed.size(1) * 2, NB = packed.size(0), N = out_features;
  const Operands o = operands(x, K, N, NB * N_BLOCK, float_out ? at::kFloat : at::kBFloat16, bias);
  const int64_t M = o.M;
  if (M == 0) return o.y;
  // x's rows as tiles read them: in place where its width is whole tiles, except the last
  // 16 rows when they are fewer (those, or all of x when its width is not, are copied to a
  // zero-padded buffer)
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(o.x.data_ptr());
  const int64_t whole = K == Kp ? M / 16 * 16 : 0;
  std::vector<uint16_t> pad((M - whole + 15) / 16 * 16 * Kp, 0);
  for (int64_t r = whole; r < M; ++r)
    std::memcpy(pad.data() + (r - whole) * Kp, xs + r * K, K * 2);
  auto rows = [&](int64_t r) -> std::pair<const uint16_t*, int64_t> {
    if (r < whole) return {xs + r * K, K};
    return {pad.data() + (r - whole) * Kp, Kp};
  };
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bp = o.bias_ptr();
  // pairs of feature blocks per task: about a million products each, so that small calls
  // stay on one thread
  const int64_t pairs = (NB + 1) / 2;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 20) / ((M + 15) / 16 * 16 * Kp * 32));
  at::parallel_for(0, pairs, grain, [&](int64_t p0, int64_t p1) {
    if (float_out)
      linear_blocks(rows, M, Kp, wp, 2 * p0, std::min(2 * p1, NB), bp, o.y.data_ptr<float>(), N);
    else
      linear_blocks(rows, M, Kp, wp, 2 * p0, std::min(2 * p1, NB), bp,
                    reinterpret_cast<uint16_t*>(o.y.data_ptr()), N);
  });
  return o.y;
}
#endif

// the bf16 paths' operands: bf16 x and a weight from pack_linear_weight whose width and
// features are x's and out_features
void check_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t in_features,
                int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  packed.dim() == 4 && packed.is_contiguous(),
              "linear_packed: bf16 input and a weight from pack_linear_weight");
  const int64_t K = x.size(-1), Kp = packed.size(1) * 2, NB = packed.size(0);
  TORCH_CHECK(K == in_features && K <= Kp && Kp - K < K_TILE && out_features <= NB * N_BLOCK &&
                  NB * N_BLOCK - out_features < N_BLOCK,
              "linear_packed: the input's width or out_features does not match the weight");
}

// x [..., in_features] -> [..., out_features]; packed from pack_linear_weight of
// [out_features, in_features]: bf16 x for a bf16 weight (AMX tiles where the CPU has them and
// the process may use them, else AVX512-BF16), fp32 x for an fp32 one (AVX2).
// float_out (bf16): the result as fp32 (each value still rounded to bf16), for logits, which
// the engine reads in fp32
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, int64_t in_features,
                         int64_t out_features, const std::optional<at::Tensor>& bias,
                         bool float_out) {
  if (packed.dim() == 3)   // the fp32 layout (x fp32)
    return linear_f32(x, packed, in_features, out_features, bias);
  check_bf16(x, packed, in_features, out_features);
#if defined(BS_HAVE_AMX_TILES)
  if (bs::amx_permitted()) return linear_amx(x, packed, out_features, bias, float_out);
#endif
  return linear_bf16_products(x, packed, out_features, bias, float_out, bf16_by_fma());
}

// the AVX512-BF16 path whatever the CPU also has (tests compare it with the tiles)
at::Tensor linear_packed_dp(const at::Tensor& x, const at::Tensor& packed, int64_t in_features,
                            int64_t out_features, const std::optional<at::Tensor>& bias,
                            bool float_out) {
  check_bf16(x, packed, in_features, out_features);
  return linear_bf16_products(x, packed, out_features, bias, float_out, false);
}

// the fp32 multiply-add path on the same packed weight, wherever AVX512-BF16 is (tests hold it
// to the product and compare it with the pair products)
at::Tensor linear_packed_fma(const at::Tensor& x, const at::Tensor& packed, int64_t in_features,
                             int64_t out_features, const std::optional<at::Tensor>& bias,
                             bool float_out) {
  check_bf16(x, packed, in_features, out_features);
  return linear_bf16_products(x, packed, out_features, bias, float_out, true);
}

// the product linear_packed gives bf16 weights here: "amx", "fma" or "pairs" ("" where
// bf16 weights do not run: no AVX512-BF16)
std::string linear_bf16_path() {
#if defined(BS_HAVE_AMX_TILES)
  if (bs::amx_permitted()) return "amx";
#endif
#if defined(BS_HAVE_AVX512_PATH)
  if (bs::avx512_bf16_usable()) return bf16_by_fma() ? "fma" : "pairs";
#endif
  return "";
}

// bf16_rates in billions: {fp32 FMA, VDPBF16PS} multiply-adds a second ([] without
// AVX512-BF16)
std::vector<double> linear_bf16_rates() {
  std::vector<double> r = bf16_rates();
  for (double& v : r) v /= 1e9;
  return r;
}

// whether pack_linear_weight's fp32 layout runs here
bool linear_f32_available() {
#if defined(BS_HAVE_AVX512_PATH)
  return bs::avx2_usable();
#else
  return false;
#endif
}

// whether bf16 packed weights run here on AVX512-BF16 (where AMX tiles do not take them)
bool linear_bf16_available() {
#if defined(BS_HAVE_AVX512_PATH)
  return bs::avx512_bf16_usable();
#else
  return false;
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
  m.def("pack_linear_weight(Tensor w, bool compact=True) -> Tensor");
  m.def("linear_packed(Tensor x, Tensor packed, int in_features, int out_features, "
        "Tensor? bias, bool float_out=False) -> Tensor");
  m.def("linear_packed_dp(Tensor x, Tensor packed, int in_features, int out_features, "
        "Tensor? bias, bool float_out=False) -> Tensor");
  m.def("linear_packed_fma(Tensor x, Tensor packed, int in_features, int out_features, "
        "Tensor? bias, bool float_out=False) -> Tensor");
  m.def("linear_bf16_path() -> str", &linear_bf16_path);
  m.def("linear_bf16_rates() -> float[]", &linear_bf16_rates);
  m.def("linear_amx_available() -> bool", &linear_amx_available);
  m.def("linear_bf16_available() -> bool", &linear_bf16_available);
  m.def("linear_f32_available() -> bool", &linear_f32_available);
}

TORCH_LIBRARY_IMPL(BS_NS, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("linear_packed", &linear_packed);
  m.impl("linear_packed_dp", &linear_packed_dp);
  m.impl("linear_packed_fma", &linear_packed_fma);
}
