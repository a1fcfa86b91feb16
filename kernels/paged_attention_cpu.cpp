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

#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
void attend(const T* q, const T* kc, const T* vc, T* out, const int64_t* tables,
            int64_t width, const int64_t* rows, int64_t R, int64_t Hq, int64_t Hkv, int64_t D,
            int64_t block_size, float scale) {
  const int64_t G = Hq / Hkv;
  at::parallel_for(0, R * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, mx, sum, kf(D), vf(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / Hkv, kvh = task % Hkv;
      const int64_t t0 = rows[3 * r], nq = rows[3 * r + 1], nkv = rows[3 * r + 2];
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
      const int64_t* table = tables + r * width;
      for (int64_t p = 0; p < nkv; ++p) {
        const int64_t slot = table[p / block_size] * block_size + p % block_size;
        const T* kp = kc + (slot * Hkv + kvh) * D;
        const T* vp = vc + (slot * Hkv + kvh) * D;
        for (int64_t d = 0; d < D; ++d) {
          kf[d] = static_cast<float>(kp[d]);
          vf[d] = static_cast<float>(vp[d]);
        }
        // queries j >= first see key p (causal)
        const int64_t first = std::max<int64_t>(0, p - (nkv - nq));
        for (int64_t i = first * G; i < n; ++i) {
          const float* qi = qf.data() + i * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qi[d] * kf[d];
          float* a = acc.data() + i * D;
          if (dot > mx[i]) {  // new maximum: rescale what is accumulated
            const float c = std::exp(mx[i] - dot);
            sum[i] = sum[i] * c + 1.f;
            for (int64_t d = 0; d < D; ++d) a[d] = a[d] * c + vf[d];
            mx[i] = dot;
          } else {
            const float w = std::exp(dot - mx[i]);
            sum[i] += w;
            for (int64_t d = 0; d < D; ++d) a[d] += w * vf[d];
          }
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
