// A draft model's output layer in int8 on CPUs with AVX512-VNNI or AVX2: logits = x . W^T
// with W quantized per output (symmetric: scale_n = max|W_n| / 127) and each row of x per
// row (q = round(x * 127 / max|x|)), int32 sums: with VNNI up to 7 rows, on AMX-INT8 tiles
// from 8 (where the CPU has them), with AVX2 where there is no VNNI. All sum exactly, so a
// row's logits are the same in any batch, and the same on every path.
//
// Why: at a handful of rows a draft's forward is bound by reading its weights, and its
// output layer is most of them (the demo drafts: 1.5 of 2.4 MB; SmolLM2-135M: 28M of 135M
// parameters). int8 halves what a step reads, and the demo drafts' weights then fit a 2 MB
// L2 cache, so a round's later draft steps find them there. The draft's distribution moves
// by the rounding; verification judges drafts by the probabilities the draft actually used,
// so outputs stay exact. On fp32 drafts (CPUs without bf16 arithmetic) it reads a quarter of
// the bytes: the demo drafts' layer is 3 MB in fp32, 0.8 MB in int8, which stays in L2
// through a round's draft steps.
//
// Layout: W [N, K] -> [ceil(N/16)][K4][16][4] int8, K4 = ceil(K/64) * 16, zero-padded: for a
// block of 16 outputs, each group of four inputs is one 64-byte vector, vpdpbusd's signed
// operand, and 16 such groups are one AMX-INT8 tile (B) as they lie. x's
// row is stored as u8 (q + 128, padding 128): the sums are corrected by 128 * sum_k W[n, k].
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <vector>

#include "cpu_simd.h"

namespace {

constexpr int64_t N_BLOCK = 16, K_GROUP = 4;

// w [N, K] (any float dtype) -> (packed int8 [NB, K4, 16, 4], scale fp32 [NB * 16],
// sums int32 [NB * 16] of each output's int8 weights)
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_head_int8(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "pack_head_int8: needs a 2-d weight [out, in]");
  const int64_t N = w.size(0), K = w.size(1);
  // K padded to whole 64-input tiles (AMX-INT8's operand; zero weights add nothing)
  const int64_t NB = (N + N_BLOCK - 1) / N_BLOCK, K4 = (K + 63) / 64 * 16;
  const auto wf = w.to(at::kFloat).contiguous();
  auto scale = at::zeros({NB * N_BLOCK}, wf.options());
  scale.narrow(0, 0, N).copy_(wf.abs().amax(1) / 127.0f);
  auto q = at::zeros({NB * N_BLOCK, K4 * K_GROUP}, wf.options());
  const auto safe = at::where(scale.narrow(0, 0, N) > 0, scale.narrow(0, 0, N),
                              at::ones_like(scale.narrow(0, 0, N)));
  q.narrow(0, 0, N).narrow(1, 0, K).copy_(at::round(wf / safe.unsqueeze(1)).clamp(-127, 127));
  auto sums = q.sum(1).to(at::kInt);
  auto packed = q.to(at::kChar).view({NB, N_BLOCK, K4, K_GROUP}).permute({0, 2, 1, 3}).contiguous();
  return {packed, scale, sums};
}

// One row of x quantized: u8 codes (q + 128) of K4 * 4 entries, and its scale max|x| / 127
// (0 for a row of zeros, whose logits are then 0)
template <typename T>
float quantize_row(const T* x, int64_t K, int64_t Kp, std::vector<uint8_t>& out) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(x[k])));
  out.assign(size_t(Kp), 128);
  if (!(amax > 0.f)) return 0.f;
  const float inv = 127.0f / amax;
  for (int64_t k = 0; k < K; ++k) {
    const float q = std::nearbyint(static_cast<float>(x[k]) * inv);
    out[size_t(k)] = uint8_t(int32_t(std::min(127.f, std::max(-127.f, q))) + 128);
  }
  return amax / 127.0f;
}

#if defined(BS_HAVE_AVX512_PATH)
inline bool vnni_usable() {
  static const bool ok = bs::avx512_usable() && __builtin_cpu_supports("avx512vnni") &&
                         __builtin_cpu_supports("avx512bw");
  return ok;
}

