// Attention of short query rows (decodes, verification windows, draft steps) straight over
// the paged KV cache on CPU: no gathered copy of each row's keys and values, which at large
// batch and long context is most of the memory traffic of a decode step.
//
// One task per (row, KV head): the row's q_len x G query heads that read this KV head walk
// the row's keys once, through its block table, with an online softmax in fp32. Causal: query
// j of a row with kv_len keys (its new tokens included) sees positions 0 .. kv_len - q_len + j.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Keys and values are read CHUNK at a time and converted to fp32 once: keys transposed
// ([D][CHUNK]) so that a query's scores against the chunk are CHUNK-wide multiply-adds with
// no horizontal sums, values as rows. Each query then folds the chunk into its running
// softmax with one rescale per chunk. All inner loops are plain arithmetic over arrays, which
// the compiler vectorises.
constexpr int64_t CHUNK = 64;
constexpr int LANES = 16;   // CHUNK is a multiple

// exp(x) for x <= 0 (scores minus their running maximum): Cody-Waite reduction to
// 2^n * e^r, |r| <= ln2/2, and a degree-6 polynomial for e^r (relative error ~2e-7, about
// one float ulp). Branch-free, so a loop of it vectorises where std::exp would not.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this e^x underflows; 2^n stays a normal float
  // round to nearest by the 1.5 * 2^23 trick (plain adds, which vectorise everywhere)
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Built for several instruction sets where the compiler can (GCC on x86-64), the best one
// chosen when the library loads: one build runs on any x86-64 machine.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define BS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define BS_CLONES
#endif

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
    for (int64_t c = 0; c < pn; ++c) {
      const int64_t p = p0 + c;
      const int64_t slot = table[p / block_size] * block_size + p % block_size;
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

template <typename T>
void attend(const T* q, const T* kc, const T* vc, T* out, const int64_t* tables,
            int64_t width, const int64_t* rows, int64_t R, int64_t Hq, int64_t Hkv, int64_t D,
            int64_t block_size, float scale) {
  at::parallel_for(0, R * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, mx, sum, kt(CHUNK * D, 0.f), vf(CHUNK * D), sc(CHUNK);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / Hkv, kvh = task % Hkv;
      attend_task<T>(q, kc, vc, out, tables + r * width, rows[3 * r], rows[3 * r + 1],
                     rows[3 * r + 2], kvh, Hq, Hkv, D, block_size, scale, qf, acc, mx, sum,
                     kt, vf, sc);
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(BS_NS, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor rows, float scale, int block_size, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(BS_NS, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
