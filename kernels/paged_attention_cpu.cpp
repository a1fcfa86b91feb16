// Attention of short query rows (decodes, verification windows, draft steps) straight over
// the paged KV cache on CPU: no gathered copy of each row's keys and values, which at large
// batch and long context is most of the memory traffic of a decode step.
//
// One task per (row, KV head): the row's q_len x G query heads that read this KV head walk
// the row's keys once, through its block table, with an online softmax in fp32. Causal: query
// j of a row with kv_len keys (its new tokens included) sees positions 0 .. kv_len - q_len + j.
// Paths: portable C++; AVX-512 and AVX2 (x86-64); AMX tiles for every bf16 task on CPUs that
// have them, else pair products (AVX512-BF16) for bf16 heads of 32-128 dimensions, a task
// per row. Where rows are fewer than threads, rows of many queries are cut into pieces and
// pair products take a task per KV head (pieces, attend): outputs are the same at any thread
// count.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#include "cpu_simd.h"
#include "kv_write.h"

namespace {

// Three paths: on x86-64 CPUs with AVX-512 (most servers), explicit AVX-512 code below; with
// AVX2 and FMA only, explicit AVX2 code; on others, this portable C++ one. All compute in fp32
// and differ only in the order of sums.
//
// Portable path: keys and values are read CHUNK at a time and converted to fp32 once: keys transposed
// ([D][CHUNK]) so that a query's scores against the chunk are CHUNK-wide multiply-adds with
// no horizontal sums, values as rows. Each query then folds the chunk into its running
// softmax with one rescale per chunk. All inner loops are plain arithmetic over arrays, which
// the compiler vectorises.
constexpr int64_t CHUNK = 64;
constexpr int LANES = 16;   // CHUNK is a multiple

using bs::exp_nonpositive;

// The cache slots of keys p0, p0 + 1, ... of a row, through its block table: a block's first
// slot plus the key's offset in it, no division per key.
struct SlotWalk {
  const int64_t* table;
  int64_t block_size, blk, off, base;
  SlotWalk(const int64_t* t, int64_t p0, int64_t bs)
      : table(t), block_size(bs), blk(p0 / bs), off(p0 % bs), base(t[p0 / bs] * bs) {}
  // the next key's slot; `more`: a key follows it (the table is read past a block only then)
  int64_t next(bool more) {
    const int64_t slot = base + off;
    if (++off == block_size) {
      off = 0;
      base = more ? table[++blk] * block_size : 0;
    }
    return slot;
  }
};

template <typename T>
BS_CLONES void attend_task(const T* q, const T* kc, const T* vc, T* out, const int64_t* table,
                           int64_t t0, int64_t nq, int64_t nkv, int64_t kvh, int64_t Hq,
                           int64_t Hkv, int64_t D, int64_t block_size, float scale,
                           std::vector<float>& qf, std::vector<float>& acc,
                           std::vector<float>& mx, std::vector<float>& sum,
                           std::vector<float>& kt, std::vector<float>& vf,
                           std::vector<float>& sc) {
  const int64_t G = Hq / Hkv;
  const int64_t n = nq * G;  // query vectors, (j, g) order
  qf.assign(n * D, 0.f);
  acc.assign(n * D, 0.f);
  mx.assign(n, -std::numeric_limits<float>::infinity());
  sum.assign(n, 0.f);
  for (int64_t j = 0; j < nq; ++j)
    for (int64_t g = 0; g < G; ++g) {
      const T* src = q + ((t0 + j) * Hq + kvh * G + g) * D;
      float* dst = qf.data() + (j * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * scale;
    }
  float* kT = kt.data();
  float* s = sc.data();
  for (int64_t p0 = 0; p0 < nkv; p0 += CHUNK) {
    const int64_t pn = std::min(CHUNK, nkv - p0);
    SlotWalk walk(table, p0, block_size);
    for (int64_t c = 0; c < pn; ++c) {
      const int64_t slot = walk.next(c + 1 < pn);
      const T* kp = kc + (slot * Hkv + kvh) * D;
      const T* vp = vc + (slot * Hkv + kvh) * D;
      float* vd = vf.data() + c * D;
      for (int64_t d = 0; d < D; ++d) {
        kT[d * CHUNK + c] = static_cast<float>(kp[d]);
        vd[d] = static_cast<float>(vp[d]);
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      // causal: query j sees keys 0 .. nkv - nq + j
      const int64_t seen = std::min(pn, nkv - nq + i / G + 1 - p0);
      if (seen <= 0) continue;
      const float* qi = qf.data() + i * D;
      for (int64_t c = 0; c < CHUNK; ++c) s[c] = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        const float qd = qi[d];
        const float* krow = kT + d * CHUNK;
        for (int64_t c = 0; c < CHUNK; ++c) s[c] += qd * krow[c];
      }
      // max and sum over the whole chunk in LANES partial results (a single running max or
      // sum is a serial chain the compiler may not reorder); keys past `seen` weigh 0
      for (int64_t c = seen; c < CHUNK; ++c) s[c] = -std::numeric_limits<float>::infinity();
      float part[LANES];
      for (int l = 0; l < LANES; ++l) part[l] = mx[i];
      for (int64_t c = 0; c < CHUNK; c += LANES)
        for (int l = 0; l < LANES; ++l) part[l] = part[l] < s[c + l] ? s[c + l] : part[l];
      float m = part[0];
      for (int l = 1; l < LANES; ++l) m = std::max(m, part[l]);
      for (int l = 0; l < LANES; ++l) part[l] = 0.f;
      for (int64_t c = 0; c < CHUNK; c += LANES)
        for (int l = 0; l < LANES; ++l) {
          const float x = s[c + l];
          const float w = exp_nonpositive(x - m);
          s[c + l] = x == -std::numeric_limits<float>::infinity() ? 0.f : w;
          part[l] += s[c + l];
        }
      float total = 0.f;
      for (int l = 0; l < LANES; ++l) total += part[l];
      float* a = acc.data() + i * D;
      const float rescale = exp_nonpositive(mx[i] - m);  // 0 on the first chunk (mx = -inf)
      for (int64_t d = 0; d < D; ++d) a[d] *= rescale;
      for (int64_t c = 0; c < seen; ++c) {
        const float w = s[c];
        const float* vd = vf.data() + c * D;
        for (int64_t d = 0; d < D; ++d) a[d] += w * vd[d];
      }
      sum[i] = sum[i] * rescale + total;
      mx[i] = m;
    }
  }
  for (int64_t j = 0; j < nq; ++j)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = j * G + g;
      T* dst = out + ((t0 + j) * Hq + kvh * G + g) * D;
      const float inv = sum[i] > 0.f ? 1.f / sum[i] : 0.f;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[i * D + d] * inv);
    }
}

