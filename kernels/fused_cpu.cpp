// A decoder layer's elementwise work on CPU, one pass each: in torch each is 5-9 ops on a
// [rows, width] tensor, which at the batch sizes of decoding cost more in dispatch,
// allocation and dtype conversion than in arithmetic, and at verification's windows of 5
// tokens a row (160 rows at batch size 32) a sixth of a forward.
//
// Each keeps the roundings of the torch expression it replaces (batchspec/models/llama.py),
// so that its result is that expression's up to the order of a sum or an exp's last bit
// (bit-identical in bf16 in the tests but for silu_mul, and rms_norm at widths that are not
// whole vectors, within one bf16 step there):
//   rms_norm      weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)      (HF Llama RMSNorm)
//   add_rms_norm_ h += residual (in place, in the model dtype), then rms_norm(h)
//   silu_mul      silu(gate) * up, gate and up the halves of each row  (SwiGLU)
//   rope_qk       x * cos + rotate_half(x) * sin over the q and k heads at the head of each
//                 qkv row, cos and sin looked up by position; q and k come back contiguous
// Arithmetic is fp32; a product or sum that torch rounds to the model dtype is rounded here.
// Paths: loops the compiler vectorises for each instruction set (BS_CLONES), and explicit
// AVX-512 and AVX2 code for SwiGLU and RoPE (the compiler's loops were slower: fp32 at 160
// rows of the demo target on an AVX2 CPU, 131 against 202 us and 21 against 54 us a call,
// benchmarks/bench_cpu_ops.py) and for bf16 RMSNorm with AVX512-BF16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <type_traits>

#include "cpu_simd.h"

namespace {

// Model dtypes as raw bits (bf16) or floats: to and from fp32, branch-free so that loops of
// them vectorise.
template <typename T>
inline float load(T x) {
  if constexpr (std::is_same_v<T, uint16_t>) {  // bfloat16 bits
    const uint32_t u = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else {
    return x;
  }
}

template <typename T>
inline T store(float f) {
  if constexpr (std::is_same_v<T, uint16_t>) {  // round to nearest even, as c10::BFloat16
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = 0u - uint32_t(f != f);   // all ones for a NaN
    return uint16_t((rounded & ~nan) | (0x7fc0u & nan));
  } else {
    return f;
  }
}

// x rounded to the model dtype and back: what a torch op that returns T does to its result
template <typename T>
inline float round_to(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return load<T>(store<T>(x));
}

// BATCHSPEC_CPU_FUSED_PORTABLE=1: the loops the compiler vectorises (BS_CLONES) even where
// an explicit AVX2 or AVX-512 path is there (read on every call: tests and benchmarks compare
// the paths in one process)
inline bool vector_paths() { return std::getenv("BATCHSPEC_CPU_FUSED_PORTABLE") == nullptr; }

template <typename T>
BS_CLONES void rms_norm_row(const T* x, const T* w, T* y, T* h, const T* residual, int64_t H,
                            float eps) {
  if (residual != nullptr) {  // h = x + residual, in the model dtype
    for (int64_t i = 0; i < H; ++i) h[i] = store<T>(load(x[i]) + load(residual[i]));
    x = h;
  }
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= H; i += 16)
    for (int l = 0; l < 16; ++l) part[l] += load(x[i + l]) * load(x[i + l]);
  float ss = 0.f;
  for (; i < H; ++i) ss += load(x[i]) * load(x[i]);
  for (int l = 0; l < 16; ++l) ss += part[l];
  const float inv = 1.f / std::sqrt(ss / float(H) + eps);
  for (int64_t j = 0; j < H; ++j) y[j] = store<T>(load(w[j]) * round_to<T>(load(x[j]) * inv));
}

#ifdef BS_HAVE_AVX512_PATH
// bf16 with AVX512-BF16 (H a multiple of 16): the same roundings (bar fp32 denormals,
// cpu_simd.h), each one instruction, and the same order of sums (lane l sums elements l,
// l + 16, ...; the lanes are added in order); 2x faster than the loops above as the
// compiler vectorises them (52 against 24 us at 160 rows of 256)
__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16"))) void
rms_norm_row_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, uint16_t* h,
                  const uint16_t* residual, int64_t H, float eps) {
  __m512 ss16 = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += 16) {
    __m512 v = bs::load16(x + i);
    if (residual != nullptr) {
      const __m256i b = bs::to_bf16(_mm512_add_ps(v, bs::load16(residual + i)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + i), b);
      v = bs::from_bf16(b);
    }
    ss16 = _mm512_fmadd_ps(v, v, ss16);
  }
  if (residual != nullptr) x = h;
  alignas(64) float part[16];
  _mm512_store_ps(part, ss16);
  float ss = 0.f;
  for (int l = 0; l < 16; ++l) ss += part[l];
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(ss / float(H) + eps));
  for (int64_t i = 0; i < H; i += 16) {
    const __m512 n = bs::from_bf16(bs::to_bf16(_mm512_mul_ps(bs::load16(x + i), inv)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i),
                        bs::to_bf16(_mm512_mul_ps(bs::load16(w + i), n)));
  }
}
#endif

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, T* h, const T* residual, int64_t rows,
                   int64_t H, float eps) {
  auto row = &rms_norm_row<T>;
#ifdef BS_HAVE_AVX512_PATH
  if constexpr (std::is_same_v<T, uint16_t>)
    if (H % 16 == 0 && bs::avx512_bf16_usable() && vector_paths()) row = &rms_norm_row_bf16;
#endif
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      row(x + r * H, w, y + r * H, h == nullptr ? nullptr : h + r * H,
          residual == nullptr ? nullptr : residual + r * H, H, eps);
  });
}

