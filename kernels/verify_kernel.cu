// CUDA verification kernel: one thread block per request runs bs::verify_request (see
// verify_core.h) over the request's n + 1 target rows. No torch headers, so
// `nvcc -c kernels/verify_kernel.cu` compiles it standalone; verify_ops.cpp binds it.
#include <cuda_runtime.h>
#include "verify_core.h"

namespace bs {

template <typename T, int kThreads>
__global__ void __launch_bounds__(kThreads) rejection_sample_kernel(VerifyParams P) {
  __shared__ uint64_t smem[32];   // one 8-byte partial per warp
  const Group g{int(threadIdx.x), kThreads, smem};
  verify_request<T>(P, int(blockIdx.x), g);
}

template <typename T>
static void launch(const VerifyParams& P, cudaStream_t stream) {
  // Few requests: wide blocks to keep enough loads in flight per SM; many: narrower blocks.
  if (P.batch < 64) rejection_sample_kernel<T, 1024><<<P.batch, 1024, 0, stream>>>(P);
  else rejection_sample_kernel<T, 256><<<P.batch, 256, 0, stream>>>(P);
}

// Returns a cudaError_t value (0 on success).
int launch_rejection_sample_cuda(const VerifyParams& P, void* stream) {
  if (P.batch == 0) return 0;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (P.dtype) {
    case kFloat32: launch<float>(P, s); break;
    case kBFloat16: launch<bf16>(P, s); break;
    case kFloat16: launch<fp16>(P, s); break;
    default: return int(cudaErrorInvalidValue);
  }
  return int(cudaGetLastError());
}

}  // namespace bs
