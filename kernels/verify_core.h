// Core of the speculative-decoding verification op, shared by the CUDA kernel
// (verify_kernel.cu, one thread block per request) and its CPU twin (verify_ops.cpp, one
// host thread per request). Every function is __host__ __device__; a Group is a thread
// block on the GPU and a single thread ({0, 1}) on the host, where reductions are no-ops.
//
// Leviathan et al. 2023 / Chen et al. 2023: accept draft x with probability min(1, p(x)/q(x)),
// at the first rejection draw from norm(max(0, p - q)), else draw a bonus token from p.
// Draws: Philox-4x32-10 keyed by (seed, offset, position, stream); the corrected draw is an
// exponential race argmax_i w_i / -log(u_i), the bonus draw Gumbel-max argmax_i z_i -
// log(-log u_i), so each token's score depends on its own values only and every backend
// (and batchspec/spec/verify_torch.py) picks the same token.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "verify_reduce.h"

namespace bs {

enum Stream : uint32_t { kStreamAccept = 0, kStreamDraw = 1 };
enum Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct VerifyParams {
  const void* logits;          // [N+B, V] fp32 / bf16 / fp16
  int dtype, vocab, batch, out_stride;
  const float* draft_probs;    // [N, V] or nullptr (one-hot q at the draft token)
  const int32_t* draft_ids;    // [N]
  const int32_t* cu;           // [B+1]
  const float* temperature;    // [B], 0 = greedy
  const int64_t* seeds;        // [B]
  const int64_t* offsets;      // [B]
  const int32_t* top_k;        // [B] or nullptr, 0 = off
  const float* top_p;          // [B] or nullptr, >= 1 = off
  int32_t* out;                // [B, out_stride], -1 padded
  int32_t* num_accepted;       // [B]
};

// ---- Philox-4x32-10 (Salmon et al. 2011), keyed as in batchspec/spec/rng.py ----------
struct U4 { uint32_t w[4]; };

BS_HD U4 philox(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
    const uint64_t p0 = uint64_t(0xD2511F53u) * c0, p1 = uint64_t(0xCD9E8D57u) * c2;
    const uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    c1 = uint32_t(p1); c3 = uint32_t(p0); c0 = n0; c2 = n2;
  }
  return U4{{c0, c1, c2, c3}};
}

BS_HD U4 philox_keyed(uint64_t seed, uint64_t offset, uint32_t position, uint32_t stream,
                      uint32_t index) {
  return philox(index, position, uint32_t(offset),
                uint32_t((offset >> 32) & 0xFFFFu) | (stream << 16), uint32_t(seed),
                uint32_t(seed >> 32));
}

// (2 * (bits >> 9) + 1) / 2^24: exact in fp32, strictly inside (0, 1).
BS_HD float to_uniform(uint32_t bits) { return float((bits >> 9) * 2u + 1u) * 5.9604644775390625e-8f; }

// One uniform of a key: word 0 of its call (rng.uniform): the accept tests, a draft's draw,
// the `uniform` op
BS_HD float keyed_uniform(uint64_t seed, uint64_t offset, uint32_t position, uint32_t stream,
                          uint32_t index) {
  return to_uniform(philox_keyed(seed, offset, position, stream, index).w[0]);
}

// Per-token uniforms of one draw; token i uses call i / 4, word i % 4 (cached per thread,
// threads visit their tokens in increasing order).
struct TokenUniforms {
  uint64_t seed, offset; uint32_t position; int cached = -1; U4 r;
  BS_HD float operator()(int i) {
    if ((i >> 2) != cached) { cached = i >> 2; r = philox_keyed(seed, offset, position, kStreamDraw, cached); }
    const uint32_t w = (i & 2) ? ((i & 1) ? r.w[3] : r.w[2]) : ((i & 1) ? r.w[1] : r.w[0]);
    return to_uniform(w);   // (no dynamic index: keeps r in registers on the GPU)
  }
};