// rows [r0, r0 + R) (R <= 4) of y over output blocks [nb0, nb1): 4 blocks at a time, each
// 64-byte weight vector used for every row
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void head_rows_vnni(
    const std::vector<uint8_t>* xq, const float* sx, const int8_t* wp, const float* scale,
    const int32_t* sums, int64_t NB, int64_t K4, int64_t N, float* y, int64_t ldy) {
  const int64_t block = K4 * N_BLOCK * K_GROUP;
  for (int64_t nb = 0; nb < NB; nb += 4) {
    const int nblk = int(std::min<int64_t>(4, NB - nb));
    __m512i acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
    const int8_t* w0 = wp + nb * block;
    for (int64_t k = 0; k < K4; ++k) {
      __m512i xb[R];
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq[r].data() + k * K_GROUP, 4);
        xb[r] = _mm512_set1_epi32(four);
      }
      for (int j = 0; j < nblk; ++j) {
        const __m512i w = _mm512_loadu_si512(w0 + j * block + k * 64);
        for (int r = 0; r < R; ++r) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xb[r], w);
      }
    }
    for (int j = 0; j < nblk; ++j) {
      const int64_t n = (nb + j) * N_BLOCK;
      const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(sums + n), 7);   // 128 * sum
      const __m512 sc = _mm512_loadu_ps(scale + n);
      const __mmask16 mask = N - n >= 16 ? __mmask16(0xffff) : __mmask16((1u << (N - n)) - 1);
      for (int r = 0; r < R; ++r) {
        const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], corr));
        _mm512_mask_storeu_ps(y + r * ldy + n, mask,
                              _mm512_mul_ps(v, _mm512_mul_ps(_mm512_set1_ps(sx[r]), sc)));
      }
    }
  }
}
#endif

#if defined(BS_HAVE_AVX512_PATH)
// AVX2 (CPUs without VNNI): the same int32 sums. vpmaddubsw multiplies unsigned by signed
// bytes and adds pairs into saturating int16, so the codes enter as signed q (|q| <= 127)
// with each weight's sign moved onto them: |w| * (q * sign w) = q * w, a pair at most
// 2 * 127 * 127 < 2^15, exact; vpmaddwd adds the pairs into int32. Summing q * w directly
// needs no correction by 128 * sum w: the VNNI path's result after its correction.
// Rows [0, R) by BLOCKS blocks of 16 outputs at a time (8 int32 sums in registers).
template <int R, int BLOCKS>
__attribute__((target("avx2"))) void head_rows_avx2(
    const std::vector<uint8_t>* xq, const float* sx, const int8_t* wp, const float* scale,
    int64_t NB, int64_t K4, int64_t N, float* y, int64_t ldy) {
  const int64_t block = K4 * N_BLOCK * K_GROUP;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t nb = 0; nb < NB; nb += BLOCKS) {
    const int nblk = int(std::min<int64_t>(BLOCKS, NB - nb));
    __m256i acc[R][BLOCKS][2];
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
      _Pragma("GCC unroll 8") for (int j = 0; j < BLOCKS; ++j)
        acc[r][j][0] = acc[r][j][1] = _mm256_setzero_si256();
    const int8_t* w0 = wp + nb * block;
    for (int64_t k = 0; k < K4; ++k) {
      __m256i xb[R];
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq[r].data() + k * K_GROUP, 4);
        xb[r] = _mm256_set1_epi32(four ^ int32_t(0x80808080u));   // codes q + 128 -> q
      }
      _Pragma("GCC unroll 8") for (int j = 0; j < BLOCKS; ++j) {
        if (j >= nblk) break;
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
          const __m256i w = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(w0 + j * block + k * 64 + h * 32));
          const __m256i a = _mm256_abs_epi8(w);
          _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
            const __m256i pairs = _mm256_maddubs_epi16(a, _mm256_sign_epi8(xb[r], w));
            acc[r][j][h] = _mm256_add_epi32(acc[r][j][h], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
    }
    alignas(32) int32_t out[R][BLOCKS][N_BLOCK];
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
      _Pragma("GCC unroll 8") for (int j = 0; j < BLOCKS; ++j)
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h)
          _mm256_store_si256(reinterpret_cast<__m256i*>(out[r][j] + h * 8), acc[r][j][h]);
    for (int j = 0; j < nblk; ++j) {
      const int64_t n0 = (nb + j) * N_BLOCK, n1 = std::min(N, n0 + N_BLOCK);
      for (int r = 0; r < R; ++r)   // as the VNNI path: sum * (row scale * output scale)
        for (int64_t n = n0; n < n1; ++n)
          y[r * ldy + n] = float(out[r][j][n - n0]) * (sx[r] * scale[n]);
    }
  }
}
#endif

