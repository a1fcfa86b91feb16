// A model draft's sampling on the host, one row at a time: q = softmax(logits / T) and the
// inverse-CDF draw from q, keyed as verification keys its uniforms. Shared by the ops
// softmax_rows and draw_rows (verify_ops.cpp: the step-by-step loop's q and draw,
// batchspec.spec.verify.softmax_probs and draw_tokens) and the draft-steps op
// (draft_steps_cpu.cpp), so that both give the same tokens and q bit for bit.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "verify_core.h"

namespace bs {

// q = softmax(row * inv_t) (tokens at -inf get 0): one vectorised pass where the CPU has AVX2
// (verify_host_rows.h, exp to ~2e-7 relative), else the loop below. A row with a NaN or +inf,
// or all -inf, gets NaN throughout, as torch's softmax gives it. With `blocks` (V / 8 rounded
// up), the vectorised pass also sums q a block at a time as block_sums does; returns whether
// it did (false: the caller sums them).
inline bool softmax_row(const float* row, int V, float inv_t, float* q, float* blocks = nullptr) {
  if (host_softmax(row, V, inv_t, q, blocks)) return blocks != nullptr;
  float m = -INFINITY;
  bool bad = false;
  for (int i = 0; i < V; ++i) {
    const float z = row[i] * inv_t;
    bad |= z != z || z == INFINITY;
    m = z > m ? z : m;
  }
  if (bad || m == -INFINITY) {
    std::fill(q, q + V, std::numeric_limits<float>::quiet_NaN());
    return false;
  }
  float s = 0.f;
  for (int i = 0; i < V; ++i) {
    q[i] = expf(row[i] * inv_t - m);
    s += q[i];
  }
  for (int i = 0; i < V; ++i) q[i] /= s;
  return false;
}

// The sums of q [V] over blocks of 8 tokens, each in a fixed order (sum8_pairwise), the last
// block's missing tokens 0.
inline void block_sums(const float* q, int V, float* blocks) {
  for (int b = 0; b < (V + 7) / 8; ++b) {
    float x[8] = {};
    for (int j = 0; j < 8 && 8 * b + j < V; ++j) x[j] = q[8 * b + j];
    blocks[b] = sum8_pairwise(x);
  }
}

// One draw from q [V] (>= 0, need not sum to 1), given its block sums (block_sums): the first
// token whose running sum of q passes u times the row's total. The blocks are summed in turn,
// then the tokens of the block the target falls in one at a time; a token of q = 0 is never
// drawn. Tokens come with probability q / total up to the rounding of the sums (~1e-7
// relative).
inline int draw_in_blocks(const float* q, int V, float u, const float* blocks) {
  const int nb = (V + 7) / 8;
  float total = 0.f;
  for (int b = 0; b < nb; ++b) total += blocks[b];
  const float target = u * total;
  float c = 0.f;
  for (int b = 0; b < nb; ++b) {
    if (!(c + blocks[b] > target)) {
      c += blocks[b];
      continue;
    }
    int last = -1;   // the block's sums one token at a time may fall short by a rounding
    for (int i = 8 * b; i < std::min(8 * b + 8, V); ++i) {
      if (!(q[i] > 0.f)) continue;
      c += q[i];
      last = i;
      if (c > target) return i;
    }
    if (last >= 0) return last;
  }
  return V - 1;    // (a row of NaN or no mass: malformed logits)
}

// One draw from q [V] (draw_in_blocks). `blocks`: scratch, reused across rows.
inline int draw_row(const float* q, int V, float u, std::vector<float>& blocks) {
  blocks.resize(size_t((V + 7) / 8));
  block_sums(q, V, blocks.data());
  return draw_in_blocks(q, V, u, blocks.data());
}

// q = softmax(row * inv_t) and one draw from it, as softmax_row then draw_row give them, bit
// for bit; the vectorised pass sums the blocks as it writes q (one pass over q fewer).
inline int softmax_draw_row(const float* row, int V, float inv_t, float u, float* q,
                            std::vector<float>& blocks) {
  blocks.resize(size_t((V + 7) / 8));
  if (!softmax_row(row, V, inv_t, q, blocks.data())) block_sums(q, V, blocks.data());
  return draw_in_blocks(q, V, u, blocks.data());
}

}  // namespace bs