#ifdef BS_HAVE_AVX512_PATH
using bs::exp16;
using bs::load16;

// A task's buffers for n query vectors of D: queries (written next), value sums, running
// maxima and softmax totals, each at its start.
inline void start_task(std::vector<float>& qf, std::vector<float>& acc, std::vector<float>& mx,
                       std::vector<float>& sum, int64_t n, int64_t D) {
  qf.resize(n * D);
  acc.assign(n * D, 0.f);
  mx.assign(n, -std::numeric_limits<float>::infinity());
  sum.assign(n, 0.f);
}

// A task's results: each query's value sums over its softmax total, to the model dtype (T:
// float, or uint16_t holding bf16) at the query's place in out.
template <typename T>
void write_task(T* out, const float* acc, const float* sum, int64_t t0, int64_t nq, int64_t G,
                int64_t Hq, int64_t kvh, int64_t D) {
  for (int64_t j = 0; j < nq; ++j)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = j * G + g;
      T* dst = out + ((t0 + j) * Hq + kvh * G + g) * D;
      const float inv = sum[i] > 0.f ? 1.f / sum[i] : 0.f;
      for (int64_t d = 0; d < D; ++d) {
        const float x = acc[i * D + d] * inv;
        if constexpr (std::is_same_v<T, float>) dst[d] = x;
        else dst[d] = c10::BFloat16(x).x;  // round to nearest even, as torch does
      }
    }
}

// The AVX-512 path: keys CHUNK at a time, each key row converted to fp32 once and dotted with
// every query of the task (no transposed copy); a query's per-key partial sums are folded,
// KEYS keys at a time, into vectors of scores by a transpose-and-add tree, and the chunk is
// folded into the running softmax with one rescale. Scores, softmax and the
// value sums are fp32, as in the portable path; only the order of additions differs.
constexpr int64_t KEYS = 16;

