// Host-only fast path of the bonus draw (verify_core.h, draw_bonus), included by the CPU
// build only. The same winner as the generic loop, in three passes, the middle one a loop
// the compiler vectorises, or on AVX-512 explicit vectors (16 Philox calls a vector, and the
// candidates' indices compressed, so that pass 3 visits them alone: 4.7 against 11 us a
// draw of 4,096 tokens on a Zen 4 core, the draw timed in a loop):
//   1. the row's most likely token is scored first: its score b0 bounds the final best;
//   2. every token's uniform (Philox, four tokens a call) and whether it could beat b0: a
//      score z - log(-log u) > b0 needs u > exp(-e^(z - b0)) >= 1 - e^(z - b0) (cannot_win's
//      test and margins; e^x from a polynomial within 2e-7 relative, which the 1e-4 relative
//      margin covers), and z within kMaxGumbel of b0;
//   3. the candidates left are scored exactly as the generic loop scores them, in index
//      order, ties to the lower index.
// A token dropped in 2 cannot beat b0, so it cannot beat the final best: the same winner.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "cpu_simd.h"

namespace bs {

// Pass 2 over one row: u[i] for every token (bonus_uniforms; from Philox call `first` on),
// then cand[i] = 1 where token i could beat b0 (bonus_filter).
BS_CLONES inline void bonus_uniforms(int V, uint64_t seed, uint64_t offset, uint32_t position,
                                     float* __restrict__ u, int first = 0) {
  for (int c = first; c < (V + 3) / 4; ++c) {   // as TokenUniforms: token i is call i / 4, word i % 4
    const U4 r = philox_keyed(seed, offset, position, kStreamDraw, uint32_t(c));
    for (int j = 0; j < 4; ++j) u[4 * c + j] = to_uniform(r.w[j]);
  }
}

#if defined(BS_HAVE_AVX512_PATH)
// The 64-bit products M x a of each 32-bit lane of a: their low and high halves
#define BS_PHILOX_AVX512 __attribute__((target("avx512f,avx512dq")))
BS_PHILOX_AVX512 inline void mul_hi_lo16(__m512i a, __m512i m, __m512i& hi, __m512i& lo) {
  const __m512i even = _mm512_mul_epu32(a, m);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
  lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

// 16 Philox calls from call c0, one a lane (they differ in their first counter word only),
// their uniforms stored in token order at u + 4 * c0 (token 4c + j is word j of call c):
// the same bits as philox_keyed, so the same uniforms
BS_PHILOX_AVX512 inline void philox16(int c0, uint32_t position, uint64_t offset,
                                          uint64_t seed, float* __restrict__ u) {
  const __m512i m0 = _mm512_set1_epi64(0xD2511F53u), m1 = _mm512_set1_epi64(0xCD9E8D57u);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const uint32_t c3 = uint32_t((offset >> 32) & 0xFFFFu) | (uint32_t(kStreamDraw) << 16);
  __m512i x0 = _mm512_add_epi32(_mm512_set1_epi32(c0), lanes);
  __m512i x1 = _mm512_set1_epi32(int(position)), x2 = _mm512_set1_epi32(int(uint32_t(offset)));
  __m512i x3 = _mm512_set1_epi32(int(c3));
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
    __m512i hi0, lo0, hi1, lo1;
    mul_hi_lo16(x0, m0, hi0, lo0);
    mul_hi_lo16(x2, m1, hi1, lo1);
    const __m512i n0 = _mm512_xor_si512(_mm512_xor_si512(hi1, x1), _mm512_set1_epi32(int(k0)));
    const __m512i n2 = _mm512_xor_si512(_mm512_xor_si512(hi0, x3), _mm512_set1_epi32(int(k1)));
    x1 = lo1; x3 = lo0; x0 = n0; x2 = n2;
  }
  {
    // the 4 words of each call side by side, then 128-bit blocks transposed: block j of
    // result k holds call 4k + j's words
    const __m512i a_lo = _mm512_unpacklo_epi32(x0, x1), a_hi = _mm512_unpackhi_epi32(x0, x1);
    const __m512i b_lo = _mm512_unpacklo_epi32(x2, x3), b_hi = _mm512_unpackhi_epi32(x2, x3);
    const __m512i w0 = _mm512_unpacklo_epi64(a_lo, b_lo), w1 = _mm512_unpackhi_epi64(a_lo, b_lo);
    const __m512i w2 = _mm512_unpacklo_epi64(a_hi, b_hi), w3 = _mm512_unpackhi_epi64(a_hi, b_hi);
    const __m512i p = _mm512_shuffle_i32x4(w0, w1, _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i q = _mm512_shuffle_i32x4(w2, w3, _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i r = _mm512_shuffle_i32x4(w0, w1, _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i s = _mm512_shuffle_i32x4(w2, w3, _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i t[4] = {_mm512_shuffle_i32x4(p, q, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(p, q, _MM_SHUFFLE(3, 1, 3, 1)),
                          _mm512_shuffle_i32x4(r, s, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(r, s, _MM_SHUFFLE(3, 1, 3, 1))};
    const __m512 scale = _mm512_set1_ps(5.9604644775390625e-8f);
    float* out = u + 4 * c0;
    for (int k = 0; k < 4; ++k) {   // to_uniform: (2 * (bits >> 9) + 1) / 2^24
      const __m512i v = _mm512_or_si512(_mm512_slli_epi32(_mm512_srli_epi32(t[k], 9), 1),
                                        _mm512_set1_epi32(1));
      _mm512_storeu_ps(out + 16 * k, _mm512_mul_ps(_mm512_cvtepi32_ps(v), scale));
    }
  }
}

// bonus_uniforms, 16 calls (64 tokens) at a time, where the CPU has AVX-512 (2.5-2.8 against
// 6.3-6.4 us for 4,096 tokens on a Zen 4 core, the two functions timed in a loop)
BS_PHILOX_AVX512 inline void bonus_uniforms_avx512(int V, uint64_t seed, uint64_t offset,
                                                  uint32_t position, float* __restrict__ u) {
  const int calls = (V + 3) / 4;
  int c = 0;
  for (; c + 16 <= calls; c += 16) philox16(c, position, offset, seed, u);
  bonus_uniforms(V, seed, offset, position, u, c);   // the last calls, one at a time
}
#endif

#if defined(BS_HAVE_AVX512_PATH)
// Pass 2's test (bonus_filter's), 16 tokens at a time, where the CPU has AVX-512: the
// indices of the tokens that could beat b0, in increasing order, at idx; returns how many.
// exp16 and exp_nonpositive are the same reduction and polynomial (they may differ in a last
// bit), which cannot_win's margins cover as they cover either's error: a token dropped here
// cannot beat b0.
template <typename T>
BS_PHILOX_AVX512 int bonus_candidates_avx512(const T* row, int V, float inv_t, float thresh,
                                             float b0, const float* __restrict__ u,
                                             int32_t* __restrict__ idx) {
  const __m512 it = _mm512_set1_ps(inv_t), b0v = _mm512_set1_ps(b0), zero = _mm512_setzero_ps();
  const __m512 abs_b0 = _mm512_set1_ps(fabsf(b0)), th = _mm512_set1_ps(thresh);
  const __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int n = 0;
  for (int i = 0; i < V; i += 16) {
    const __mmask16 k = lanes(V - i);
    const __m512 z = _mm512_mul_ps(row16(row, i, k), it);
    const __m512 gap = _mm512_add_ps(
        _mm512_add_ps(_mm512_sub_ps(z, b0v), _mm512_set1_ps(1e-3f)),
        _mm512_mul_ps(_mm512_set1_ps(1e-5f), _mm512_add_ps(abs_b0, _mm512_abs_ps(z))));
    const __mmask16 neg = _mm512_cmp_ps_mask(gap, zero, _CMP_LT_OQ);
    // e^gap, or 2 for a gap of 0 or more (which never fails cannot_win: its bound is below 0)
    const __m512 y = _mm512_mask_blend_ps(neg, _mm512_set1_ps(2.f),
                                          exp16(_mm512_maskz_mov_ps(neg, gap)));
    const __m512 bound = _mm512_sub_ps(
        _mm512_sub_ps(_mm512_set1_ps(1.f), _mm512_mul_ps(y, _mm512_set1_ps(1.0001f))),
        _mm512_set1_ps(1e-6f));
    __mmask16 keep = k & _mm512_cmp_ps_mask(z, th, _CMP_GE_OQ) &
                     _mm512_cmp_ps_mask(z, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ) &
                     _mm512_cmp_ps_mask(_mm512_add_ps(z, _mm512_set1_ps(kMaxGumbel)), b0v,
                                        _CMP_NLT_UQ) &
                     _mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(k, u + i), bound, _CMP_NLT_UQ);
    // compressed in a register, then stored whole (idx has room for 16 past the last kept
    // index): the compressing store to memory is microcoded on AMD Zen 4, several times
    // slower here (9.3 against 1.9 us for 4,096 tokens, this function timed in a loop)
    _mm512_storeu_si512(idx + n, _mm512_maskz_compress_epi32(
                                     keep, _mm512_add_epi32(_mm512_set1_epi32(i), ids)));
    n += __builtin_popcount(keep);
  }
  return n;
}
#endif

template <typename T>
BS_CLONES void bonus_filter(const T* __restrict__ row, int V, float inv_t, float thresh,
                            float b0, const float* __restrict__ u, int32_t* __restrict__ cand) {
  for (int i = 0; i < V; ++i) {
    const float z = to_float(row[i]) * inv_t;
    const float gap = z - b0 + 1e-3f + 1e-5f * (fabsf(b0) + fabsf(z));
    // e^gap, or 2 for a gap above 0 (which never fails cannot_win: its bound is below 0)
    const float y = exp_nonpositive(gap < 0.f ? gap : 0.f) * (gap < 0.f ? 1.f : 2.f);
    // & rather than &&: no branches in the loop
    cand[i] = int32_t((z >= thresh) & (z != -INFINITY) & !(z + kMaxGumbel < b0) &
                      !cannot_win(u[i], y));
  }
}

// tokens whose scaled logit is within kMaxGumbel of b0 (those the generic loop draws for)
template <typename T>
BS_CLONES int within_gumbel(const T* __restrict__ row, int V, float inv_t, float b0) {
  int n = 0;
  for (int i = 0; i < V; ++i) n += int(!(to_float(row[i]) * inv_t + kMaxGumbel < b0));
  return n;
}

template <typename T>
int draw_bonus_host(const T* row, int V, float inv_t, float thresh, const TokenUniforms& tu,
                    int top) {
  const float z_top = to_float(row[top]) * inv_t;
  if (!(z_top >= thresh) || z_top == -INFINITY) return -1;   // -1: the caller's generic loop
  TokenUniforms t = tu;
  ArgMax best{z_top - logf(-logf(t(top))), top};
  // a peaked row (low temperature) leaves few tokens within kMaxGumbel of b0, and the
  // generic loop draws uniforms for those only: cheaper than this path's uniform per token
  if (within_gumbel<T>(row, V, inv_t, best.v) * 8 < V) return -1;
  thread_local std::vector<float> u;
  thread_local std::vector<int32_t> cand;
  u.resize(size_t(V + 3) / 4 * 4);
  cand.resize(size_t(V) + 16);   // (bonus_candidates_avx512 stores 16 indices at a time)
#if defined(BS_HAVE_AVX512_PATH)
  if (vec_row<T>(V)) {   // the uniforms 16 calls at a time, then the candidates' indices
    bonus_uniforms_avx512(V, tu.seed, tu.offset, tu.position, u.data());
    const int n = bonus_candidates_avx512<T>(row, V, inv_t, thresh, best.v, u.data(),
                                             cand.data());
    for (int c = 0; c < n; ++c) {
      const int i = cand[size_t(c)];
      if (i == top) continue;
      const float z = to_float(row[i]) * inv_t;
      best = argmax_op(best, ArgMax{z - logf(-logf(u[size_t(i)])), i});
    }
    return best.i;
  }
#endif
  bonus_uniforms(V, tu.seed, tu.offset, tu.position, u.data());
  bonus_filter<T>(row, V, inv_t, thresh, best.v, u.data(), cand.data());
  for (int i = 0; i < V; ++i) {
    if (!cand[size_t(i)] || i == top) continue;
    const float z = to_float(row[i]) * inv_t;
    best = argmax_op(best, ArgMax{z - logf(-logf(u[size_t(i)])), i});
  }
  return best.i;
}

}  // namespace bs