#if defined(BS_HAVE_AMX_TILES)
inline bool amx_int8_usable() {
  static const bool ok = bs::amx_permitted() && __builtin_cpu_supports("amx-int8");
  return ok;
}

// rows [0, M) of y on AMX-INT8 tiles, 16 rows and two output blocks a product: the same
// exact int32 sums as the VNNI path (so a row's logits do not depend on its batch).
// xq: M rows of Kp u8 codes; tiles 0-1 x (A), 2-3 weights (B), 4-7 sums (C).
__attribute__((target("avx512f,avx512bw,amx-tile,amx-int8"))) void head_rows_amx(
    const uint8_t* xq, int64_t M, const float* sx, const int8_t* wp, const float* scale,
    const int32_t* sums, int64_t NB, int64_t K4, int64_t N, float* y) {
  bs::configure_tiles();
  const int64_t Kp = K4 * K_GROUP, block = K4 * N_BLOCK * K_GROUP, kt = Kp / 64;
  alignas(64) int32_t c[4][16 * 16];
  for (int64_t m = 0; m < M; m += 32) {
    const bool pair = m + 16 < M;
    for (int64_t nb = 0; nb < NB; nb += 2) {
      const bool two = nb + 1 < NB;
      void* const tiles[4] = {c[0], c[1], c[2], c[3]};
      bs::tile_products_2x2<true>(xq + m * Kp, xq + (m + 16) * Kp, Kp,
                                  reinterpret_cast<const uint8_t*>(wp + nb * block),
                                  reinterpret_cast<const uint8_t*>(wp + (nb + 1) * block), kt,
                                  pair, two, tiles);
      for (int t = 0; t < 4; ++t) {
        if (((t & 1) && !two) || ((t & 2) && !pair)) continue;
        const int64_t n = (nb + (t & 1)) * N_BLOCK, r0 = m + (t & 2 ? 16 : 0);
        const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(sums + n), 7);   // 128 * sum
        const __m512 sc = _mm512_loadu_ps(scale + n);
        const __mmask16 mask = N - n >= 16 ? __mmask16(0xffff) : __mmask16((1u << (N - n)) - 1);
        for (int64_t r = r0; r < std::min(r0 + 16, M); ++r) {
          const __m512 v = _mm512_cvtepi32_ps(
              _mm512_sub_epi32(_mm512_load_si512(c[t] + (r - r0) * 16), corr));
          _mm512_mask_storeu_ps(y + r * N + n, mask,
                                _mm512_mul_ps(v, _mm512_mul_ps(_mm512_set1_ps(sx[r]), sc)));
        }
      }
    }
  }
  _tile_release();
}
#endif

// x [M, K] bf16/fp32 -> logits [M, N] fp32 from pack_head_int8's tensors
at::Tensor head_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const at::Tensor& sums, int64_t out_features) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == N_BLOCK && packed.size(3) == K_GROUP,
              "head_int8: a weight from pack_head_int8");
  const int64_t NB = packed.size(0), K4 = packed.size(1), N = out_features;
  const auto x2 = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = x2.size(0), K = x2.size(1);
  TORCH_CHECK(K <= K4 * K_GROUP && K4 * K_GROUP - K < 64 && K4 % 16 == 0 && N <= NB * N_BLOCK,
              "head_int8: the input's width or out_features does not match the weight");
  TORCH_CHECK(x2.scalar_type() == at::kBFloat16 || x2.scalar_type() == at::kFloat,
              "head_int8: bf16 or fp32 input");
  auto y = at::empty({M, N}, x2.options().dtype(at::kFloat));