// ---- rows: scaled logits z = l * (1/T) (as the reference), filter (top-k, top-p), p = exp(z - m) / s ----------
}  // namespace bs
#if !defined(__CUDACC__)
#include "verify_host_rows.h"   // the host's vectorised passes over a row
#endif
namespace bs {

struct RowFilter { float thresh, m, s; };   // token kept iff z >= thresh

BS_HD float prob(const RowFilter& f, float z) { return z >= f.thresh ? expf(z - f.m) / f.s : 0.f; }

template <typename T>
BS_HD float sum_exp_above(const T* row, int V, float inv_t, float m, float thresh, bool strict, const Group& g) {
  float s = 0.f;   // sum of exp(z - m) over z > thresh (strict) or z >= thresh
#if !defined(__CUDACC__)
  if (host_sum_exp_above(row, V, inv_t, m, thresh, strict, s)) return s;
#endif
  for_each(row, V, g, [&](int, float x) {
    const float z = x * inv_t;
    if (strict ? z > thresh : z >= thresh) s += expf(z - m);
  });
  return group_sum(s, g);
}

template <typename T>
BS_HD RowFilter row_filter(const T* row, int V, float inv_t, int top_k, float top_p, const Group& g) {
  Lse l{-INFINITY, 0.f};
  float zmin = INFINITY;
#if !defined(__CUDACC__)
  const bool vec = host_row_lse(row, V, inv_t, l.m, zmin, l.s);
#else
  const bool vec = false;
#endif
  if (!vec) {
    for_each(row, V, g, [&](int, float x) {   // one pass: online max / sum-exp, and the min
      const float z = x * inv_t;
      zmin = fminf(zmin, z);
      if (z > l.m) { l.s = l.s * expf(l.m - z) + 1.f; l.m = z; }
      else if (z != -INFINITY) l.s += expf(z - l.m);
    });
    l = group_lse(l, g);
    zmin = group_min(zmin, g);
  }
  RowFilter f{-INFINITY, l.m, l.s};
  if (top_k > 0 && top_k < V) {   // largest x with #{z >= x} >= k: the k-th largest z
    uint32_t lo = float_key(zmin), hi = float_key(l.m);
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo + 1) / 2;
      const float x = key_float(mid);
      float c = 0.f;
#if !defined(__CUDACC__)
      if (!host_count_at_least(row, V, inv_t, x, c))
#endif
      {
        for_each(row, V, g, [&](int, float v) { c += (v * inv_t >= x) ? 1.f : 0.f; });
        c = group_sum(c, g);
      }
      if (c >= float(top_k)) lo = mid; else hi = mid - 1;
    }
    f.thresh = key_float(lo);
    f.s = sum_exp_above(row, V, inv_t, f.m, f.thresh, false, g);
  }
  if (top_p < 1.f) {              // smallest x with mass(z > x) < top_p: keeps the top-p head
    uint32_t lo = float_key(fmaxf(f.thresh, zmin)), hi = float_key(l.m);
    const float target = top_p * f.s;
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo) / 2;
      if (sum_exp_above(row, V, inv_t, f.m, key_float(mid), true, g) < target) hi = mid; else lo = mid + 1;
    }
    f.thresh = key_float(lo);
    f.s = sum_exp_above(row, V, inv_t, f.m, f.thresh, false, g);
  }
  return f;
}

// ---- draws -----------------------------------------------------------------------------
// u <= 1 - 2^-24, so -log(u) >= 5.96e-8: a Gumbel term -log(-log u) is < 16.64 and 1 / -log(u)
// is < 1.68e7. Tokens whose bound cannot beat the best score so far skip their draw; the
// bounds below keep a margin over rounding, so the winner is the same as without skipping.
constexpr float kMaxGumbel = 17.f, kMaxInvExp = 1.7e7f;

// A token whose score needs u > exp(-y) to beat the best cannot win when u < 1 - y (as
// exp(-y) >= 1 - y): that test costs one exp or division instead of two logs. y is raised
// by a relative margin (1e-4, and for Gumbel scores an absolute 1e-3 + 1e-5 |score|) that
// covers the rounding of exp, log and the score, and 1 - y is lowered by 1e-6 for its own.
BS_HD bool cannot_win(float u, float y) { return u < 1.f - y * 1.0001f - 1e-6f; }

