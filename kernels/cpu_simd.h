// Shared pieces of the host kernels (CPU paged attention, fused RMSNorm, the verification
// twin's vectorised draw).
#pragma once
#include <cstdint>
#include <cstring>

// Host code built for several instruction sets where the compiler can (GCC on x86-64), the
// best one chosen when the library loads: one build runs on any x86-64 machine.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define BS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define BS_CLONES
#endif

namespace bs {

// exp(x) for x <= 0 (scores minus their running maximum, and the like): Cody-Waite reduction
// to 2^n * e^r, |r| <= ln2/2, and a degree-6 polynomial for e^r (relative error ~2e-7, about
// one float ulp). Branch-free (a select, which the build's -fno-trapping-math lets the
// compiler vectorise), so a loop of it vectorises where std::exp would not.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;  // below this e^x underflows; 2^n stays a normal float
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
  const uint32_t bits = uint32_t(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace bs

// AVX-512 and AVX2 pieces of the explicit paths (x86-64 with GCC or clang), each used only
// where __builtin_cpu_supports says the machine has the instructions
#if defined(__GNUC__) && defined(__x86_64__)
#define BS_HAVE_AVX512_PATH 1
#include <immintrin.h>

#include <type_traits>
#define BS_AVX512 __attribute__((target("avx512f,avx512dq"), always_inline)) inline

namespace bs {

template <typename T>
BS_AVX512 __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {  // bfloat16: the upper half of a float
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// x rounded to bfloat16, as c10::BFloat16 rounds (to nearest even; a NaN becomes the
// canonical one), in the upper half of each lane (the lower half zero)
BS_AVX512 __m512i bf16_bits16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(
      _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
      _mm512_set1_epi32(int(0xffff0000u)));
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                               _mm512_set1_epi32(0x7fc00000));
}

// 16 floats to the model dtype at p
template <typename T>
BS_AVX512 void store16(T* p, __m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(p, x);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits16(x), 16)));
  }
}

// x rounded to the model dtype and back (what a torch op returning T does to its result)
template <typename T>
BS_AVX512 __m512 round16(__m512 x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return _mm512_castsi512_ps(bf16_bits16(x));
}

// exp_nonpositive, 16 lanes at a time (the same reduction and polynomial)
BS_AVX512 __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  for (const float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// AVX2 with FMA (x86-64 CPUs without AVX-512: AMD Zen 1-3, Intel client cores): the same
// pieces, 8 lanes at a time
#define BS_AVX2 __attribute__((target("avx2,fma"), always_inline)) inline

template <typename T>
BS_AVX2 __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {  // bfloat16: the upper half of a float
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// x rounded to bfloat16 as bf16_bits16 rounds, in the upper half of each lane
BS_AVX2 __m256i bf16_bits8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(
      _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
      _mm256_set1_epi32(int(0xffff0000u)));
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                              _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                                              _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

// 8 floats to the model dtype at p
template <typename T>
BS_AVX2 void store8(T* p, __m256 x) {
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(p, x);
  } else {
    const __m256i h = _mm256_srli_epi32(bf16_bits8(x), 16);   // 8 x 16 bits, in 32-bit lanes
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
  }
}

// x rounded to the model dtype and back
template <typename T>
BS_AVX2 __m256 round8(__m256 x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return _mm256_castsi256_ps(bf16_bits8(x));
}

// exp_nonpositive, 8 lanes at a time (the same reduction and polynomial)
BS_AVX2 __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  for (const float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

BS_AVX2 float reduce_max8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

BS_AVX2 float reduce_min8(__m256 x) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  m = _mm_min_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

BS_AVX2 float reduce_add8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline bool avx2_usable() {
  static const bool cpu = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return cpu;
}

inline bool avx512_usable() {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return cpu;
}

// AVX512-BF16 (Cooper Lake, Sapphire Rapids and later): fp32 -> bf16 rounding in one
// instruction (to nearest even, as c10::BFloat16, but for NaN payloads and fp32 denormals,
// which it takes as zero; the AMX linear op rounds its results the same way)
#define BS_AVX512_BF16 \
  __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16"), always_inline)) inline

inline bool avx512_bf16_usable() {
  static const bool cpu = avx512_usable() && __builtin_cpu_supports("avx512bf16") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return cpu;
}

// 16 floats rounded to bf16 (the bits), and back to fp32
BS_AVX512_BF16 __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
BS_AVX512_BF16 __m512 from_bf16(__m256i b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

}  // namespace bs
#endif

// AMX tiles (Intel Sapphire Rapids and later; Linux, GCC 11+): the tile configuration and the
// permission to use them
#if defined(BS_HAVE_AVX512_PATH) && defined(__linux__) && !defined(__clang__) && __GNUC__ >= 11
#define BS_HAVE_AMX_TILES 1
#include <sys/syscall.h>   // arch_prctl: permission to use AMX tiles
#include <unistd.h>

namespace bs {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether this CPU has AMX-BF16 (and the AVX-512 the tile paths use beside it), and Linux
// (5.16+) lets this process use the tiles; asked once per process
inline bool amx_permitted() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
        !__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl") || !avx512_usable())
      return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// Every tile 16 rows of 64 bytes (what the tile paths use), in this thread
__attribute__((target("amx-tile"))) inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  // GCC does not see ldtilecfg read the struct and drops the stores above without this
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// One 2 x 2 block of tile products, the loop both AMX products share (tiles as
// configure_tiles sets them): C tiles 4..7 = rows a0 (and a1, when `pair`) of A, lda bytes
// apart, times weight blocks b0 (and b1, when `two`), over kt steps of 64 bytes of A's rows
// and 1 KB of the blocks; stored to c[0] (a0 b0), c[1] (a0 b1), c[2] (a1 b0), c[3] (a1 b1),
// 16 rows of 64 bytes each. Int8: u8 A and s8 B into int32 sums (AMX-INT8), else bf16 into
// fp32 (AMX-BF16).
template <bool Int8>
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) inline void tile_products_2x2(
    const uint8_t* a0, const uint8_t* a1, int64_t lda, const uint8_t* b0, const uint8_t* b1,
    int64_t kt, bool pair, bool two, void* const c[4]) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t k = 0; k < kt; ++k) {
    _tile_loadd(0, a0 + k * 64, lda);
    _tile_loadd(2, b0 + k * 1024, 64);
    if constexpr (Int8) _tile_dpbusd(4, 0, 2); else _tile_dpbf16ps(4, 0, 2);
    if (two) {
      _tile_loadd(3, b1 + k * 1024, 64);
      if constexpr (Int8) _tile_dpbusd(5, 0, 3); else _tile_dpbf16ps(5, 0, 3);
    }
    if (pair) {
      _tile_loadd(1, a1 + k * 64, lda);
      if constexpr (Int8) _tile_dpbusd(6, 1, 2); else _tile_dpbf16ps(6, 1, 2);
      if (two) {
        if constexpr (Int8) _tile_dpbusd(7, 1, 3); else _tile_dpbf16ps(7, 1, 3);
      }
    }
  }
  _tile_stored(4, c[0], 64);
  if (two) _tile_stored(5, c[1], 64);
  if (pair) _tile_stored(6, c[2], 64);
  if (pair && two) _tile_stored(7, c[3], 64);
}

}  // namespace bs
#endif
