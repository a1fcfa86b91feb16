// A draft model's steps on CPU in one call: each row feeds its pending tokens (the ones the
// draft has not seen: the last round's accepted tokens and bonus), draws a token from its
// last token's logits (greedy rows: the argmax), and feeds that token to the next step,
// `steps` times.
//
// Why: a draft model is small, and at a handful of rows its forward is bound by dispatch,
// not arithmetic, and a round pays it k times: a round of the demo code draft's four greedy
// steps takes 1.7 ms step by step at one row and 0.55 ms here (AMX CPU; AVX512-BF16 CPU:
// 0.56 and 0.19 ms; benchmarks/bench_cpu_ops.py).
// Here the same ops run from C++ (through the dispatcher: the very kernels the Python
// forward calls; the cache writes and the embedding lookup as plain copies), and the step's
// bookkeeping, which the engine would redo in Python per step (token and position tensors,
// cache slots, attention rows, the draw), is a few integer operations.
//
// The forward is LlamaForCausalLM.forward's (batchspec/models/llama.py) for a model with
// packed linear weights (AMX, AVX512-BF16, AVX2 or oneDNN), the fused C++ layer ops, the C++
// paged attention, no q/k norm, no bias, no sliding window and one rank; the draw is
// DraftModelProposer.propose's, top-k and top-p included (draft_draw.h's rows, which the
// loop calls through softmax_rows and draw_rows). The same ops in the same order on the same
// inputs, so the logits, q and the tokens are the Python loop's bit for bit (tested). The
// Python side decides when it applies (ModelRunner.draft_steps).
//
// weights:     embed, cos, sin, final norm, the head (int8: packed, scales, sums; else the
//              packed layer; then, for a draft vocabulary, the int64 ids of the tokens it
//              scores), then per layer: input norm, post-attention norm, qkv, o, gate_up,
//              down (each packed for the C++ op, or a oneDNN-packed mkldnn tensor)
// dims:        layers, q heads, kv heads, head dim, hidden, intermediate, vocab, head kind
//              (0 int8, 1 the packed layer), draft vocabulary (1: the head scores the ids
//              above, every other logit is -inf; 0: the whole vocabulary)
// caches:      per layer k, v [slots, kv heads, head dim]
// feed:        the rows' pending tokens, concatenated; feed_lens [R] (1-16 each)
// positions:   [R] the position of each row's first pending token; block_tables [R, width]
//              (a shorter table padded with -1)
// steps:       [R] forwards per row (>= 1)
// temperature: [R] fp32, with seeds and offsets [R] int64 (the draw's key: seed, output
//              tokens so far, first_step + step, stream); None: every row greedy
// top_k, top_p: [R] int64 (0: off) and fp32 (1: off), or None where no row filters
// q_out, q_rows: optional, where q goes when sampling: row r's steps from row q_rows[r] of
//              q_out [N, V] fp32 on
// Returns (tokens [R, max(steps)] int64, -1 past a row's steps; q when sampling: q_out, or
// [sum(steps), V] fp32 with row r's steps after the steps of the rows before it; else empty).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "draft_draw.h"
#include "kv_write.h"

#ifndef BS_NS
#define BS_NS batchspec
#endif
#define BS_STR2(x) #x
#define BS_STR(x) BS_STR2(x)

namespace {

using at::Tensor;

c10::OperatorHandle find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(
      (std::string(BS_STR(BS_NS)) + "::" + name).c_str(), "");
}

template <class F>
c10::TypedOperatorHandle<F> typed(const char* name) {
  return find_op(name).typed<F>();
}

using LinearF = Tensor(const Tensor&, const Tensor&, int64_t, int64_t,
                       const std::optional<Tensor>&, bool);
using NormF = Tensor(const Tensor&, const Tensor&, double);
using AddNormF = Tensor(Tensor&, const Tensor&, const Tensor&, double);
using UnaryF = Tensor(const Tensor&);
using RopeF = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                         const Tensor&, int64_t, int64_t);
using AttentionF = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&, double, int64_t, Tensor&);
using HeadF = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t);
using RowProbsF = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&);