template <typename T>
BS_HD int row_argmax(const T* row, int V, const Group& g) {   // greedy; ties -> lowest index
#if !defined(__CUDACC__)
  const int top = host_argmax(row, V);
  if (top >= 0) return top;
#endif
  ArgMax best{-INFINITY, -1};
  for_each(row, V, g, [&](int i, float x) { if (best.i < 0 || x > best.v) best = ArgMax{x, i}; });
  return group_argmax(best, g).i;
}

}  // namespace bs
#if !defined(__CUDACC__)
#include "verify_host.h"   // the host's vectorised bonus draw
#endif
namespace bs {

template <typename T>   // bonus: Gumbel-max over the kept tokens of softmax(z)
BS_HD int draw_bonus(const T* row, int V, float inv_t, float thresh, TokenUniforms u, const Group& g) {
  ArgMax best{-INFINITY, -1};
  const auto visit = [&](int i, float x) {
    const float z = x * inv_t;
    if (z < thresh || z == -INFINITY) return;
    float ui = 0.f;
    if (best.i >= 0) {
      if (z + kMaxGumbel < best.v) return;   // cannot win: skip its RNG and logs
      // z - log(-log u) > best needs -log u < e^(z - best), i.e. u > exp(-e^(z - best))
      ui = u(i);
      if (cannot_win(ui, expf(z - best.v + 1e-3f + 1e-5f * (fabsf(best.v) + fabsf(z))))) return;
    } else {
      ui = u(i);
    }
    const float score = z - logf(-logf(ui));
    best = argmax_op(best, ArgMax{score, i});
  };
  // The most likely token first: its score makes most others' bounds fail at once. (The
  // order does not change the winner: argmax_op breaks ties by the lower index.)
  const int top = row_argmax(row, V, g);
#if !defined(__CUDACC__)
  if (top >= 0 && host_paths_on()) {   // the host's vectorised path (verify_host.h), or
                                            // -1: this loop
    const int i = draw_bonus_host(row, V, inv_t, thresh, u, top);
    if (i >= 0) return i;
  }
#endif
  if (top >= 0 && (g.tid == 0)) visit(top, to_float(row[top]));
  for_each(row, V, g, visit);
  return group_argmax(best, g).i;
}

template <typename T>   // corrected: exponential race over w = max(0, p - q); -1 if no mass
BS_HD int draw_residual(const T* row, int V, float inv_t, const RowFilter& f, const float* q_row,
                        int draft, TokenUniforms u, const Group& g) {
  ArgMax best{-INFINITY, -1};
  const auto visit = [&](int i, float w) {   // w = p(i) - q(i)
    if (!(w > 0.f) || (best.i >= 0 && w * kMaxInvExp < best.v)) return;   // cannot win
    const float ui = u(i);
    // w / -log u > best needs -log u < w / best, i.e. u > exp(-w / best)
    if (best.i >= 0 && cannot_win(ui, w / best.v)) return;
    const float score = w / -logf(ui);
    best = argmax_op(best, ArgMax{score, i});
  };
#if !defined(__CUDACC__)
  if (const float* w = host_residual(row, V, inv_t, f.thresh, f.m, f.s, q_row, draft)) {
    for (int i = 0; i < V; ++i) visit(i, w[i]);   // the weights of a vectorised pass
    return best.i;
  }
#endif
  for_each(row, V, g, [&](int i, float x) {
    visit(i, prob(f, x * inv_t) - (q_row ? q_row[i] : (i == draft ? 1.f : 0.f)));
  });
  return group_argmax(best, g).i;
}

// ---- one request ---------------------------------------------------------------------
template <typename T>
BS_HD void verify_request(const VerifyParams& P, int b, const Group& g) {
  const int start = P.cu[b], n = P.cu[b + 1] - start, V = P.vocab;
  const T* rows = static_cast<const T*>(P.logits) + int64_t(start + b) * V;   // n + 1 rows
  const float t = P.temperature[b];
  const uint64_t seed = uint64_t(P.seeds[b]), offset = uint64_t(P.offsets[b]);
  int a = 0, token = -1;
  if (t == 0.f) {   // greedy: accept while draft == argmax, then emit the argmax
    for (;; ++a) {
      token = row_argmax(rows + int64_t(a) * V, V, g);
      if (a == n || P.draft_ids[start + a] != token) break;
    }
  } else {
    const float inv_t = 1.f / t;
    const int top_k = P.top_k ? P.top_k[b] : 0;
    const float top_p = P.top_p ? P.top_p[b] : 1.f;
    RowFilter f{-INFINITY, 0.f, 1.f};
    for (; a < n; ++a) {   // accept x with probability min(1, p(x) / q(x))
      const T* row = rows + int64_t(a) * V;
      f = row_filter(row, V, inv_t, top_k, top_p, g);
      const int x = P.draft_ids[start + a];
      const bool ok = 0 <= x && x < V;
      const float px = ok ? prob(f, to_float(row[x]) * inv_t) : 0.f;
      const float qx = ok && P.draft_probs ? P.draft_probs[int64_t(start + a) * V + x] : 1.f;
      const float u = keyed_uniform(seed, offset, uint32_t(a), kStreamAccept, 0);
      // q(x) = 0 (a draft the draft could not have sampled) is rejected, as an id outside
      // [0, V) is (px = 0): docs/verification.md, "Malformed drafts".
      if (!(qx > 0.f && u * qx < px)) break;   // early exit at the first rejection
    }
    const T* row = rows + int64_t(a) * V;
    const TokenUniforms u{seed, offset, uint32_t(a)};
    if (a < n) {
      const float* q_row = P.draft_probs ? P.draft_probs + int64_t(start + a) * V : nullptr;
      token = draw_residual(row, V, inv_t, f, q_row, P.draft_ids[start + a], u, g);
    }
    if (token < 0) {   // all accepted (bonus), or rounding left max(0, p - q) without mass
      const bool filtered = top_k > 0 || top_p < 1.f;
      const float thresh = a < n ? f.thresh
                         : filtered ? row_filter(row, V, inv_t, top_k, top_p, g).thresh : -INFINITY;
      token = draw_bonus(row, V, inv_t, thresh, u, g);
    }
  }
  if (g.tid == 0) {
    int32_t* out = P.out + int64_t(b) * P.out_stride;
    for (int j = 0; j < P.out_stride; ++j) out[j] = j < a ? P.draft_ids[start + j] : (j == a ? token : -1);
    P.num_accepted[b] = a;
  }
}

}  // namespace bs
