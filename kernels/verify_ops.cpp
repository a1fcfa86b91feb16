// Torch bindings of the verification op: the CPU twin (bs::verify_request per request,
// parallel over requests with at::parallel_for) and, when built with BS_WITH_CUDA, the CUDA
// kernel of verify_kernel.cu. Registered as torch.ops.<BS_NS>.* (see batchspec/spec/_build.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "draft_draw.h"
#include "verify_core.h"

#ifdef BS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
namespace bs { int launch_rejection_sample_cuda(const VerifyParams& P, void* stream); }
#endif

#ifndef BS_NS
#define BS_NS batchspec
#endif

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

void check(const Tensor& t, at::ScalarType dtype, const at::Device& device, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype, name, ": expected ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.device() == device, name, " must be on ", device);
}

bs::VerifyParams make_params(const Tensor& logits, const OptTensor& draft_probs,
                             const Tensor& draft_ids, const Tensor& cu, const Tensor& temperature,
                             const Tensor& seeds, const Tensor& offsets, const OptTensor& top_k,
                             const OptTensor& top_p, Tensor& out, Tensor& num_accepted) {
  const auto dev = logits.device();
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "target_logits must be contiguous [N+B, V]");
  const int64_t B = cu.numel() - 1, N = draft_ids.numel(), V = logits.size(1);
  TORCH_CHECK(B >= 0 && logits.size(0) == N + B, "target_logits must have N + B rows");
  check(draft_ids, at::kInt, dev, "draft_token_ids");
  check(cu, at::kInt, dev, "cu_num_draft");
  check(temperature, at::kFloat, dev, "temperature");
  check(seeds, at::kLong, dev, "seeds");
  check(offsets, at::kLong, dev, "offsets");
  TORCH_CHECK(temperature.numel() == B && seeds.numel() == B && offsets.numel() == B, "per-request tensors must have B entries");
  bs::VerifyParams P{};
  switch (logits.scalar_type()) {
    case at::kFloat: P.dtype = bs::kFloat32; break;
    case at::kBFloat16: P.dtype = bs::kBFloat16; break;
    case at::kHalf: P.dtype = bs::kFloat16; break;
    default: TORCH_CHECK(false, "target_logits must be fp32, bf16 or fp16");
  }
  if (draft_probs) {
    check(*draft_probs, at::kFloat, dev, "draft_probs");
    TORCH_CHECK(draft_probs->dim() == 2 && draft_probs->size(0) == N && draft_probs->size(1) == V, "draft_probs must be [N, V]");
    P.draft_probs = draft_probs->data_ptr<float>();
  }
  if (top_k) { check(*top_k, at::kInt, dev, "top_k"); TORCH_CHECK(top_k->numel() == B); P.top_k = top_k->data_ptr<int32_t>(); }
  if (top_p) { check(*top_p, at::kFloat, dev, "top_p"); TORCH_CHECK(top_p->numel() == B); P.top_p = top_p->data_ptr<float>(); }
  P.logits = logits.data_ptr();
  P.vocab = int(V);
  P.batch = int(B);
  P.out_stride = int(out.size(1));
  P.draft_ids = draft_ids.data_ptr<int32_t>();
  P.cu = cu.data_ptr<int32_t>();
  P.temperature = temperature.data_ptr<float>();
  P.seeds = seeds.data_ptr<int64_t>();
  P.offsets = offsets.data_ptr<int64_t>();
  P.out = out.data_ptr<int32_t>();
  P.num_accepted = num_accepted.data_ptr<int32_t>();
  return P;
}

template <typename T>
void run_cpu(const bs::VerifyParams& P) {
  bs::host_paths_on() = bs::host_draw_env();
  at::parallel_for(0, P.batch, 1, [&](int64_t lo, int64_t hi) {
    const bs::Group g{0, 1, nullptr};
    for (int64_t b = lo; b < hi; ++b) bs::verify_request<T>(P, int(b), g);
  });
}

