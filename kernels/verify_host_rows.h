// Host-only passes over one row of logits for verify_core.h, included by the CPU build only:
// the row's max, min and sum of exp (row_filter), top-k's counts and top-k/top-p's sums
// above a threshold, the greedy argmax, and the corrected draw's weights max(0, p - q).
// AVX-512 over fp32 and bf16 rows, 16 tokens at a time, and AVX2 8 at a time (the tail past
// the last whole vector one token at a time), where the generic loops visit one token at a
// time and call expf for each: a speculating row at T > 0 runs row_filter once per draft it
// judges, so these passes are most of verification's work on the host.
//
// Sums run in 16 (or 8) lanes and exp is exp16 / exp8 (cpu_simd.h, ~2e-7 relative, about one
// float ulp): the same last-bit differences as between the backends already
// (docs/verification.md, "Backends and tolerance"). Counts, maxima and the argmax are exact.
// Each function returns false (or -1, or nullptr) where it does not apply, and the caller
// runs its generic loop: fp16 rows, rows shorter than a vector, a CPU without AVX2, a NaN or
// +inf among the scaled logits (malformed input keeps the generic loop's behaviour), or
// BATCHSPEC_VERIFY_HOST_DRAW=0.
#pragma once
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"

namespace bs {

// BATCHSPEC_VERIFY_HOST_DRAW=0 takes the generic loops instead (read once per call of the op,
// so that a benchmark or a test can compare the two in one process)
inline bool host_draw_env() {
  const char* e = std::getenv("BATCHSPEC_VERIFY_HOST_DRAW");
  return e == nullptr || e[0] != '0';
}
inline std::atomic<bool>& host_paths_on() {   // (atomic: ops may run on several threads)
  static std::atomic<bool> on{true};
  return on;
}

// A block of 8 tokens' sum as the draw takes it (draft_draw.h's block_sums): lanes summed
// pairwise, ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7)), the order reduce_add8 sums a
// vector's lanes in.
inline float sum8_pairwise(const float* x) {
  return ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]));
}

#if defined(BS_HAVE_AVX512_PATH)
// whether a vectorised pass takes a row of T, V wide: fp32 and bf16 rows of a vector or more
// (`width` lanes), where the CPU has the instructions (`cpu`) and the host paths are on
template <typename T>
inline bool vec_row_on(int V, int width, bool cpu) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, bf16>)
    return V >= width && host_paths_on() && cpu;
  else
    return false;
}

template <typename T>
inline bool vec_row(int V) { return vec_row_on<T>(V, 16, avx512_usable()); }

#define BS_ROW_AVX512 __attribute__((target("avx512f,avx512dq")))

BS_AVX512 __mmask16 lanes(int left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1); }

// row[i .. i+16) as floats, the lanes past the row's end zero (k: the lanes in the row)
template <typename T>
BS_AVX512 __m512 row16(const T* row, int i, __mmask16 k) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(k, row + i);
  } else {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(row) + i;
    if (k == 0xffff) return load16(p);
    alignas(32) uint16_t tail[16] = {};
    for (int j = 0; j < 16; ++j)
      if (k >> j & 1) tail[j] = p[j];
    return load16(tail);
  }
}

// scaled logits z = x * inv_t: max, min and sum of exp(z - max) over z != -inf (as
// row_filter's one pass); false: a NaN or +inf
template <typename T>
BS_ROW_AVX512 bool row_lse_avx512(const T* row, int V, float inv_t, float& m, float& zmin,
                                   float& s) {
  const __m512 it = _mm512_set1_ps(inv_t), pinf = _mm512_set1_ps(INFINITY);
  __m512 vmax = _mm512_set1_ps(-INFINITY), vmin = pinf;
  __mmask16 bad = 0;
  for (int i = 0; i < V; i += 16) {
    const __mmask16 k = lanes(V - i);
    const __m512 z = _mm512_mul_ps(row16(row, i, k), it);
    bad |= _mm512_mask_cmp_ps_mask(k, z, z, _CMP_UNORD_Q) |
           _mm512_mask_cmp_ps_mask(k, z, pinf, _CMP_EQ_OQ);
    vmax = _mm512_mask_max_ps(vmax, k, vmax, z);
    vmin = _mm512_mask_min_ps(vmin, k, vmin, z);
  }
  if (bad) return false;
  m = _mm512_reduce_max_ps(vmax);
  zmin = _mm512_reduce_min_ps(vmin);
  s = 0.f;
  if (m == -INFINITY) return true;
  const __m512 vm = _mm512_set1_ps(m), ninf = _mm512_set1_ps(-INFINITY);
  __m512 acc = _mm512_setzero_ps();
  for (int i = 0; i < V; i += 16) {
    const __mmask16 k = lanes(V - i);
    const __m512 z = _mm512_mul_ps(row16(row, i, k), it);
    const __mmask16 live = _mm512_mask_cmp_ps_mask(k, z, ninf, _CMP_NEQ_OQ);
    acc = _mm512_mask_add_ps(acc, live, acc, exp16(_mm512_sub_ps(z, vm)));
  }
  s = _mm512_reduce_add_ps(acc);
  return true;
}

