// RMSNorm of a decoder layer on CPU in one pass, with the residual add before it: in torch
// it is 8 ops (and the add a ninth) on a [rows, hidden] tensor, which at the batch sizes of
// decoding cost more in dispatch, allocation and dtype conversion than in arithmetic.
//
// Each keeps the roundings of the torch expression it replaces (batchspec/models/llama.py),
// so that its result is that expression's up to the order of a sum (bit-identical in bf16 in
// the tests, within 2.4e-6 in fp32):
//   rms_norm      weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)      (HF Llama RMSNorm)
//   add_rms_norm_ h += residual (in place, in the model dtype), then rms_norm(h)
// Arithmetic is fp32; a product or sum that torch rounds to the model dtype is rounded here.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, T* h, const T* residual, int64_t rows,
                   int64_t H, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rms_norm_row<T>(x + r * H, w, y + r * H, h == nullptr ? nullptr : h + r * H,
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(BS_NS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) h, Tensor residual, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(BS_NS, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
}