// out lane c = sum of the lanes of a[c], for c in 0..15
BS_AVX512 __m512 transpose_sum16(const __m512* a) {
  __m512 s8[8], s4[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3)
    s8[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                          _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int j = 0; j < 4; ++j)  // per 128-bit lane: partial sums of keys 4j .. 4j+3
    s4[j] = _mm512_add_ps(_mm512_shuffle_ps(s8[2 * j], s8[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s8[2 * j], s8[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 t01 = _mm512_add_ps(_mm512_shuffle_f32x4(s4[0], s4[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(s4[0], s4[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 t23 = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2], s4[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(s4[2], s4[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(t01, t23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(t01, t23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// A chunk's scores (ng vectors of KEYS keys, lanes `live`; `top` their max with the running
// max mx) folded into a query's running softmax: the weights exp(score - new max) to w (0
// in lanes not live), the max and the total updated. Returns the factor the query's value
// sums so far are to be scaled by.
BS_AVX512 float fold_scores(const __m512* sc, const __mmask16* live, int64_t ng, __m512 top,
                            float& mx, float& sum, float* w) {
  const float m = _mm512_reduce_max_ps(top);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 total = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < ng; ++gi) {
    const __m512 e = _mm512_maskz_mov_ps(live[gi], exp16(_mm512_sub_ps(sc[gi], vm)));
    total = _mm512_add_ps(total, e);
    _mm512_storeu_ps(w + gi * KEYS, e);
  }
  const float rescale =
      mx == -std::numeric_limits<float>::infinity() ? 0.f : exp_nonpositive(mx - m);
  sum = sum * rescale + _mm512_reduce_add_ps(total);
  mx = m;
  return rescale;
}

// One (row, KV head) task; NV = D / 16 vectors per head row.
template <typename T, int NV>
__attribute__((target("avx512f,avx512dq"))) void attend_task_avx512(
    const T* q, const T* kc, const T* vc, T* out, const int64_t* table, int64_t t0,
    int64_t nq, int64_t nkv, int64_t kvh, int64_t Hq, int64_t Hkv, int64_t block_size,
    float scale, std::vector<float>& qf, std::vector<float>& acc, std::vector<float>& mx,
    std::vector<float>& sum, std::vector<float>& kf, std::vector<float>& vf) {
  constexpr int64_t D = NV * 16;
  const int64_t G = Hq / Hkv;
  const int64_t n = nq * G;  // query vectors, (j, g) order
  start_task(qf, acc, mx, sum, n, D);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < nq; ++j)
    for (int64_t g = 0; g < G; ++g) {
      const T* src = q + ((t0 + j) * Hq + kvh * G + g) * D;
      for (int v = 0; v < NV; ++v)
        _mm512_storeu_ps(qf.data() + (j * G + g) * D + v * 16,
                         _mm512_mul_ps(load16(src + v * 16), vscale));
    }
  float* K = kf.data();
  float* V = vf.data();
  alignas(64) float w[CHUNK];
  for (int64_t p0 = 0; p0 < nkv; p0 += CHUNK) {
    const int64_t pn = std::min(CHUNK, nkv - p0);
    const int64_t groups = (pn + KEYS - 1) / KEYS;
    SlotWalk walk(table, p0, block_size);
    for (int64_t c = 0; c < groups * KEYS; ++c) {
      if (c < pn) {
        const int64_t slot = walk.next(c + 1 < pn);
        const T* kp = kc + (slot * Hkv + kvh) * D;
        const T* vp = vc + (slot * Hkv + kvh) * D;
        for (int v = 0; v < NV; ++v) {
          _mm512_storeu_ps(K + c * D + v * 16, load16(kp + v * 16));
          _mm512_storeu_ps(V + c * D + v * 16, load16(vp + v * 16));
        }
      } else {
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(K + c * D + v * 16, _mm512_setzero_ps());
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      // causal: query j sees keys 0 .. nkv - nq + j
      const int64_t seen = std::min(pn, nkv - nq + i / G + 1 - p0);
      if (seen <= 0) continue;
      const float* qi = qf.data() + i * D;
      __m512 qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = _mm512_loadu_ps(qi + v * 16);
      // scores of the chunk's keys, KEYS at a time; keys past `seen` weigh 0
      __m512 sc[CHUNK / KEYS];
      __mmask16 live[CHUNK / KEYS];
      __m512 top = _mm512_set1_ps(mx[i]);
      const int64_t ng = (seen + KEYS - 1) / KEYS;
      for (int64_t gi = 0; gi < ng; ++gi) {
        __m512 part[KEYS];
        const float* Kg = K + gi * KEYS * D;
        for (int c = 0; c < KEYS; ++c) {
          __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(Kg + c * D));
          for (int v = 1; v < NV; ++v)
            s = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(Kg + c * D + v * 16), s);
          part[c] = s;
        }
        const int64_t left = std::min<int64_t>(KEYS, seen - gi * KEYS);
        live[gi] = static_cast<__mmask16>((1u << left) - 1u);
        sc[gi] = transpose_sum16(part);
        top = _mm512_mask_max_ps(top, live[gi], top, sc[gi]);
      }
      const float rescale = fold_scores(sc, live, ng, top, mx[i], sum[i], w);
      float* a = acc.data() + i * D;
      __m512 av[NV];
      const __m512 vr = _mm512_set1_ps(rescale);
      for (int v = 0; v < NV; ++v) av[v] = _mm512_mul_ps(_mm512_loadu_ps(a + v * 16), vr);
      for (int64_t c = 0; c < seen; ++c) {
        const __m512 wc = _mm512_set1_ps(w[c]);
        for (int v = 0; v < NV; ++v)
          av[v] = _mm512_fmadd_ps(wc, _mm512_loadu_ps(V + c * D + v * 16), av[v]);
      }
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(a + v * 16, av[v]);
    }
  }
  write_task<T>(out, acc.data(), sum.data(), t0, nq, G, Hq, kvh, D);
}

// bf16 on CPUs with AVX512-BF16 and no AMX tiles (AMD Zen 4 and later, Intel Cooper Lake):
// the AVX-512 path's order of work without its fp32 copies of keys and values. A key's
// scores are pair products (VDPBF16PS) of the query's bf16 row and the key's, read where
// they lie in the cache: two products add into each of 16 lanes (exact products, fp32 sums),
// and the AVX-512 path's transpose-and-add tree folds 16 keys' lanes into a vector of
// scores, scaled in fp32. The softmax is the AVX-512 path's. The value sums run for up to
// QG queries at a time (dp_group): each value row is widened to fp32 once for them, and
// their sums stay in registers over a chunk. Why: the AVX-512 path writes each key and
// value row of a chunk to fp32 buffers (8 vector stores a key at 64 dimensions), which with
// its scores' fp32 products made a decode step's attention at 32 rows 2.0 of the demo
// target's 4.7 ms forward on an AVX512-BF16 CPU; this path takes 1.5 (docs/benchmarks.md).
// A query's scores, softmax and sums depend only on its own row and the keys it sees, in
// an order fixed from key 0 (chunks of CHUNK, groups of KEYS): a key beyond what a query
// sees, in a value sum run for its group, adds 0 x its value, which leaves the sum as it
// is. So a query gets the same result in a window, in any group, and decoded alone.
#define BS_ATTN_DP __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16")))

// queries whose value sums (QG x NV vectors of 16) are held in registers at once
template <int NV>
constexpr int dp_group() { return NV <= 4 ? 6 : 2; }

// value sums of QN queries over keys [0, upto) of a chunk: a[r] += w[r][c] x V[c], in order
template <int NV, int QN>
BS_ATTN_DP void dp_values(const uint16_t* const* vp, int64_t upto, const float* w,
                          float* const* a, const float* rescale) {
  __m512 s[QN][NV];
  _Pragma("GCC unroll 8") for (int r = 0; r < QN; ++r) {
    const __m512 rs = _mm512_set1_ps(rescale[r]);
    _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v)
      s[r][v] = _mm512_mul_ps(_mm512_loadu_ps(a[r] + v * 16), rs);
  }
  for (int64_t c = 0; c < upto; ++c) {
    __m512 vv[NV];
    _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v) vv[v] = load16(vp[c] + v * 16);
    _Pragma("GCC unroll 8") for (int r = 0; r < QN; ++r) {
      const __m512 wc = _mm512_set1_ps(w[r * CHUNK + c]);
      _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v)
        s[r][v] = _mm512_fmadd_ps(wc, vv[v], s[r][v]);
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < QN; ++r)
    _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v) _mm512_storeu_ps(a[r] + v * 16, s[r][v]);
}

// One row's task, its KV heads h0 .. h1 - 1, bf16 queries and caches; NV = D / 16 (D a
// multiple of 32). A chunk's keys are walked once for all the task's heads, each head
// taking the chunk in turn, and with several KV heads the next chunk's slots (every head's
// keys and values, side by side in a slot) are asked for (prefetched) a few at a time while
// the first query's scores run. Why: a decode step's keys and values at 32 rows and more
// come from memory, and a head's pass reads every other run of D bf16 of them, a stride the
// hardware's prefetcher follows poorly. At 32 rows of 700 keys, over six layers' caches
// (throwaway timings), a decode's attention took 1.46-1.51 ms a layer asking for nothing,
// 1.05-1.51 (from build to build) asking for the whole next chunk at once, 0.92-1.03 asking
// as here, and 1.55-1.69 on the AVX-512 path (a task per row and KV head). Asking for the
// next row's first chunk before a row, too, was within the noise (0.96-1.01 ms without it).
// With one KV head a chunk's rows lie back to back and the hardware alone streams them
// (16.6 GB/s); a task of one head of several asks for nothing either.
// A task takes every KV head of its row unless the rows are fewer than the threads
// (attend). acc, mx, sum: (h1 - h0) * n query vectors' sums, maxima and totals (n = q_len x
// G a head).
template <int NV>
BS_ATTN_DP void attend_row_dp(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                              uint16_t* out, const int64_t* table, int64_t t0, int64_t nq,
                              int64_t nkv, int64_t Hq, int64_t Hkv, int64_t h0, int64_t h1,
                              int64_t block_size, float scale, std::vector<float>& acc,
                              std::vector<float>& mx, std::vector<float>& sum,
                              std::vector<float>& wf) {
  constexpr int64_t D = NV * 16;
  constexpr int NB = NV / 2;   // vectors of 32 bf16 (16 pairs) per head row
  constexpr int QG = dp_group<NV>();
  const int64_t G = Hq / Hkv;
  const int64_t n = nq * G;    // a head's query vectors, (j, g) order
  const int64_t nh = h1 - h0;
  acc.assign(nh * n * D, 0.f);
  mx.assign(nh * n, -std::numeric_limits<float>::infinity());
  sum.assign(nh * n, 0.f);
  wf.resize(QG * CHUNK);
  const __m512 vscale = _mm512_set1_ps(scale);
  int64_t slots[CHUNK], next[CHUNK];
  const uint16_t* kp[CHUNK];
  const uint16_t* vp[CHUNK];
  for (int64_t p0 = 0; p0 < nkv; p0 += CHUNK) {
    const int64_t pn = std::min(CHUNK, nkv - p0);
    SlotWalk walk(table, p0, block_size);
    for (int64_t c = 0; c < pn; ++c) slots[c] = walk.next(c + 1 < pn);
    // the next chunk's slots, asked for a few at a time while the first query's scores run
    // (inline: the same requests through a call of a function with the path's target, which
    // a lambda cannot inline, took 1.31-1.40 ms a layer where these take 0.92-1.03)
    int64_t npn = 0, asked = 0;
    if (nh > 1 && p0 + CHUNK < nkv) {
      npn = std::min(CHUNK, nkv - p0 - CHUNK);
      SlotWalk ahead(table, p0 + CHUNK, block_size);
      for (int64_t c = 0; c < npn; ++c) next[c] = ahead.next(c + 1 < npn);
    }
    const auto ask = [&](int64_t upto) {
      for (; asked < upto; ++asked) {
        const int64_t at = next[asked] * Hkv * D;
        for (int64_t b = 0; b < Hkv * D * 2; b += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(kc + at) + b, _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(vc + at) + b, _MM_HINT_T1);
        }
      }
    };
    for (int64_t kvh = h0; kvh < h1; ++kvh) {
      for (int64_t c = 0; c < pn; ++c) {
        kp[c] = kc + (slots[c] * Hkv + kvh) * D;
        vp[c] = vc + (slots[c] * Hkv + kvh) * D;
      }
      for (int64_t c = pn; c < CHUNK; ++c) kp[c] = kp[pn - 1];   // read, never counted
      for (int64_t i0 = 0; i0 < n; i0 += QG) {
        const int qn = static_cast<int>(std::min<int64_t>(QG, n - i0));
        float rescale[QG];
        float* a[QG];
        int64_t upto = 0;   // keys of the chunk any of the group's queries sees
        for (int r = 0; r < qn; ++r) {
          const int64_t i = i0 + r, h = (kvh - h0) * n + i;   // the query's place in the state
          a[r] = acc.data() + h * D;
          float* w = wf.data() + r * CHUNK;
          rescale[r] = 1.f;
          // causal: query j sees keys 0 .. nkv - nq + j
          const int64_t seen = std::min(pn, nkv - nq + i / G + 1 - p0);
          if (seen <= 0) {
            std::fill(w, w + CHUNK, 0.f);
            continue;
          }
          upto = std::max(upto, seen);
          const uint16_t* src = q + ((t0 + i / G) * Hq + kvh * G + i % G) * D;
          __m512bh qv[NB];
          _Pragma("GCC unroll 8") for (int b = 0; b < NB; ++b)
            qv[b] = (__m512bh)_mm512_loadu_si512(src + b * 32);
          __m512 sc[CHUNK / KEYS];
          __mmask16 live[CHUNK / KEYS];
          __m512 top = _mm512_set1_ps(mx[h]);
          const int64_t ng = (seen + KEYS - 1) / KEYS;
          for (int64_t gi = 0; gi < ng; ++gi) {
            __m512 part[KEYS];
            _Pragma("GCC unroll 16") for (int c = 0; c < KEYS; ++c) {
              const uint16_t* k = kp[gi * KEYS + c];
              __m512 s = _mm512_setzero_ps();
              _Pragma("GCC unroll 8") for (int b = 0; b < NB; ++b)
                s = _mm512_dpbf16_ps(s, qv[b], (__m512bh)_mm512_loadu_si512(k + b * 32));
              part[c] = s;
            }
            const int64_t left = std::min<int64_t>(KEYS, seen - gi * KEYS);
            live[gi] = static_cast<__mmask16>((1u << left) - 1u);
            sc[gi] = _mm512_mul_ps(transpose_sum16(part), vscale);
            top = _mm512_mask_max_ps(top, live[gi], top, sc[gi]);
            if (h == 0) ask((gi + 1) * npn / ng);
          }
          rescale[r] = fold_scores(sc, live, ng, top, mx[h], sum[h], w);
          std::fill(w + ng * KEYS, w + CHUNK, 0.f);
        }
        if (upto == 0) continue;
        const float* w = wf.data();
        switch (qn) {
          case 1: dp_values<NV, 1>(vp, upto, w, a, rescale); break;
          case 2: dp_values<NV, 2>(vp, upto, w, a, rescale); break;
          case 3: if constexpr (QG >= 3) dp_values<NV, 3>(vp, upto, w, a, rescale); break;
          case 4: if constexpr (QG >= 4) dp_values<NV, 4>(vp, upto, w, a, rescale); break;
          case 5: if constexpr (QG >= 5) dp_values<NV, 5>(vp, upto, w, a, rescale); break;
          default: if constexpr (QG >= 6) dp_values<NV, 6>(vp, upto, w, a, rescale); break;
        }
      }
      ask(npn);
    }
  }
  for (int64_t kvh = h0; kvh < h1; ++kvh)
    write_task<uint16_t>(out, acc.data() + (kvh - h0) * n * D, sum.data() + (kvh - h0) * n, t0,
                         nq, G, Hq, kvh, D);
}

// BATCHSPEC_CPU_ATTENTION_DPBF16=0 turns the path off (read on every call)
bool dp_usable() {
  const char* env = std::getenv("BATCHSPEC_CPU_ATTENTION_DPBF16");
  return bs::avx512_bf16_usable() && (env == nullptr || std::strcmp(env, "0") != 0);
}

// The AVX2 path (CPUs with AVX2 and FMA but no AVX-512): the AVX-512 path's order of work, 8
// keys and 8 head dimensions a vector. fp32 key and value rows are read where they lie in the
// cache (no copy); bf16 ones are converted into the chunk's buffers once. A query's scores,
// softmax and value sums depend only on the keys it sees (chunks start at key 0 whatever the
// row's window), so a query gets the same result in a window and decoded alone.
constexpr int64_t KEYS8 = 8;

// out lane c = sum of the lanes of a[c], for c in 0..7
BS_AVX2 __m256 transpose_sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // t0: per 128-bit half, the half's sums of a0..a3; t1: of a4..a7
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// One (row, KV head) task; NV = D / 8 vectors per head row.
template <typename T, int NV>
__attribute__((target("avx2,fma"))) void attend_task_avx2(
    const T* q, const T* kc, const T* vc, T* out, const int64_t* table, int64_t t0,
    int64_t nq, int64_t nkv, int64_t kvh, int64_t Hq, int64_t Hkv, int64_t block_size,
    float scale, std::vector<float>& qf, std::vector<float>& acc, std::vector<float>& mx,
    std::vector<float>& sum, std::vector<float>& kf, std::vector<float>& vf) {
  constexpr int64_t D = NV * 8;
  constexpr int AV = NV < 8 ? NV : 8;   // value sums AV vectors (of a query's D) at a time
  const int64_t G = Hq / Hkv;
  const int64_t n = nq * G;  // query vectors, (j, g) order
  start_task(qf, acc, mx, sum, n, D);
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t j = 0; j < nq; ++j)
    for (int64_t g = 0; g < G; ++g) {
      const T* src = q + ((t0 + j) * Hq + kvh * G + g) * D;
      for (int v = 0; v < NV; ++v)
        _mm256_storeu_ps(qf.data() + (j * G + g) * D + v * 8,
                         _mm256_mul_ps(bs::load8(src + v * 8), vscale));
    }
  alignas(32) float zero[D] = {};
  alignas(32) float w[CHUNK];
  const float* kp[CHUNK];   // the chunk's key and value rows, fp32
  const float* vp[CHUNK];
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t p0 = 0; p0 < nkv; p0 += CHUNK) {
    const int64_t pn = std::min(CHUNK, nkv - p0);
    const int64_t groups = (pn + KEYS8 - 1) / KEYS8;
    SlotWalk walk(table, p0, block_size);
    for (int64_t c = 0; c < groups * KEYS8; ++c) {
      if (c >= pn) {   // a group's keys past the chunk: zeros, weighed 0
        kp[c] = vp[c] = zero;
        continue;
      }
      const int64_t slot = walk.next(c + 1 < pn);
      const T* k = kc + (slot * Hkv + kvh) * D;
      const T* v = vc + (slot * Hkv + kvh) * D;
      if constexpr (std::is_same_v<T, float>) {
        kp[c] = k;
        vp[c] = v;
      } else {
        float* kd = kf.data() + c * D;
        float* vd = vf.data() + c * D;
        for (int u = 0; u < NV; ++u) {
          _mm256_storeu_ps(kd + u * 8, bs::load8(k + u * 8));
          _mm256_storeu_ps(vd + u * 8, bs::load8(v + u * 8));
        }
        kp[c] = kd;
        vp[c] = vd;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      // causal: query j sees keys 0 .. nkv - nq + j
      const int64_t seen = std::min(pn, nkv - nq + i / G + 1 - p0);
      if (seen <= 0) continue;
      const float* qi = qf.data() + i * D;
      __m256 sc[CHUNK / KEYS8], live[CHUNK / KEYS8];
      __m256 top = ninf;
      const int64_t ng = (seen + KEYS8 - 1) / KEYS8;
      for (int64_t gi = 0; gi < ng; ++gi) {
        const float* const* kg = kp + gi * KEYS8;
        __m256 part[KEYS8];
        const __m256 q0 = _mm256_loadu_ps(qi);
        for (int c = 0; c < KEYS8; ++c) part[c] = _mm256_mul_ps(q0, _mm256_loadu_ps(kg[c]));
        for (int v = 1; v < NV; ++v) {
          const __m256 qv = _mm256_loadu_ps(qi + v * 8);
          for (int c = 0; c < KEYS8; ++c)
            part[c] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kg[c] + v * 8), part[c]);
        }
        const float left = static_cast<float>(std::min<int64_t>(KEYS8, seen - gi * KEYS8));
        live[gi] = _mm256_cmp_ps(lane, _mm256_set1_ps(left), _CMP_LT_OQ);
        sc[gi] = _mm256_blendv_ps(ninf, transpose_sum8(part), live[gi]);
        top = _mm256_max_ps(top, sc[gi]);
      }
      const float m = std::max(mx[i], bs::reduce_max8(top));
      const __m256 vm = _mm256_set1_ps(m);
      __m256 total = _mm256_setzero_ps();
      for (int64_t gi = 0; gi < ng; ++gi) {
        const __m256 e = _mm256_and_ps(live[gi], bs::exp8(_mm256_sub_ps(sc[gi], vm)));
        total = _mm256_add_ps(total, e);
        _mm256_store_ps(w + gi * KEYS8, e);
      }
      const float rescale = mx[i] == -std::numeric_limits<float>::infinity()
                                ? 0.f : exp_nonpositive(mx[i] - m);
      sum[i] = sum[i] * rescale + bs::reduce_add8(total);
      mx[i] = m;
      float* a = acc.data() + i * D;
      const __m256 vr = _mm256_set1_ps(rescale);
      for (int h = 0; h < NV; h += AV) {
        __m256 av[AV];
        for (int v = 0; v < AV; ++v) av[v] = _mm256_mul_ps(_mm256_loadu_ps(a + (h + v) * 8), vr);
        for (int64_t c = 0; c < seen; ++c) {
          const __m256 wc = _mm256_broadcast_ss(w + c);
          const float* vrow = vp[c] + h * 8;
          for (int v = 0; v < AV; ++v)
            av[v] = _mm256_fmadd_ps(wc, _mm256_loadu_ps(vrow + v * 8), av[v]);
        }
        for (int v = 0; v < AV; ++v) _mm256_storeu_ps(a + (h + v) * 8, av[v]);
      }
    }
  }
  write_task<T>(out, acc.data(), sum.data(), t0, nq, G, Hq, kvh, D);
}

// BATCHSPEC_CPU_ATTENTION_PORTABLE=1 takes the portable path, BATCHSPEC_CPU_ATTENTION_AVX2=1
// the AVX2 one on a CPU with AVX-512 too (read on every call, so that tests and benchmarks
// can compare the paths in one process)
bool portable_forced() { return std::getenv("BATCHSPEC_CPU_ATTENTION_PORTABLE") != nullptr; }

bool avx512_usable() {
  return bs::avx512_usable() && !portable_forced() &&
         std::getenv("BATCHSPEC_CPU_ATTENTION_AVX2") == nullptr;
}

bool avx2_usable() { return bs::avx2_usable() && !portable_forced(); }
#endif

#if defined(BS_HAVE_AMX_TILES)
#define BS_HAVE_AMX_PATH 1

// bf16 on CPUs with AMX (Intel Sapphire Rapids and later): a task's products as tile matrix
// multiplies. Keys KEYS_AMX at a time, gathered through the block table into a contiguous
// buffer (any block size):
//   scores  S^T [keys x 16 queries] = K [keys x D] . Q^T, the queries' pairs of head
//           dimensions held in tiles for the whole task; a row of S^T is the 16 queries'
//           scores of one key, so the softmax runs down rows, 16 queries a vector (fp32);
//   values  O [16 queries x D] += P [16 queries x keys] . V, each weight split into a bf16
//           head and the bf16 of its rest (two tile products; flash-attention kernels on
//           GPUs round the weights to bf16 once, which here made the greedy tokens of
//           verification windows disagree with decodes' several times as often) and V paired
//           over keys for the tile (AMX's bf16 layout); O stays fp32 between chunks and is
//           rescaled with the max.
// Scores, softmax and sums are fp32, and the weights exact to 2^-16: the path above's
// results up to the order of sums.
// A query's result depends only on its own keys: the same whichever other queries share its
// task. So every bf16 task takes this path, decodes too, and a token verified in a window
// gets the very sums it gets decoded alone (on the AVX-512 path for decodes, which sums in
// another order, bf16 greedy tokens of windows disagreed with decodes' in 1-3 of 64 rows;
// decode forwards cost 0-18% more on tiles, most at 32-64 rows, docs/benchmarks.md).
constexpr int64_t KEYS_AMX = 32;

// BATCHSPEC_CPU_ATTENTION_AMX=0 turns the path off (read on every call, as the switch above)
bool amx_usable() {
  const char* env = std::getenv("BATCHSPEC_CPU_ATTENTION_AMX");
  return bs::amx_permitted() && avx512_usable() && (env == nullptr || std::strcmp(env, "0") != 0);
}

#define BS_AMX __attribute__((target("avx512f,avx512dq,avx512bw,avx512bf16,amx-tile,amx-bf16")))

// Tiles: 0 keys or weights' heads (A), 1 paired values (B), 2 scores or an output block
// (C), 3 scores (C) or weights' rests (A),
// 4.. the task's queries (B), one per 32 head dimensions; every tile 16 rows of 64 bytes.

template <int NV>
BS_AMX void attend_task_amx(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                            uint16_t* out, const int64_t* table, int64_t t0, int64_t nq,
                            int64_t nkv, int64_t kvh, int64_t Hq, int64_t Hkv,
                            int64_t block_size, float scale) {
  constexpr int64_t D = NV * 16, KS = D / 32;   // KS: tiles of queries (32 dims each)
  static_assert(KS >= 1 && KS <= 4, "head dims 32, 64 or 128");
  const int64_t G = Hq / Hkv, n = nq * G;
  alignas(64) uint32_t qt[KS][16 * 16];          // [dim pair][query]: two bf16
  alignas(64) uint16_t kb[KEYS_AMX * D];         // [key][dim]
  alignas(64) uint32_t vp[KEYS_AMX / 2 * D];     // [key pair][dim]: two bf16
  alignas(64) float sc[KEYS_AMX * 16];           // [key][query]
  alignas(64) uint16_t pw[2][16 * KEYS_AMX];     // [query][key]: weights, bf16 head + rest
  alignas(64) float ob[16 * D];                  // [query][dim]
  const __m512i pair_up = _mm512_set_epi16(  // (a0, b0, a1, b1, ...) from (a0..a15, b0..b15)
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i col = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(16));
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t nb = std::min<int64_t>(16, n - i0);
    alignas(64) int32_t lim[16];  // last key each query sees (query j: nkv - nq + j)
    for (int64_t l = 0; l < 16; ++l) {
      const int64_t i = i0 + l, j = i / G, g = i % G;
      const uint32_t* row = reinterpret_cast<const uint32_t*>(
          q + ((t0 + j) * Hq + kvh * G + g) * D);
      for (int64_t p = 0; p < D / 2; ++p)  // an idle lane: zero query, sees every key
        qt[p / 16][(p % 16) * 16 + l] = l < nb ? row[p] : 0u;
      lim[l] = static_cast<int32_t>(l < nb ? nkv - nq + j : nkv - 1);
    }
    const __m512i limv = _mm512_load_si512(lim);
    _tile_loadd(4, qt[0], 64);
    if constexpr (KS > 1) _tile_loadd(5, qt[1], 64);
    if constexpr (KS > 2) _tile_loadd(6, qt[2], 64);
    if constexpr (KS > 3) _tile_loadd(7, qt[3], 64);
    std::memset(ob, 0, sizeof(ob));
    __m512 mx = ninf, sum = _mm512_setzero_ps();
    const __m512 vscale = _mm512_set1_ps(scale);
    const int64_t last = nkv - nq + (i0 + nb - 1) / G;  // the block's last key seen
    for (int64_t p0 = 0; p0 <= last; p0 += KEYS_AMX) {
      const int64_t pn = std::min(KEYS_AMX, last + 1 - p0);
      // keys and values of the chunk, through the block table
      SlotWalk walk(table, p0, block_size);
      for (int64_t c = 0; c < KEYS_AMX; c += 2) {
        const uint16_t* v2[2] = {nullptr, nullptr};
        for (int u = 0; u < 2; ++u) {
          uint16_t* kd = kb + (c + u) * D;
          if (c + u < pn) {
            const int64_t slot = walk.next(c + u + 1 < pn);
            const uint16_t* kp = kc + (slot * Hkv + kvh) * D;
            v2[u] = vc + (slot * Hkv + kvh) * D;
            for (int v = 0; v < NV / 2; ++v)
              _mm512_store_si512(kd + v * 32, _mm512_loadu_si512(kp + v * 32));
          } else {
            for (int v = 0; v < NV / 2; ++v) _mm512_store_si512(kd + v * 32, _mm512_setzero_si512());
          }
        }
        for (int v = 0; v < NV; ++v) {
          const __m256i a = v2[0] ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v2[0] + v * 16))
                                  : _mm256_setzero_si256();
          const __m256i b = v2[1] ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v2[1] + v * 16))
                                  : _mm256_setzero_si256();
          _mm512_store_si512(vp + (c / 2) * D + v * 16,
                             _mm512_permutexvar_epi16(
                                 pair_up, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)));
        }
      }
      // scores: S^T, 16 keys a tile
      for (int64_t h = 0; h * 16 < pn; ++h) {
        _tile_zero(2);
        _tile_loadd(0, kb + h * 16 * D, D * 2);
        _tile_dpbf16ps(2, 0, 4);
        if constexpr (KS > 1) {
          _tile_loadd(0, kb + h * 16 * D + 32, D * 2);
          _tile_dpbf16ps(2, 0, 5);
        }
        if constexpr (KS > 2) {
          _tile_loadd(0, kb + h * 16 * D + 64, D * 2);
          _tile_dpbf16ps(2, 0, 6);
        }
        if constexpr (KS > 3) {
          _tile_loadd(0, kb + h * 16 * D + 96, D * 2);
          _tile_dpbf16ps(2, 0, 7);
        }
        _tile_stored(2, sc + h * 16 * 16, 64);
      }
      // softmax down the rows: scale, mask, the chunk's max, rescale what came before
      __m512 top = mx;
      for (int64_t c = 0; c < pn; ++c) {
        const __mmask16 live = _mm512_cmp_epi32_mask(_mm512_set1_epi32(int(p0 + c)), limv,
                                                     _MM_CMPINT_LE);
        const __m512 sv = _mm512_mask_mov_ps(ninf, live,
                                             _mm512_mul_ps(_mm512_load_ps(sc + c * 16), vscale));
        _mm512_store_ps(sc + c * 16, sv);
        top = _mm512_max_ps(top, sv);
      }
      // every lane sees key 0, so top is finite from the first chunk on
      const __m512 rescale = bs::exp16(_mm512_sub_ps(mx, top));
      mx = top;
      sum = _mm512_mul_ps(sum, rescale);
      if (_mm512_cmp_ps_mask(rescale, _mm512_set1_ps(1.f), _CMP_NEQ_UQ)) {
        alignas(64) float rs[16];
        _mm512_store_ps(rs, rescale);
        for (int64_t l = 0; l < nb; ++l) {   // (idle lanes' rows are never written out)
          const __m512 r = _mm512_set1_ps(rs[l]);
          for (int v = 0; v < NV; ++v)
            _mm512_store_ps(ob + l * D + v * 16,
                            _mm512_mul_ps(_mm512_load_ps(ob + l * D + v * 16), r));
        }
      }
      for (int64_t c = 0; c < KEYS_AMX; ++c) {
        __m512 e = _mm512_setzero_ps();
        if (c < pn) {
          const __m512 sv = _mm512_load_ps(sc + c * 16);
          e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(sv, ninf, _CMP_NEQ_OQ),
                                  bs::exp16(_mm512_sub_ps(sv, top)));
          sum = _mm512_add_ps(sum, e);
        }
        _mm512_store_ps(sc + c * 16, e);
      }
      // the weights by query: column l of the chunk's rows, as a bf16 head and the bf16 of
      // what it leaves out (together within 2^-16 of the fp32 weight, as good as the path
      // above); an idle lane's row of the tiles is left as it was: it only feeds that lane's
      // row of O
      for (int64_t l = 0; l < nb; ++l) {
        const __m512i idx = _mm512_add_epi32(col, _mm512_set1_epi32(int(l)));
        const __m512 a = _mm512_i32gather_ps(idx, sc, 4);            // keys 0 .. 15
        const __m512 b = _mm512_i32gather_ps(idx, sc + 16 * 16, 4);  // keys 16 .. 31
        const __m512 ah = bs::round16<uint16_t>(a), bh = bs::round16<uint16_t>(b);
        _mm512_store_si512(pw[0] + l * KEYS_AMX, (__m512i)_mm512_cvtne2ps_pbh(bh, ah));
        _mm512_store_si512(pw[1] + l * KEYS_AMX,
                           (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, bh),
                                                        _mm512_sub_ps(a, ah)));
      }
      _tile_loadd(0, pw[0], KEYS_AMX * 2);
      _tile_loadd(3, pw[1], KEYS_AMX * 2);
      for (int v = 0; v < NV; ++v) {   // O[:, 16v .. 16v + 15] += P . V[:, 16v .. 16v + 15]
        _tile_loadd(2, ob + v * 16, D * 4);
        _tile_loadd(1, vp + v * 16, D * 4);
        _tile_dpbf16ps(2, 0, 1);
        _tile_dpbf16ps(2, 3, 1);
        _tile_stored(2, ob + v * 16, D * 4);
      }
    }
    alignas(64) float tot[16];
    _mm512_store_ps(tot, sum);
    for (int64_t l = 0; l < nb; ++l) {
      const int64_t i = i0 + l, j = i / G, g = i % G;
      uint16_t* dst = out + ((t0 + j) * Hq + kvh * G + g) * D;
      const __m512 inv = _mm512_set1_ps(tot[l] > 0.f ? 1.f / tot[l] : 0.f);
      for (int v = 0; v < NV; ++v)
        bs::store16(dst + v * 16, _mm512_mul_ps(_mm512_load_ps(ob + l * D + v * 16), inv));
    }
  }
}