// sum of exp(z - m) over z > thresh (strict) or z >= thresh, z != -inf
template <typename T>
BS_ROW_AVX512 float sum_exp_above_avx512(const T* row, int V, float inv_t, float m,
                                          float thresh, bool strict) {
  const __m512 it = _mm512_set1_ps(inv_t), vm = _mm512_set1_ps(m), th = _mm512_set1_ps(thresh),
               ninf = _mm512_set1_ps(-INFINITY);
  __m512 acc = _mm512_setzero_ps();
  for (int i = 0; i < V; i += 16) {
    const __mmask16 k = lanes(V - i);
    const __m512 z = _mm512_mul_ps(row16(row, i, k), it);
    const __mmask16 keep = (strict ? _mm512_mask_cmp_ps_mask(k, z, th, _CMP_GT_OQ)
                                   : _mm512_mask_cmp_ps_mask(k, z, th, _CMP_GE_OQ)) &
                           _mm512_cmp_ps_mask(z, ninf, _CMP_NEQ_OQ);
    acc = _mm512_mask_add_ps(acc, keep, acc, exp16(_mm512_sub_ps(z, vm)));
  }
  return _mm512_reduce_add_ps(acc);
}

// #{z >= x}
template <typename T>
BS_ROW_AVX512 int count_at_least_avx512(const T* row, int V, float inv_t, float x) {
  const __m512 it = _mm512_set1_ps(inv_t), vx = _mm512_set1_ps(x);
  int n = 0;
  for (int i = 0; i < V; i += 16) {
    const __mmask16 k = lanes(V - i);
    n += __builtin_popcount(
        _mm512_mask_cmp_ps_mask(k, _mm512_mul_ps(row16(row, i, k), it), vx, _CMP_GE_OQ));
  }
  return n;
}