std::tuple<Tensor, Tensor> rejection_sample(const Tensor& logits, const OptTensor& draft_probs,
                                            const Tensor& draft_ids, const Tensor& cu,
                                            const Tensor& temperature, const Tensor& seeds,
                                            const Tensor& offsets, const OptTensor& top_k,
                                            const OptTensor& top_p, int64_t max_n) {
  const int64_t B = cu.numel() - 1;
  auto opts = logits.options().dtype(at::kInt);
  Tensor out = at::empty({B, max_n + 1}, opts), num_accepted = at::empty({B}, opts);
  const auto P = make_params(logits, draft_probs, draft_ids, cu, temperature, seeds, offsets,
                             top_k, top_p, out, num_accepted);
  if (logits.is_cpu()) {
    switch (P.dtype) {
      case bs::kFloat32: run_cpu<float>(P); break;
      case bs::kBFloat16: run_cpu<bs::bf16>(P); break;
      default: run_cpu<bs::fp16>(P); break;
    }
  } else {
#ifdef BS_WITH_CUDA
    const c10::cuda::CUDAGuard guard(logits.device());
    const int err = bs::launch_rejection_sample_cuda(P, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == 0, "rejection_sample CUDA launch failed with cudaError ", err);
#else
    TORCH_CHECK(false, "this build of the verification op has no CUDA kernel");
#endif
  }
  return {out, num_accepted};
}

// Each row's argmax, as torch.argmax(-1) (the first maximum; the first NaN where a row has
// one): a draft's greedy tokens every draft step. torch's op visits about 2 ns a token on one
// thread, 0.3 ms a step at 32 rows of a 4,096-token vocabulary; this one is the vectorised
// pass of verify_host_rows.h.
Tensor argmax_rows(const Tensor& logits) {
  TORCH_CHECK(logits.is_cpu() && logits.dim() == 2 && logits.is_contiguous() &&
                  logits.scalar_type() == at::kFloat,
              "argmax_rows: expected contiguous fp32 [R, V] logits on the CPU");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "argmax_rows: empty rows");
  Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  bs::host_paths_on() = bs::host_draw_env();
  for (int64_t r = 0; r < R; ++r) {
    const float* row = x + r * V;
    int top = bs::host_argmax(row, int(V));
    if (top < 0) {   // a NaN (torch takes the first), or no vectorised pass here
      top = 0;
      for (int i = 0; i < int(V); ++i) {
        if (row[i] != row[i]) { top = i; break; }
        if (row[i] > row[top]) top = i;
      }
    }
    o[r] = top;
  }
  return out;
}

// The drafts' distributions q = softmax(logits / T) of fp32 rows (T = 0 rows at T = 1, as
// verify_torch.target_probs), and their draws: draft_draw.h's rows, for the step-by-step
// loop (the draft-steps op calls them directly). A draft step at T > 0 had spent about
// 0.1 ms at one row in the ten torch calls they replace.
Tensor softmax_rows(const Tensor& logits, const Tensor& temperature) {
  TORCH_CHECK(logits.is_cpu() && logits.dim() == 2 && logits.is_contiguous() &&
                  logits.scalar_type() == at::kFloat,
              "softmax_rows: expected contiguous fp32 [R, V] logits on the CPU");
  const int64_t R = logits.size(0), V = logits.size(1);
  check(temperature, at::kFloat, logits.device(), "temperature");
  TORCH_CHECK(temperature.numel() == R, "softmax_rows: one temperature per row");
  Tensor q = at::empty({R, V}, logits.options());
  bs::host_paths_on() = bs::host_draw_env();
  const float* t = temperature.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r)
    bs::softmax_row(logits.data_ptr<float>() + r * V, int(V), 1.f / (t[r] > 0.f ? t[r] : 1.f),
                    q.data_ptr<float>() + r * V);
  return q;
}