BS_AMX void amx_release() { _tile_release(); }
#endif

#if defined(BS_HAVE_AVX512_PATH)
// Whether bf16 tasks take the tile path here (AMX present, permitted and not turned off)
bool amx_takes_bf16() {
#ifdef BS_HAVE_AMX_PATH
  return amx_usable();
#else
  return false;
#endif
}
#endif

// A batch's work in pieces: [P, 4] of (row, first token in q, queries, keys). A row's
// queries j0 .. j1 - 1 make a piece of their own: first token t0 + j0, j1 - j0 queries,
// kv_len - q_len + j1 keys (query j sees keys 0 .. kv_len - q_len + j either way). Rows are
// cut only where the tasks (`per_row` a row) would be fewer than the threads, into pieces of
// at least MIN_PIECE queries, so that a prompt's row beside few others (or alone) keeps
// every thread busy. A query's arithmetic is its own whichever piece holds it (each path
// works a query from its own row and the keys it sees), so outputs do not depend on the
// thread count.
constexpr int64_t MIN_PIECE = 8;

std::vector<int64_t> pieces(const int64_t* rows, int64_t R, int64_t per_row) {
  const int64_t tasks = std::max<int64_t>(1, R * per_row);
  const int64_t threads = at::get_num_threads();
  const int64_t cuts = tasks >= threads ? 1 : (threads + tasks - 1) / tasks;
  std::vector<int64_t> out;
  out.reserve(4 * R);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t0 = rows[3 * r], nq = rows[3 * r + 1], nkv = rows[3 * r + 2];
    const int64_t n = std::max<int64_t>(1, std::min(cuts, nq / MIN_PIECE));
    for (int64_t c = 0; c < n; ++c) {
      const int64_t j0 = nq * c / n, j1 = nq * (c + 1) / n;
      out.insert(out.end(), {r, t0 + j0, j1 - j0, nkv - nq + j1});
    }
  }
  return out;
}