// the first index of the row's largest value (as row_argmax); -1: a NaN in the row
template <typename T>
BS_ROW_AVX512 int argmax_avx512(const T* row, int V) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  __mmask16 bad = 0;
  for (int i = 0; i < V; i += 16) {
    const __mmask16 k = lanes(V - i);
    const __m512 x = row16(row, i, k);
    bad |= _mm512_mask_cmp_ps_mask(k, x, x, _CMP_UNORD_Q);
    vmax = _mm512_mask_max_ps(vmax, k, vmax, x);
  }
  if (bad) return -1;
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  for (int i = 0; i < V; i += 16) {
    const __mmask16 k = lanes(V - i);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(k, row16(row, i, k), m, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return -1;
}

// w[i] = p(i) - q(i), p(i) = exp(z - m) / s for z >= thresh (and z != -inf), else 0; q from
// q_row, or one-hot at `draft` when q_row is null
template <typename T>
BS_ROW_AVX512 void residual_avx512(const T* row, int V, float inv_t, float thresh, float m,
                                    float s, const float* q_row, int draft, float* w) {
  const __m512 it = _mm512_set1_ps(inv_t), vm = _mm512_set1_ps(m), vs = _mm512_set1_ps(s),
               th = _mm512_set1_ps(thresh), ninf = _mm512_set1_ps(-INFINITY);
  for (int i = 0; i < V; i += 16) {
    const __mmask16 k = lanes(V - i);
    const __m512 z = _mm512_mul_ps(row16(row, i, k), it);
    const __mmask16 kept = _mm512_mask_cmp_ps_mask(k, z, th, _CMP_GE_OQ) &
                           _mm512_cmp_ps_mask(z, ninf, _CMP_NEQ_OQ);
    const __m512 p = _mm512_maskz_div_ps(kept, exp16(_mm512_sub_ps(z, vm)), vs);
    const __m512 q = q_row ? _mm512_maskz_loadu_ps(k, q_row + i) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(w + i, k, _mm512_sub_ps(p, q));
  }
  if (!q_row && 0 <= draft && draft < V) w[draft] -= 1.f;
}
#endif

#if defined(BS_HAVE_AVX512_PATH)
// ---- AVX2 (CPUs without AVX-512: AMD Zen 1-3, Intel client cores): the same passes 8 tokens
// at a time, the tail past the last whole vector by the scalar exp_nonpositive
#define BS_ROW_AVX2 __attribute__((target("avx2,fma")))

template <typename T>
inline bool avx2_row(int V) { return vec_row_on<T>(V, 8, avx2_usable()); }

// The row's max, min and sum of exp(z - max) over z > -inf; with `e`, each token's exp(z - max)
// (0 at -inf) written there as it is summed (softmax_avx2).
template <typename T>
BS_ROW_AVX2 bool row_lse_avx2(const T* row, int V, float inv_t, float& m, float& zmin, float& s,
                              float* e = nullptr) {
  const int whole = V / 8 * 8;
  const __m256 it = _mm256_set1_ps(inv_t), pinf = _mm256_set1_ps(INFINITY);
  __m256 vmax = _mm256_set1_ps(-INFINITY), vmin = pinf, bad = _mm256_setzero_ps();
  for (int i = 0; i < whole; i += 8) {
    const __m256 z = _mm256_mul_ps(load8(row + i), it);
    bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_cmp_ps(z, z, _CMP_UNORD_Q),
                                         _mm256_cmp_ps(z, pinf, _CMP_EQ_OQ)));
    vmax = _mm256_max_ps(vmax, z);
    vmin = _mm256_min_ps(vmin, z);
  }
  if (_mm256_movemask_ps(bad)) return false;
  m = reduce_max8(vmax);
  zmin = reduce_min8(vmin);
  for (int i = whole; i < V; ++i) {
    const float z = to_float(row[i]) * inv_t;
    if (z != z || z == INFINITY) return false;
    m = z > m ? z : m;
    zmin = z < zmin ? z : zmin;
  }
  s = 0.f;
  if (m == -INFINITY) return true;
  const __m256 vm = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-INFINITY);
  __m256 acc = _mm256_setzero_ps();
  if (e) {   // (two loops: a test in the loop cost the softmax 5-8%)
    for (int i = 0; i < whole; i += 8) {
      const __m256 z = _mm256_mul_ps(load8(row + i), it);
      const __m256 x = _mm256_and_ps(_mm256_cmp_ps(z, ninf, _CMP_NEQ_OQ),
                                     exp8(_mm256_sub_ps(z, vm)));
      _mm256_storeu_ps(e + i, x);
      acc = _mm256_add_ps(acc, x);
    }
  } else {
    for (int i = 0; i < whole; i += 8) {
      const __m256 z = _mm256_mul_ps(load8(row + i), it);
      const __m256 live = _mm256_cmp_ps(z, ninf, _CMP_NEQ_OQ);
      acc = _mm256_add_ps(acc, _mm256_and_ps(live, exp8(_mm256_sub_ps(z, vm))));
    }
  }
  s = reduce_add8(acc);
  for (int i = whole; i < V; ++i) {
    const float z = to_float(row[i]) * inv_t;
    const float x = z != -INFINITY ? exp_nonpositive(z - m) : 0.f;
    if (e) e[i] = x;
    if (z != -INFINITY) s += x;
  }
  return true;
}