// Dispatch on the model dtype, with bf16 as its raw bits.
template <typename F>
void by_dtype(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(float{});
  } else if (t.scalar_type() == at::kBFloat16) {
    f(uint16_t{});
  } else {
    TORCH_CHECK(false, "fused CPU ops: fp32 or bf16 only, got ", t.scalar_type());
  }
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), name,
              ": a contiguous 2-d CPU tensor is needed");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(w.numel() == x.size(1) && w.scalar_type() == x.scalar_type() && w.is_contiguous(),
              "rms_norm: weight must be [hidden] in x's dtype");
  auto y = at::empty_like(x);
  by_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    rms_norm_rows<T>(static_cast<const T*>(x.data_ptr()), static_cast<const T*>(w.data_ptr()),
                     static_cast<T*>(y.data_ptr()), nullptr, nullptr, x.size(0), x.size(1),
                     static_cast<float>(eps));
  });
  return y;
}

// h += residual in place; returns rms_norm(h)
at::Tensor add_rms_norm_(at::Tensor& h, const at::Tensor& residual, const at::Tensor& w,
                         double eps) {
  check_rows(h, "add_rms_norm_");
  check_rows(residual, "add_rms_norm_");
  TORCH_CHECK(residual.sizes() == h.sizes() && residual.scalar_type() == h.scalar_type(),
              "add_rms_norm_: residual must match h");
  TORCH_CHECK(w.numel() == h.size(1) && w.scalar_type() == h.scalar_type() && w.is_contiguous(),
              "add_rms_norm_: weight must be [hidden] in h's dtype");
  auto y = at::empty_like(h);
  by_dtype(h, [&](auto zero) {
    using T = decltype(zero);
    T* hp = static_cast<T*>(h.data_ptr());
    rms_norm_rows<T>(hp, static_cast<const T*>(w.data_ptr()), static_cast<T*>(y.data_ptr()), hp,
                     static_cast<const T*>(residual.data_ptr()), h.size(0), h.size(1),
                     static_cast<float>(eps));
  });
  return y;
}

// silu(g) = g * sigmoid(g), the sigmoid from e^-|g| (exp of a non-positive number, so no
// overflow and no branch)
template <typename T>
BS_CLONES void silu_mul_row(const T* gate, const T* up, T* y, int64_t I) {
  for (int64_t i = 0; i < I; ++i) {
    const float g = load(gate[i]);
    const float e = bs::exp_nonpositive(g < 0.f ? g : -g);
    // below -87 e^g is out of float's normal range: torch's g / (1 + e^-g) is then -0
    const float sigmoid = g < -87.f ? 0.f : (g < 0.f ? e : 1.f) / (1.f + e);
    y[i] = store<T>(round_to<T>(g * sigmoid) * load(up[i]));
  }
}

