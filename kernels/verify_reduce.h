// Building blocks of verify_core.h that differ between the GPU and the host: element types,
// vectorised row visits and group reductions. On the GPU a Group is a thread block (size a
// multiple of 32, smem >= 32 * 8 bytes); on the host it is one thread and reductions return
// their argument. Reductions combine in a fixed order, so results do not vary run to run.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define BS_HD __host__ __device__ __forceinline__
#else
#define BS_HD inline
#endif

namespace bs {

struct bf16 { uint16_t bits; };
struct fp16 { uint16_t bits; };

BS_HD float bits_float(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float f; memcpy(&f, &b, 4); return f;
#endif
}
BS_HD uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t b; memcpy(&b, &f, 4); return b;
#endif
}

BS_HD float to_float(float x) { return x; }
BS_HD float to_float(bf16 x) { return bits_float(uint32_t(x.bits) << 16); }
BS_HD float to_float(fp16 x) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(x.bits));
#else
  const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16, e = (x.bits >> 10) & 0x1Fu, m = x.bits & 0x3FFu;
  if (e == 0) { const float v = float(m) * 5.9604644775390625e-8f; return sign ? -v : v; }   // m * 2^-24
  return bits_float(sign | (e == 31 ? 0x7F800000u : (e + 112u) << 23) | (m << 13));
#endif
}

// Order-preserving map float -> uint32 (for binary searches over float thresholds).
BS_HD uint32_t float_key(float f) { const uint32_t b = float_bits(f); return b & 0x80000000u ? ~b : b | 0x80000000u; }
BS_HD float key_float(uint32_t k) { return bits_float(k & 0x80000000u ? k & 0x7FFFFFFFu : ~k); }

struct Group { int tid, size; void* smem; };   // host: {0, 1, nullptr}
struct ArgMax { float v; int i; };             // i < 0: empty
struct Lse { float m, s; };                    // sum of exp(z - m)

BS_HD ArgMax argmax_op(ArgMax a, ArgMax b) {   // larger value; ties -> lower index
  if (b.i < 0) return a;
  if (a.i < 0) return b;
  return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}
BS_HD Lse lse_op(Lse a, Lse b) {
  if (a.m == -INFINITY) return b;
  if (b.m == -INFINITY) return a;
  const float m = fmaxf(a.m, b.m);
  return Lse{m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// Visit f(i, float(row[i])) for the group's share of row[0, V); each thread sees increasing
// i. The GPU path loads 16 bytes per thread per step when the row is aligned.
template <typename T, typename F>
BS_HD void for_each(const T* row, int V, const Group& g, F&& f) {
#ifdef __CUDA_ARCH__
  constexpr int kVec = 16 / sizeof(T);
  if ((reinterpret_cast<uintptr_t>(row) & 15) == 0) {
    const int nvec = V / kVec;
    for (int c = g.tid; c < nvec; c += g.size) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row) + c);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < kVec; ++k) f(c * kVec + k, to_float(e[k]));
    }
    for (int i = nvec * kVec + g.tid; i < V; i += g.size) f(i, to_float(row[i]));
    return;
  }
#endif
  for (int i = g.tid; i < V; i += g.size) f(i, to_float(row[i]));
}

#ifdef __CUDA_ARCH__
__device__ __forceinline__ float shfl(float v, int o) { return __shfl_xor_sync(0xFFFFFFFFu, v, o); }
__device__ __forceinline__ int shfl(int v, int o) { return __shfl_xor_sync(0xFFFFFFFFu, v, o); }
__device__ __forceinline__ ArgMax shfl(ArgMax v, int o) { return ArgMax{shfl(v.v, o), shfl(v.i, o)}; }
__device__ __forceinline__ Lse shfl(Lse v, int o) { return Lse{shfl(v.m, o), shfl(v.s, o)}; }
#endif

// Block-wide reduction: warp butterflies, then lane 0 of each warp through shared memory;
// every thread combines the warp results in the same order and returns the same value.
template <typename V, typename Op>
BS_HD V group_reduce(V v, const Group& g, Op op) {
#ifdef __CUDA_ARCH__
  for (int o = 16; o > 0; o >>= 1) v = op(v, shfl(v, o));
  V* buf = static_cast<V*>(g.smem);
  __syncthreads();   // the previous reduction has read buf
  if ((g.tid & 31) == 0) buf[g.tid >> 5] = v;
  __syncthreads();
  v = buf[0];
  for (int w = 1; w < (g.size >> 5); ++w) v = op(v, buf[w]);
#else
  (void)g; (void)op;
#endif
  return v;
}

BS_HD float group_sum(float v, const Group& g) { return group_reduce(v, g, [](float a, float b) { return a + b; }); }
BS_HD float group_min(float v, const Group& g) { return group_reduce(v, g, [](float a, float b) { return fminf(a, b); }); }
BS_HD ArgMax group_argmax(ArgMax v, const Group& g) { return group_reduce(v, g, [](ArgMax a, ArgMax b) { return argmax_op(a, b); }); }
BS_HD Lse group_lse(Lse v, const Group& g) { return group_reduce(v, g, [](Lse a, Lse b) { return lse_op(a, b); }); }

}  // namespace bs