template <typename T>
BS_ROW_AVX2 float sum_exp_above_avx2(const T* row, int V, float inv_t, float m, float thresh,
                                     bool strict) {
  const int whole = V / 8 * 8;
  const __m256 it = _mm256_set1_ps(inv_t), vm = _mm256_set1_ps(m), th = _mm256_set1_ps(thresh),
               ninf = _mm256_set1_ps(-INFINITY);
  __m256 acc = _mm256_setzero_ps();
  for (int i = 0; i < whole; i += 8) {
    const __m256 z = _mm256_mul_ps(load8(row + i), it);
    const __m256 keep = _mm256_and_ps(strict ? _mm256_cmp_ps(z, th, _CMP_GT_OQ)
                                             : _mm256_cmp_ps(z, th, _CMP_GE_OQ),
                                      _mm256_cmp_ps(z, ninf, _CMP_NEQ_OQ));
    acc = _mm256_add_ps(acc, _mm256_and_ps(keep, exp8(_mm256_sub_ps(z, vm))));
  }
  float s = reduce_add8(acc);
  for (int i = whole; i < V; ++i) {
    const float z = to_float(row[i]) * inv_t;
    if ((strict ? z > thresh : z >= thresh) && z != -INFINITY) s += exp_nonpositive(z - m);
  }
  return s;
}

template <typename T>
BS_ROW_AVX2 int count_at_least_avx2(const T* row, int V, float inv_t, float x) {
  const int whole = V / 8 * 8;
  const __m256 it = _mm256_set1_ps(inv_t), vx = _mm256_set1_ps(x);
  int n = 0;
  for (int i = 0; i < whole; i += 8)
    n += __builtin_popcount(unsigned(_mm256_movemask_ps(
        _mm256_cmp_ps(_mm256_mul_ps(load8(row + i), it), vx, _CMP_GE_OQ))));
  for (int i = whole; i < V; ++i) n += to_float(row[i]) * inv_t >= x;
  return n;
}