#ifdef BS_HAVE_AVX512_PATH
BS_AVX512 __m512 silu16(__m512 g) {   // g * sigmoid(g), as silu_mul_row's
  const __m512 one = _mm512_set1_ps(1.f);
  const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 e = bs::exp16(_mm512_min_ps(g, _mm512_sub_ps(_mm512_setzero_ps(), g)));
  const __m512 sigmoid = _mm512_maskz_mov_ps(
      _mm512_cmp_ps_mask(g, _mm512_set1_ps(-87.f), _CMP_GE_OQ),
      _mm512_div_ps(_mm512_mask_mov_ps(one, neg, e), _mm512_add_ps(one, e)));
  return _mm512_mul_ps(g, sigmoid);
}

// The same, 16 at a time (I a multiple of 16), with the same roundings
template <typename T>
__attribute__((target("avx512f,avx512dq"))) void silu_mul_row_avx512(const T* gate, const T* up,
                                                                     T* y, int64_t I) {
  for (int64_t i = 0; i < I; i += 16)
    bs::store16(y + i, _mm512_mul_ps(bs::round16<T>(silu16(bs::load16(gate + i))),
                                     bs::load16(up + i)));
}

// bf16 with AVX512-BF16: the roundings in one instruction each
__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16"))) void silu_mul_row_bf16(
    const uint16_t* gate, const uint16_t* up, uint16_t* y, int64_t I) {
  for (int64_t i = 0; i < I; i += 16) {
    const __m512 act = bs::from_bf16(bs::to_bf16(silu16(bs::load16(gate + i))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i),
                        bs::to_bf16(_mm512_mul_ps(act, bs::load16(up + i))));
  }
}
#endif

#ifdef BS_HAVE_AVX512_PATH
// AVX2 and FMA (no AVX-512): silu16's steps 8 at a time (I a multiple of 8)
BS_AVX2 __m256 silu8(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  const __m256 e = bs::exp8(_mm256_min_ps(g, _mm256_sub_ps(zero, g)));
  const __m256 num = _mm256_blendv_ps(one, e, _mm256_cmp_ps(g, zero, _CMP_LT_OQ));
  const __m256 sigmoid = _mm256_and_ps(_mm256_cmp_ps(g, _mm256_set1_ps(-87.f), _CMP_GE_OQ),
                                       _mm256_div_ps(num, _mm256_add_ps(one, e)));
  return _mm256_mul_ps(g, sigmoid);
}

template <typename T>
__attribute__((target("avx2,fma"))) void silu_mul_row_avx2(const T* gate, const T* up, T* y,
                                                            int64_t I) {
  for (int64_t i = 0; i < I; i += 8)
    bs::store8(y + i, _mm256_mul_ps(bs::round8<T>(silu8(bs::load8(gate + i))),
                                    bs::load8(up + i)));
}
#endif

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: rows must hold gate and up halves");
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2;
  auto y = at::empty({rows, I}, gate_up.options());
  by_dtype(gate_up, [&](auto zero) {
    using T = decltype(zero);
    const T* x = static_cast<const T*>(gate_up.data_ptr());
    T* out = static_cast<T*>(y.data_ptr());
    auto row = &silu_mul_row<T>;
#ifdef BS_HAVE_AVX512_PATH
    if (vector_paths()) {
      if (I % 8 == 0 && bs::avx2_usable()) row = &silu_mul_row_avx2<T>;
      if (I % 16 == 0 && bs::avx512_usable()) row = &silu_mul_row_avx512<T>;
      if constexpr (std::is_same_v<T, uint16_t>)
        if (I % 16 == 0 && bs::avx512_bf16_usable()) row = &silu_mul_row_bf16;
    }
#endif
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) row(x + r * 2 * I, x + r * 2 * I + I, out + r * I, I);
    });
  });
  return y;
}

// One head of D values: out[i] = x[i] cos[i] - x[i + D/2] sin[i] and
// out[i + D/2] = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2], each product and the sum
// rounded to the model dtype as the torch ops round them
template <typename T>
BS_CLONES void rope_head(const T* x, const T* c, const T* s, T* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = load(x[i]), b = load(x[i + half]);
    out[i] = store<T>(round_to<T>(a * load(c[i])) + round_to<T>(-b * load(s[i])));
    out[i + half] = store<T>(round_to<T>(b * load(c[i + half])) +
                             round_to<T>(a * load(s[i + half])));
  }
}

