// Host-only fast path of the bonus draw (verify_core.h, draw_bonus), included by the CPU
// build only. The same winner as the generic loop, in three passes, the middle one a loop
// the compiler vectorises:
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

// Pass 2 over one row: u[i] for every token (bonus_uniforms), then cand[i] = 1 where token i
// could beat b0 (bonus_filter).
BS_CLONES inline void bonus_uniforms(int V, uint64_t seed, uint64_t offset, uint32_t position,
                                     float* __restrict__ u) {
  for (int c = 0; c < (V + 3) / 4; ++c) {   // as TokenUniforms: token i is call i / 4, word i % 4
    const U4 r = philox_keyed(seed, offset, position, kStreamDraw, uint32_t(c));
    for (int j = 0; j < 4; ++j) u[4 * c + j] = to_uniform(r.w[j]);
  }
}

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
  cand.resize(size_t(V));
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