template <typename T>
void attend(const T* q, const T* kc, const T* vc, T* out, const int64_t* tables,
            int64_t width, const int64_t* rows, int64_t R, int64_t Hq, int64_t Hkv, int64_t D,
            int64_t block_size, float scale) {
#ifdef BS_HAVE_AVX512_PATH
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    using Raw = std::conditional_t<std::is_same_v<T, float>, float, uint16_t>;
    using Task = void (*)(const Raw*, const Raw*, const Raw*, Raw*, const int64_t*, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                          std::vector<float>&, std::vector<float>&, std::vector<float>&,
                          std::vector<float>&, std::vector<float>&, std::vector<float>&);
    Task task = nullptr;
    if constexpr (std::is_same_v<Raw, uint16_t>) {   // bf16: pair products, a task a row
      using Row = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*,
                           const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t, float, std::vector<float>&,
                           std::vector<float>&, std::vector<float>&, std::vector<float>&);
      Row row = nullptr;
      if (avx512_usable() && dp_usable() && !amx_takes_bf16()) {
        if (D == 32) row = &attend_row_dp<2>;
        if (D == 64) row = &attend_row_dp<4>;
        if (D == 128) row = &attend_row_dp<8>;
      }
      if (row != nullptr) {
        const auto* rq = reinterpret_cast<const uint16_t*>(q);
        const auto* rk = reinterpret_cast<const uint16_t*>(kc);
        const auto* rv = reinterpret_cast<const uint16_t*>(vc);
        auto* ro = reinterpret_cast<uint16_t*>(out);
        const std::vector<int64_t> pc = pieces(rows, R, 1);
        const int64_t P = pc.size() / 4;
        // a task a piece, every KV head; a task a piece and head where pieces are too few
        const int64_t hs = P < at::get_num_threads() ? 1 : Hkv;
        at::parallel_for(0, P * (Hkv / hs), 1, [&](int64_t begin, int64_t end) {
          std::vector<float> acc, mx, sum, wf;
          for (int64_t t = begin; t < end; ++t) {
            const int64_t* p = pc.data() + 4 * (t / (Hkv / hs));
            const int64_t h0 = t % (Hkv / hs) * hs;
            row(rq, rk, rv, ro, tables + p[0] * width, p[1], p[2], p[3], Hq, Hkv, h0, h0 + hs,
                block_size, scale, acc, mx, sum, wf);
          }
        });
        return;
      }
    }
    if (avx512_usable()) {
      if (D == 16) task = &attend_task_avx512<Raw, 1>;
      if (D == 32) task = &attend_task_avx512<Raw, 2>;
      if (D == 64) task = &attend_task_avx512<Raw, 4>;
      if (D == 128) task = &attend_task_avx512<Raw, 8>;
    } else if (avx2_usable()) {
      if (D == 16) task = &attend_task_avx2<Raw, 2>;
      if (D == 32) task = &attend_task_avx2<Raw, 4>;
      if (D == 64) task = &attend_task_avx2<Raw, 8>;
      if (D == 128) task = &attend_task_avx2<Raw, 16>;
    }