#ifdef BS_HAVE_AVX512_PATH
// The same, 16 at a time (D a multiple of 32), with the same roundings
template <typename T>
__attribute__((target("avx512f,avx512dq"))) void rope_head_avx512(const T* x, const T* c,
                                                                  const T* s, T* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 a = bs::load16(x + i), b = bs::load16(x + i + half);
    const __m512 lo = _mm512_add_ps(
        bs::round16<T>(_mm512_mul_ps(a, bs::load16(c + i))),
        bs::round16<T>(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), b), bs::load16(s + i))));
    const __m512 hi = _mm512_add_ps(bs::round16<T>(_mm512_mul_ps(b, bs::load16(c + i + half))),
                                    bs::round16<T>(_mm512_mul_ps(a, bs::load16(s + i + half))));
    bs::store16(out + i, lo);
    bs::store16(out + i + half, hi);
  }
}
#endif

#ifdef BS_HAVE_AVX512_PATH
// AVX2 and FMA: rope_head_avx512's steps 8 at a time (D a multiple of 16)
template <typename T>
__attribute__((target("avx2,fma"))) void rope_head_avx2(const T* x, const T* c, const T* s,
                                                         T* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += 8) {
    const __m256 a = bs::load8(x + i), b = bs::load8(x + i + half);
    const __m256 lo = _mm256_add_ps(
        bs::round8<T>(_mm256_mul_ps(a, bs::load8(c + i))),
        bs::round8<T>(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), b), bs::load8(s + i))));
    const __m256 hi = _mm256_add_ps(bs::round8<T>(_mm256_mul_ps(b, bs::load8(c + i + half))),
                                    bs::round8<T>(_mm256_mul_ps(a, bs::load8(s + i + half))));
    bs::store8(out + i, lo);
    bs::store8(out + i + half, hi);
  }
}
#endif

std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor& qkv, const at::Tensor& cos,
                                           const at::Tensor& sin, const at::Tensor& positions,
                                           int64_t num_q_heads, int64_t num_k_heads) {
  check_rows(qkv, "rope_qk");
  check_rows(cos, "rope_qk (cos)");
  check_rows(sin, "rope_qk (sin)");
  const int64_t rows = qkv.size(0), D = cos.size(1), H = num_q_heads + num_k_heads;
  TORCH_CHECK(D % 2 == 0 && sin.sizes() == cos.sizes() && H * D <= qkv.size(1) &&
                  cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "rope_qk: cos and sin must be [positions, head_dim] in qkv's dtype, and qkv "
              "rows must hold the q and k heads");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == rows,
              "rope_qk: positions must be one int64 per row");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0), "rope_qk: position ", pos[r],
                " is outside the table of ", cos.size(0));
  auto q = at::empty({rows, num_q_heads, D}, qkv.options());
  auto k = at::empty({rows, num_k_heads, D}, qkv.options());
  by_dtype(qkv, [&](auto zero) {
    using T = decltype(zero);
    const T* x = static_cast<const T*>(qkv.data_ptr());
    const T* ct = static_cast<const T*>(cos.data_ptr());
    const T* st = static_cast<const T*>(sin.data_ptr());
    T* qo = static_cast<T*>(q.data_ptr());
    T* ko = static_cast<T*>(k.data_ptr());
    const int64_t width = qkv.size(1);
    auto head = &rope_head<T>;
#ifdef BS_HAVE_AVX512_PATH
    if (vector_paths()) {
      if (D % 16 == 0 && bs::avx2_usable()) head = &rope_head_avx2<T>;
      if (D % 32 == 0 && bs::avx512_usable()) head = &rope_head_avx512<T>;
    }
#endif
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* c = ct + pos[r] * D;
        const T* s = st + pos[r] * D;
        for (int64_t h = 0; h < H; ++h)
          head(x + r * width + h * D, c, s,
                       h < num_q_heads ? qo + (r * num_q_heads + h) * D
                                       : ko + (r * num_k_heads + h - num_q_heads) * D,
                       D);
      }
    });
  });
  return {q, k};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(BS_NS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) h, Tensor residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_qk(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, int num_q_heads, "
        "int num_k_heads) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(BS_NS, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_qk", &rope_qk);
}