struct Ops {
  c10::TypedOperatorHandle<LinearF> linear = typed<LinearF>("linear_packed");
  c10::TypedOperatorHandle<NormF> rms_norm = typed<NormF>("rms_norm");
  c10::TypedOperatorHandle<AddNormF> add_rms_norm = typed<AddNormF>("add_rms_norm_");
  c10::TypedOperatorHandle<UnaryF> silu_mul = typed<UnaryF>("silu_mul");
  c10::TypedOperatorHandle<RopeF> rope_qk = typed<RopeF>("rope_qk");
  c10::TypedOperatorHandle<AttentionF> attention = typed<AttentionF>("paged_decode_attention");
  c10::TypedOperatorHandle<HeadF> head_int8 = typed<HeadF>("head_int8");
  c10::TypedOperatorHandle<UnaryF> argmax = typed<UnaryF>("argmax_rows");
  c10::TypedOperatorHandle<RowProbsF> row_probs = typed<RowProbsF>("row_probs");
};

const Ops& ops() {
  static const Ops o;
  return o;
}

// x . w^T as the Python forward's `linear` computes it (batchspec/models/llama.py): the C++
// op for its packed weights (bf16 on AMX or AVX512-BF16, fp32 on AVX2), oneDNN for weights
// in oneDNN's blocked layout (mkldnn tensors); float_out: fp32 logits.
Tensor linear(const Tensor& x, const Tensor& w, int64_t in, int64_t out, bool float_out) {
  if (!w.is_mkldnn()) return ops().linear.call(x, w, in, out, std::nullopt, float_out);
  static const c10::OperatorHandle onednn =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, w, c10::IValue(), std::string("none"),
                                 c10::List<std::optional<c10::Scalar>>(), c10::IValue()};
  onednn.callBoxed(&stack);
  Tensor y = stack[0].toTensor();
  return float_out && y.scalar_type() != at::kFloat ? y.to(at::kFloat) : y;
}

// rows of the embedding table, one a token (what at::embedding computes, without its
// dispatch and index checks beyond the ids' range)
Tensor embed_rows(const Tensor& embed, const std::vector<int64_t>& ids) {
  const int64_t V = embed.size(0), H = embed.size(1), bytes = H * embed.element_size();
  TORCH_CHECK(embed.is_contiguous(), "draft_steps: contiguous embedding");
  Tensor h = at::empty({int64_t(ids.size()), H}, embed.options());
  const char* src = static_cast<const char*>(embed.data_ptr());
  char* dst = static_cast<char*>(h.data_ptr());
  for (size_t t = 0; t < ids.size(); ++t) {
    TORCH_CHECK(ids[t] >= 0 && ids[t] < V, "draft_steps: token id ", ids[t], " out of range");
    std::memcpy(dst + t * bytes, src + ids[t] * bytes, bytes);
  }
  return h;
}

constexpr int64_t GLOBALS = 4;      // embed, cos, sin, final norm
constexpr int64_t PER_LAYER = 6;    // in norm, post norm, qkv, o, gate_up, down
constexpr int64_t MAX_FEED = 16;    // a short row (DECODE_MAX_Q of layers/attention.py)