#ifdef BS_HAVE_AMX_PATH
    using Amx = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*,
                         const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, float);
    Amx amx = nullptr;
    if (std::is_same_v<Raw, uint16_t> && task != nullptr && amx_usable()) {
      if (D == 32) amx = &attend_task_amx<2>;
      if (D == 64) amx = &attend_task_amx<4>;
      if (D == 128) amx = &attend_task_amx<8>;
    }
#endif
    if (task != nullptr) {
      const Raw* rq = reinterpret_cast<const Raw*>(q);
      const Raw* rk = reinterpret_cast<const Raw*>(kc);
      const Raw* rv = reinterpret_cast<const Raw*>(vc);
      Raw* ro = reinterpret_cast<Raw*>(out);
      const std::vector<int64_t> pc = pieces(rows, R, Hkv);
      at::parallel_for(0, static_cast<int64_t>(pc.size() / 4) * Hkv, 1, [&](int64_t begin,
                                                                             int64_t end) {
        std::vector<float> qf, acc, mx, sum, kf(CHUNK * D), vf(CHUNK * D);
        [[maybe_unused]] bool tiles = false;   // this thread's AMX tiles are configured
        for (int64_t t = begin; t < end; ++t) {
          const int64_t* p = pc.data() + 4 * (t / Hkv);
          const int64_t kvh = t % Hkv;
#ifdef BS_HAVE_AMX_PATH
          if (amx != nullptr) {
            if (!tiles) bs::configure_tiles();
            tiles = true;
            amx(reinterpret_cast<const uint16_t*>(rq), reinterpret_cast<const uint16_t*>(rk),
                reinterpret_cast<const uint16_t*>(rv), reinterpret_cast<uint16_t*>(ro),
                tables + p[0] * width, p[1], p[2], p[3], kvh, Hq, Hkv, block_size, scale);
            continue;
          }
#endif
          task(rq, rk, rv, ro, tables + p[0] * width, p[1], p[2], p[3], kvh, Hq, Hkv,
               block_size, scale, qf, acc, mx, sum, kf, vf);
        }
#ifdef BS_HAVE_AMX_PATH
        if (tiles) amx_release();
#endif
      });
      return;
    }
  }