// One draw per row of q [R, V], keyed by (seeds, offsets, positions, stream)
Tensor draw_rows(const Tensor& q, const Tensor& seeds, const Tensor& offsets,
                 const Tensor& positions, int64_t stream) {
  TORCH_CHECK(q.is_cpu() && q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kFloat &&
                  q.size(1) > 0,
              "draw_rows: expected contiguous fp32 [R, V] probabilities on the CPU");
  const int64_t R = q.size(0), V = q.size(1);
  for (const Tensor* t : {&seeds, &offsets, &positions}) {
    check(*t, at::kLong, q.device(), "keys");
    TORCH_CHECK(t->numel() == R, "draw_rows: one seed, offset and position per row");
  }
  Tensor out = at::empty({R}, seeds.options());
  std::vector<float> blocks;
  for (int64_t r = 0; r < R; ++r) {
    const float u = bs::keyed_uniform(uint64_t(seeds.data_ptr<int64_t>()[r]),
                                      uint64_t(offsets.data_ptr<int64_t>()[r]),
                                      uint32_t(positions.data_ptr<int64_t>()[r]), uint32_t(stream), 0);
    out.data_ptr<int64_t>()[r] = bs::draw_row(q.data_ptr<float>() + r * V, int(V), u, blocks);
  }
  return out;
}

// The C++ RNG (rng.uniform_compiled) and filtered probabilities (verify.filtered_probs),
// each tested against its torch reference.
Tensor uniform(const Tensor& seeds, const Tensor& offsets, const Tensor& positions, int64_t stream, int64_t index) {
  TORCH_CHECK(seeds.is_cpu() && seeds.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && positions.scalar_type() == at::kLong);
  auto s = seeds.contiguous(), o = offsets.contiguous(), p = positions.contiguous();
  Tensor u = at::empty({s.numel()}, s.options().dtype(at::kFloat));
  for (int64_t i = 0; i < s.numel(); ++i)
    u.data_ptr<float>()[i] = bs::keyed_uniform(uint64_t(s.data_ptr<int64_t>()[i]), uint64_t(o.data_ptr<int64_t>()[i]),
                                               uint32_t(p.data_ptr<int64_t>()[i]), uint32_t(stream), uint32_t(index));
  return u;
}

Tensor row_probs(const Tensor& logits, const Tensor& temperature, const Tensor& top_k, const Tensor& top_p) {
  TORCH_CHECK(logits.is_cpu() && logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.dim() == 2);
  check(temperature, at::kFloat, logits.device(), "temperature");
  check(top_k, at::kInt, logits.device(), "top_k");
  check(top_p, at::kFloat, logits.device(), "top_p");
  const int64_t R = logits.size(0), V = logits.size(1);
  Tensor p = at::empty({R, V}, logits.options());
  bs::host_paths_on() = bs::host_draw_env();
  at::parallel_for(0, R, 1, [&](int64_t lo, int64_t hi) {
    const bs::Group g{0, 1, nullptr};
    for (int64_t r = lo; r < hi; ++r) {
      const float* row = logits.data_ptr<float>() + r * V;
      const float inv_t = 1.f / temperature.data_ptr<float>()[r];
      const auto f = bs::row_filter(row, int(V), inv_t, top_k.data_ptr<int32_t>()[r], top_p.data_ptr<float>()[r], g);
      for (int64_t i = 0; i < V; ++i) p.data_ptr<float>()[r * V + i] = bs::prob(f, row[i] * inv_t);
    }
  });
  return p;
}

}  // namespace

TORCH_LIBRARY(BS_NS, m) {
  m.def("rejection_sample(Tensor target_logits, Tensor? draft_probs, Tensor draft_token_ids, "
        "Tensor cu_num_draft, Tensor temperature, Tensor seeds, Tensor offsets, Tensor? top_k, "
        "Tensor? top_p, int max_n) -> (Tensor, Tensor)");
  m.def("uniform(Tensor seeds, Tensor offsets, Tensor positions, int stream, int index) -> Tensor");
  m.def("row_probs(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("softmax_rows(Tensor logits, Tensor temperature) -> Tensor");
  m.def("draw_rows(Tensor q, Tensor seeds, Tensor offsets, Tensor positions, int stream) -> Tensor");
}

TORCH_LIBRARY_IMPL(BS_NS, CPU, m) {
  m.impl("rejection_sample", &rejection_sample);
  m.impl("uniform", &uniform);
  m.impl("row_probs", &row_probs);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("softmax_rows", &softmax_rows);
  m.impl("draw_rows", &draw_rows);
}

#ifdef BS_WITH_CUDA
TORCH_LIBRARY_IMPL(BS_NS, CUDA, m) { m.impl("rejection_sample", &rejection_sample); }
#endif