#if defined(BS_HAVE_AMX_TILES)
  if (M >= 8 && amx_int8_usable() && std::getenv("BATCHSPEC_CPU_HEAD_INT8_PORTABLE") == nullptr) {
    // all rows quantized into one buffer, 16-row tiles (the last one padded with code 128)
    const int64_t Kp = K4 * K_GROUP, Mp = (M + 15) / 16 * 16;
    std::vector<uint8_t> all(size_t(Mp * Kp), 128), row;
    std::vector<float> scales(static_cast<size_t>(M));
    for (int64_t r = 0; r < M; ++r) {
      scales[size_t(r)] = x2.scalar_type() == at::kFloat
          ? quantize_row(x2.data_ptr<float>() + r * K, K, Kp, row)
          : quantize_row(x2.data_ptr<at::BFloat16>() + r * K, K, Kp, row);
      std::memcpy(all.data() + r * Kp, row.data(), size_t(Kp));
    }
    head_rows_amx(all.data(), M, scales.data(), packed.data_ptr<int8_t>(),
                  scale.data_ptr<float>(), sums.data_ptr<int32_t>(), NB, K4, N,
                  y.data_ptr<float>());
    return y;
  }
#endif
  std::vector<uint8_t> xq[4];
  float sx[4];
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sc = scale.data_ptr<float>();
  const int32_t* su = sums.data_ptr<int32_t>();
#if defined(BS_HAVE_AVX512_PATH)
  // BATCHSPEC_CPU_HEAD_INT8_PORTABLE: the loop below even where VNNI is there (tests)
  const bool portable = std::getenv("BATCHSPEC_CPU_HEAD_INT8_PORTABLE") != nullptr;
  const bool vnni = vnni_usable() && !portable;
  const bool avx2 = !vnni && bs::avx2_usable() && !portable;
#endif
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int R = int(std::min<int64_t>(4, M - m0));
    for (int r = 0; r < R; ++r) {
      sx[r] = x2.scalar_type() == at::kFloat
                  ? quantize_row(x2.data_ptr<float>() + (m0 + r) * K, K, K4 * K_GROUP, xq[r])
                  : quantize_row(x2.data_ptr<at::BFloat16>() + (m0 + r) * K, K, K4 * K_GROUP, xq[r]);
    }
    float* yr = y.data_ptr<float>() + m0 * N;
#if defined(BS_HAVE_AVX512_PATH)
    if (vnni) {
      switch (R) {
        case 1: head_rows_vnni<1>(xq, sx, wp, sc, su, NB, K4, N, yr, N); break;
        case 2: head_rows_vnni<2>(xq, sx, wp, sc, su, NB, K4, N, yr, N); break;
        case 3: head_rows_vnni<3>(xq, sx, wp, sc, su, NB, K4, N, yr, N); break;
        default: head_rows_vnni<4>(xq, sx, wp, sc, su, NB, K4, N, yr, N); break;
      }
      continue;
    }
    if (avx2) {
      switch (R) {
        case 1: head_rows_avx2<1, 4>(xq, sx, wp, sc, NB, K4, N, yr, N); break;
        case 2: head_rows_avx2<2, 2>(xq, sx, wp, sc, NB, K4, N, yr, N); break;
        case 3: head_rows_avx2<3, 1>(xq, sx, wp, sc, NB, K4, N, yr, N); break;
        default: head_rows_avx2<4, 1>(xq, sx, wp, sc, NB, K4, N, yr, N); break;
      }
      continue;
    }
#endif
    for (int r = 0; r < R; ++r)   // the same integer sums, one at a time
      for (int64_t n = 0; n < N; ++n) {
        const int8_t* w = wp + (n / N_BLOCK) * K4 * N_BLOCK * K_GROUP + (n % N_BLOCK) * K_GROUP;
        int32_t acc = 0;
        for (int64_t k = 0; k < K4; ++k)
          for (int j = 0; j < K_GROUP; ++j)
            acc += int32_t(xq[r][size_t(k * K_GROUP + j)]) * int32_t(w[k * N_BLOCK * K_GROUP + j]);
        yr[r * N + n] = float(acc - 128 * su[n]) * (sx[r] * sc[n]);
      }
  }
  return y;
}

// whether the layer has a vectorised path here (VNNI or AVX2), not only the scalar loop
bool head_int8_fast() {
#if defined(BS_HAVE_AVX512_PATH)
  return vnni_usable() || bs::avx2_usable();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(BS_NS, m) {
  m.def("pack_head_int8(Tensor w) -> (Tensor, Tensor, Tensor)");
  m.def("head_int8(Tensor x, Tensor packed, Tensor scale, Tensor sums, int out_features) -> Tensor");
  m.def("head_int8_fast() -> bool", &head_int8_fast);
}

TORCH_LIBRARY_IMPL(BS_NS, CPU, m) {
  m.impl("pack_head_int8", &pack_head_int8);
  m.impl("head_int8", &head_int8);
}