#endif
  const std::vector<int64_t> pc = pieces(rows, R, Hkv);
  at::parallel_for(0, static_cast<int64_t>(pc.size() / 4) * Hkv, 1, [&](int64_t begin,
                                                                         int64_t end) {
    std::vector<float> qf, acc, mx, sum, kt(CHUNK * D, 0.f), vf(CHUNK * D), sc(CHUNK);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t* p = pc.data() + 4 * (task / Hkv);
      const int64_t kvh = task % Hkv;
      attend_task<T>(q, kc, vc, out, tables + p[0] * width, p[1], p[2], p[3], kvh, Hq, Hkv, D,
                     block_size, scale, qf, acc, mx, sum, kt, vf, sc);
    }
  });
}

// q [T, Hq, D]; caches [slots, Hkv, D]; block_tables [R, width] int64; rows [R, 3] int64 of
// (first token in q, q_len, kv_len); writes out [T, Hq, D] at the rows' tokens only.
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& rows, double scale, int64_t block_size,
                            at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad shapes");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  out.is_contiguous(), "tensors must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && rows.scalar_type() == at::kLong,
              "block_tables and rows must be int64");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "q, caches and out must share a dtype");
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(Hq % Hkv == 0 && k_cache.size(2) == D, "head counts/dims do not match");
  auto tables = block_tables.contiguous();
  auto r = rows.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attn", [&] {
    attend<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                     v_cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                     tables.data_ptr<int64_t>(), tables.size(1), r.data_ptr<int64_t>(),
                     r.size(0), Hq, Hkv, D, block_size, static_cast<float>(scale));
  });
}

// k_cache[slots[t]] = k[t], v_cache[slots[t]] = v[t] (kv_write.h): the forward's cache
// writes on CPU
void write_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k,
               const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1,
              "write_kv_: contiguous int64 slots");
  const int64_t n = slots.numel();
  bs::write_kv_rows(k_cache, k, slots.data_ptr<int64_t>(), n);
  bs::write_kv_rows(v_cache, v, slots.data_ptr<int64_t>(), n);
}

// How many threads at::parallel_for runs `tasks` tasks of grain 1 on here, as every C++ op
// of these kernels does: torch's thread count (up to `tasks`) where the kernels are built
// with OpenMP (_build.py); 1 where they are not, whatever torch.set_num_threads says
int64_t cpu_op_threads(int64_t tasks) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    seen |= uint64_t(1) << std::min(at::get_thread_num(), 63);
  });
  return __builtin_popcountll(seen.load());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(BS_NS, m) {
  m.def("cpu_op_threads(int tasks) -> int", &cpu_op_threads);
  m.def("write_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots) -> ()");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor rows, float scale, int block_size, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(BS_NS, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("write_kv_", &write_kv_);
}