std::tuple<Tensor, Tensor> draft_steps(
    at::TensorList weights, at::IntArrayRef dims, double eps, double scale, int64_t block_size,
    at::TensorList caches, const Tensor& feed, const Tensor& feed_lens, const Tensor& positions,
    const Tensor& block_tables, const Tensor& steps, const std::optional<Tensor>& temperature,
    const std::optional<Tensor>& seeds, const std::optional<Tensor>& offsets,
    const std::optional<Tensor>& top_k, const std::optional<Tensor>& top_p, int64_t stream,
    int64_t first_step, const std::optional<Tensor>& q_out, const std::optional<Tensor>& q_rows) {
  c10::InferenceMode guard;
  TORCH_CHECK(dims.size() == 9, "draft_steps: 9 dims");
  const int64_t L = dims[0], Hq = dims[1], Hkv = dims[2], D = dims[3], H = dims[4],
                I = dims[5], V = dims[6], head_kind = dims[7], trimmed = dims[8];
  // the head's weights, then (a draft vocabulary) the ids of the tokens it scores
  const int64_t head_n = (head_kind == 0 ? 3 : 1) + (trimmed ? 1 : 0);
  TORCH_CHECK(L > 0 && int64_t(weights.size()) == GLOBALS + head_n + PER_LAYER * L &&
                  int64_t(caches.size()) == 2 * L,
              "draft_steps: weights or caches do not match the dims");
  const int64_t R = feed_lens.numel();
  for (const Tensor* t : {&feed, &feed_lens, &positions, &block_tables, &steps})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "draft_steps: contiguous int64 feed, lengths, positions, tables, steps");
  TORCH_CHECK(positions.numel() == R && steps.numel() == R && block_tables.dim() == 2 &&
                  block_tables.size(0) == R,
              "draft_steps: feed_lens, positions, steps [R], block_tables [R, width]");
  const Ops& op = ops();
  // the row passes' switch (BATCHSPEC_VERIFY_HOST_DRAW), read as the loop's ops read it
  bs::host_paths_on() = bs::host_draw_env();
  const Tensor &embed = weights[0], &cos = weights[1], &sin = weights[2],
               &final_norm = weights[3];
  const Tensor head_rows = trimmed ? weights[GLOBALS + head_n - 1] : Tensor();
  TORCH_CHECK(!trimmed || (head_rows.scalar_type() == at::kLong && head_rows.dim() == 1 &&
                           head_rows.is_contiguous()),
              "draft_steps: a draft vocabulary's ids are contiguous int64 [N]");
  // ascending, as draft_vocab.load gives them: a greedy row's token is then the scored
  // logits' argmax mapped to its id (below)
  const int64_t* vocab_ids = trimmed ? head_rows.data_ptr<int64_t>() : nullptr;
  TORCH_CHECK(!trimmed || std::is_sorted(vocab_ids, vocab_ids + head_rows.numel()),
              "draft_steps: a draft vocabulary's ids must ascend");
  const int64_t qs = Hq * D, kvs = Hkv * D, W = block_tables.size(1);
  const int64_t* tab = block_tables.data_ptr<int64_t>();
  const int64_t* nsteps = steps.data_ptr<int64_t>();
  // each row's tokens to feed next (first its catch-up, then its last draft) and position
  std::vector<std::vector<int64_t>> pending(R);
  std::vector<int64_t> pos(positions.data_ptr<int64_t>(), positions.data_ptr<int64_t>() + R);
  const int64_t* f = feed.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = feed_lens.data_ptr<int64_t>()[r];
    TORCH_CHECK(n >= 1 && n <= MAX_FEED && nsteps[r] >= 1,
                "draft_steps: each row feeds 1-16 tokens and runs at least one step");
    pending[r].assign(f, f + n);
    f += n;
  }
  TORCH_CHECK(f == feed.data_ptr<int64_t>() + feed.numel(), "draft_steps: feed length");
  const int64_t most = R ? *std::max_element(nsteps, nsteps + R) : 0;
  Tensor out = at::full({R, most}, -1, feed.options());
  int64_t* o = out.data_ptr<int64_t>();
  const auto i64 = feed.options();
  const bool sampling = temperature.has_value();
  TORCH_CHECK(!sampling || (seeds.has_value() && offsets.has_value() &&
                            temperature->scalar_type() == at::kFloat &&
                            seeds->scalar_type() == at::kLong &&
                            offsets->scalar_type() == at::kLong &&
                            temperature->numel() == R && seeds->numel() == R &&
                            offsets->numel() == R),
              "draft_steps: fp32 temperature with int64 seeds and offsets, one per row");
  // each row's draw key and temperature, read per step
  std::vector<float> temp;
  std::vector<int64_t> seed, offset;
  if (sampling) {
    const Tensor t = temperature->contiguous(), sd = seeds->contiguous(), of = offsets->contiguous();
    temp.assign(t.data_ptr<float>(), t.data_ptr<float>() + R);
    seed.assign(sd.data_ptr<int64_t>(), sd.data_ptr<int64_t>() + R);
    offset.assign(of.data_ptr<int64_t>(), of.data_ptr<int64_t>() + R);
  }
  std::vector<float> draw_scratch;   // draw_row's
  // q of every step of every sampled row, the draft's distribution its tokens were drawn
  // from, packed: row r's steps from row first_q[r] on, one after the other (a T = 0 row's
  // unset and never read), so that rows' q taken in order are one block of memory, which
  // verification reads as it is (Engine._verify_metadata) instead of a copy
  // (or, with q_out, from row q_rows[r] of q_out on: the caller's buffer, which may hold
  // other calls' rows between this call's)
  std::vector<int64_t> first_q(size_t(R) + 1, 0);
  for (int64_t r = 0; r < R; ++r) first_q[size_t(r) + 1] = first_q[size_t(r)] + nsteps[r];
  Tensor probs;
  if (sampling && q_out.has_value()) {
    TORCH_CHECK(q_rows.has_value() && q_rows->scalar_type() == at::kLong &&
                    q_rows->numel() == R && q_out->scalar_type() == at::kFloat &&
                    q_out->dim() == 2 && q_out->size(1) == V && q_out->is_contiguous(),
                "draft_steps: q_out [N, V] fp32 (contiguous) with q_rows [R] int64");
    const Tensor qr = q_rows->contiguous();
    for (int64_t r = 0; r < R; ++r) {
      first_q[size_t(r)] = qr.data_ptr<int64_t>()[r];
      TORCH_CHECK(first_q[size_t(r)] >= 0 && first_q[size_t(r)] + nsteps[r] <= q_out->size(0),
                  "draft_steps: a row's q past q_out");
    }
    probs = *q_out;
  } else {
    probs = sampling ? at::empty({first_q[size_t(R)], V}, feed.options().dtype(at::kFloat))
                     : at::empty({0}, feed.options().dtype(at::kFloat));
  }
  for (int64_t s = 0; s < most; ++s) {
    // the step's inputs, as the runner and build_metadata make them for short rows
    std::vector<int64_t> active, ids, pids, slots, rows, last;
    for (int64_t r = 0; r < R; ++r) {
      if (nsteps[r] <= s) continue;
      const int64_t first = ids.size(), q = pending[r].size();
      for (int64_t j = 0; j < q; ++j) {
        const int64_t p = pos[r] + j;
        const int64_t block = p / block_size < W ? tab[r * W + p / block_size] : -1;
        TORCH_CHECK(block >= 0, "draft_steps: a row's block table is too short");
        ids.push_back(pending[r][j]);
        pids.push_back(p);
        slots.push_back(block * block_size + p % block_size);
      }
      rows.insert(rows.end(), {first, q, pos[r] + q});
      last.push_back(first + q - 1);
      active.push_back(r);
    }
    const int64_t M = active.size(), T = ids.size();
    // (views of the step's vectors, which outlive every op that reads them)
    auto tensor = [&](const std::vector<int64_t>& v) {
      return at::from_blob(const_cast<int64_t*>(v.data()), {int64_t(v.size())}, i64);
    };
    const Tensor p = tensor(pids), row_info = tensor(rows).view({M, 3}),
                 blocks = M == R ? block_tables : block_tables.index_select(0, tensor(active));
    Tensor h = embed_rows(embed, ids), x, mlp_out;
    for (int64_t l = 0; l < L; ++l) {
      const Tensor* w = weights.data() + GLOBALS + head_n + PER_LAYER * l;
      x = l == 0 ? op.rms_norm.call(h, w[0], eps) : op.add_rms_norm.call(h, mlp_out, w[0], eps);
      Tensor qkv = linear(x, w[2], H, qs + 2 * kvs, false);
      auto [q, k] = op.rope_qk.call(qkv, cos, sin, p, Hq, Hkv);
      bs::write_kv_rows(caches[2 * l], k, slots.data(), T);
      bs::write_kv_rows(caches[2 * l + 1], qkv.slice(1, qs + kvs), slots.data(), T);
      Tensor att = at::empty_like(q);
      op.attention.call(q, caches[2 * l], caches[2 * l + 1], blocks, row_info, scale, block_size,
                        att);
      Tensor proj = linear(att.reshape({T, qs}), w[3], qs, H, false);
      x = op.add_rms_norm.call(h, proj, w[1], eps);
      Tensor gate_up = linear(x, w[4], H, 2 * I, false);
      mlp_out = linear(op.silu_mul.call(gate_up), w[5], I, H, false);
    }
    x = op.add_rms_norm.call(h, mlp_out, final_norm, eps);
    if (T != M) x = x.index_select(0, tensor(last));   // each row's last token
    Tensor logits;
    const int64_t N = trimmed ? head_rows.numel() : V;
    if (head_kind == 0) {
      logits = op.head_int8.call(x, weights[GLOBALS], weights[GLOBALS + 1],
                                 weights[GLOBALS + 2], N);
    } else {
      logits = linear(x, weights[GLOBALS], H, N, true);
    }
    Tensor next;
    if (trimmed && !sampling) {
      // greedy rows of a draft vocabulary: the argmax of the scored logits, mapped to its id.
      // The full row's argmax (-inf elsewhere) is that id: the first maximum (or NaN) in the
      // ids' order is the first in the vocabulary's, as the ids ascend; a row of -inf alone
      // gives 0 there. Building the full rows took a tenth of a round at one row.
      next = op.argmax.call(logits);
      int64_t* nx = next.data_ptr<int64_t>();
      const float* lg = logits.data_ptr<float>();
      constexpr float none = -std::numeric_limits<float>::infinity();
      for (int64_t a = 0; a < M; ++a) nx[a] = lg[a * N + nx[a]] == none ? 0 : vocab_ids[nx[a]];
    } else {
      if (trimmed)   // as LlamaForCausalLM._full_vocab: -inf where the draft cannot propose
        logits = at::full({M, V}, -std::numeric_limits<float>::infinity(), logits.options())
                     .index_copy_(1, head_rows, logits);
      // the greedy rows' tokens (each sampled row's is drawn below: no argmax where all are)
      const bool any_greedy =
          !sampling || std::any_of(active.begin(), active.end(),
                                   [&](int64_t r) { return !(temp[size_t(r)] > 0.f); });
      next = any_greedy ? op.argmax.call(logits) : at::empty({M}, i64);
    }
    if (sampling) {
      // DraftModelProposer.propose's draw, row by row into the row's q: q = draft_probs
      // (with a filter, the row filter's probabilities; else draft_draw.h's softmax_row, as
      // softmax_rows), the draw of draft_draw.h keyed like verification; T = 0 rows keep
      // the argmax (their q is never read)
      TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.is_contiguous(),
                  "draft_steps: fp32 logits");
      const Tensor act = top_k.has_value() || top_p.has_value() ? tensor(active) : Tensor();
      const Tensor tk = top_k.has_value() ? top_k->index_select(0, act) : Tensor();
      const Tensor tp = top_p.has_value() ? top_p->index_select(0, act) : Tensor();
      Tensor filtered;
      if ((tk.defined() && tk.ne(0).any().item<bool>()) ||
          (tp.defined() && tp.lt(1.0).any().item<bool>())) {   // verify.filtered_probs
        const Tensor t = temperature->index_select(0, act);
        filtered = op.row_probs.call(logits, at::where(t.gt(0), t, 1.0),
                                     tk.defined() ? tk.to(at::kInt) : at::zeros({M}, i64.dtype(at::kInt)),
                                     tp.defined() ? tp : at::ones({M}, t.options()));
      }
      int64_t* nx = next.data_ptr<int64_t>();
      for (int64_t a = 0; a < M; ++a) {
        const int64_t r = active[a];
        if (!(temp[r] > 0.f)) continue;
        float* q = probs.data_ptr<float>() + (first_q[size_t(r)] + s) * V;
        const float u = bs::keyed_uniform(uint64_t(seed[r]), uint64_t(offset[r]),
                                          uint32_t(first_step + s), uint32_t(stream), 0);
        if (filtered.defined()) {
          std::copy_n(filtered.data_ptr<float>() + a * V, V, q);
          nx[a] = bs::draw_row(q, int(V), u, draw_scratch);
        } else {   // (softmax_row then draw_row, the blocks summed as q is written)
          nx[a] = bs::softmax_draw_row(logits.data_ptr<float>() + a * V, int(V), 1.f / temp[r],
                                       u, q, draw_scratch);
        }
      }
    }
    const int64_t* nx = next.data_ptr<int64_t>();
    for (int64_t a = 0; a < M; ++a) {
      const int64_t r = active[a];
      o[r * most + s] = nx[a];
      pos[r] += pending[r].size();
      pending[r].assign(1, nx[a]);
    }
  }
  return {out, probs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(BS_NS, m) {
  m.def("draft_steps(Tensor[] weights, int[] dims, float eps, float scale, int block_size, "
        "Tensor[] caches, Tensor feed, Tensor feed_lens, Tensor positions, Tensor block_tables, "
        "Tensor steps, Tensor? temperature, Tensor? seeds, Tensor? offsets, Tensor? top_k, "
        "Tensor? top_p, int stream, int first_step, Tensor? q_out=None, Tensor? q_rows=None) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(BS_NS, CPU, m) { m.impl("draft_steps", &draft_steps); }
// oneDNN-packed weights (mkldnn tensors) among the arguments dispatch here
TORCH_LIBRARY_IMPL(BS_NS, MkldnnCPU, m) { m.impl("draft_steps", &draft_steps); }