// The argmax on CPUs with AVX2 but not AVX-512 (the drafts' greedy tokens every step, the
// target's at T=0): the maximum 8 lanes at a time, then its first index; -1 where the row
// has a NaN (the caller's loop takes the first, as torch does). A row of 4,096 fp32 logits
// took 21 us in that loop.
template <typename T>
BS_ROW_AVX2 int argmax_avx2(const T* row, int V) {
  const int whole = V / 8 * 8;
  __m256 vmax = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
  for (int i = 0; i < whole; i += 8) {
    const __m256 x = load8(row + i);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    vmax = _mm256_max_ps(vmax, x);
  }
  if (_mm256_movemask_ps(bad)) return -1;
  float m = reduce_max8(vmax);
  for (int i = whole; i < V; ++i) {
    const float x = to_float(row[i]);
    if (x != x) return -1;
    m = x > m ? x : m;
  }
  const __m256 vm = _mm256_set1_ps(m);
  for (int i = 0; i < whole; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(load8(row + i), vm, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(unsigned(hit));
  }
  for (int i = whole; i < V; ++i)
    if (to_float(row[i]) == m) return i;
  return -1;
}

// q = softmax(x * inv_t) of an fp32 row (tokens at -inf get 0): the max, then exp(z - max)
// into q with their sum (row_lse_avx2), then q / sum; false (q untouched) for a NaN or +inf,
// or a row all -inf: the caller's loop gives what torch gives. With `blocks`, also each block
// of 8 tokens' sum of q as the draw takes it (sum8_pairwise, the last block's missing tokens
// 0): the draw then reads q once more only within the block it lands in (draft_draw.h).
BS_ROW_AVX2 inline bool softmax_avx2(const float* row, int V, float inv_t, float* q,
                                     float* blocks = nullptr) {
  const int whole = V / 8 * 8;
  float m, zmin, s;
  if (!row_lse_avx2(row, V, inv_t, m, zmin, s, q) || m == -INFINITY) return false;
  const __m256 vs = _mm256_set1_ps(s);
  for (int i = 0; i < whole; i += 8) {
    const __m256 x = _mm256_div_ps(_mm256_loadu_ps(q + i), vs);
    _mm256_storeu_ps(q + i, x);
    if (blocks) blocks[i / 8] = reduce_add8(x);
  }
  for (int i = whole; i < V; ++i) q[i] /= s;
  if (blocks && whole < V) {
    float x[8] = {};
    for (int j = 0; whole + j < V; ++j) x[j] = q[whole + j];
    blocks[whole / 8] = sum8_pairwise(x);
  }
  return true;
}

template <typename T>
BS_ROW_AVX2 void residual_avx2(const T* row, int V, float inv_t, float thresh, float m, float s,
                               const float* q_row, int draft, float* w) {
  const int whole = V / 8 * 8;
  const __m256 it = _mm256_set1_ps(inv_t), vm = _mm256_set1_ps(m), vs = _mm256_set1_ps(s),
               th = _mm256_set1_ps(thresh), ninf = _mm256_set1_ps(-INFINITY);
  for (int i = 0; i < whole; i += 8) {
    const __m256 z = _mm256_mul_ps(load8(row + i), it);
    const __m256 kept = _mm256_and_ps(_mm256_cmp_ps(z, th, _CMP_GE_OQ),
                                      _mm256_cmp_ps(z, ninf, _CMP_NEQ_OQ));
    const __m256 p = _mm256_and_ps(kept, _mm256_div_ps(exp8(_mm256_sub_ps(z, vm)), vs));
    const __m256 q = q_row ? _mm256_loadu_ps(q_row + i) : _mm256_setzero_ps();
    _mm256_storeu_ps(w + i, _mm256_sub_ps(p, q));
  }
  for (int i = whole; i < V; ++i) {
    const float z = to_float(row[i]) * inv_t;
    const float p = z >= thresh && z != -INFINITY ? exp_nonpositive(z - m) / s : 0.f;
    w[i] = p - (q_row ? q_row[i] : 0.f);
  }
  if (!q_row && 0 <= draft && draft < V) w[draft] -= 1.f;
}
#endif

// ---- what verify_core.h calls --------------------------------------------------------------
template <typename T>
bool host_row_lse(const T* row, int V, float inv_t, float& m, float& zmin, float& s) {
#if defined(BS_HAVE_AVX512_PATH)
  if (vec_row<T>(V)) return row_lse_avx512(row, V, inv_t, m, zmin, s);
  if (avx2_row<T>(V)) return row_lse_avx2(row, V, inv_t, m, zmin, s);
#endif
  return false;
}

template <typename T>
bool host_sum_exp_above(const T* row, int V, float inv_t, float m, float thresh, bool strict,
                        float& s) {
#if defined(BS_HAVE_AVX512_PATH)
  if (vec_row<T>(V)) {
    s = sum_exp_above_avx512(row, V, inv_t, m, thresh, strict);
    return true;
  }
  if (avx2_row<T>(V)) {
    s = sum_exp_above_avx2(row, V, inv_t, m, thresh, strict);
    return true;
  }
#endif
  return false;
}

template <typename T>
bool host_count_at_least(const T* row, int V, float inv_t, float x, float& n) {
#if defined(BS_HAVE_AVX512_PATH)
  if (vec_row<T>(V)) {
    n = float(count_at_least_avx512(row, V, inv_t, x));
    return true;
  }
  if (avx2_row<T>(V)) {
    n = float(count_at_least_avx2(row, V, inv_t, x));
    return true;
  }
#endif
  return false;
}

template <typename T>
int host_argmax(const T* row, int V) {
#if defined(BS_HAVE_AVX512_PATH)
  if (vec_row<T>(V)) return argmax_avx512(row, V);
  if (avx2_row<T>(V)) return argmax_avx2(row, V);
#endif
  return -1;
}

// the corrected draw's weights in a per-thread buffer, or nullptr
template <typename T>
const float* host_residual(const T* row, int V, float inv_t, float thresh, float m, float s,
                           const float* q_row, int draft) {
#if defined(BS_HAVE_AVX512_PATH)
  const bool wide = vec_row<T>(V);
  if (wide || avx2_row<T>(V)) {
    thread_local std::vector<float> w;
    w.resize(size_t(V));
    if (wide) residual_avx512(row, V, inv_t, thresh, m, s, q_row, draft, w.data());
    else residual_avx2(row, V, inv_t, thresh, m, s, q_row, draft, w.data());
    return w.data();
  }
#endif
  return nullptr;
}

// q = softmax(x * inv_t) of an fp32 row by the vectorised pass; false: the caller's loop
inline bool host_softmax(const float* row, int V, float inv_t, float* q,
                         float* blocks = nullptr) {
#if defined(BS_HAVE_AVX512_PATH)
  if (avx2_row<float>(V)) return softmax_avx2(row, V, inv_t, q, blocks);
#endif
  return false;
}

}  // namespace bs
