// The new tokens' keys or values into their paged-cache slots on CPU: row t of src (heads x
// head dim, contiguous within the row; rows of any stride) to row slots[t] of the cache.
// What index_copy_ computes, without its dispatch and iterator set-up, which cost more than
// a step's few rows of bytes (two calls a layer, each forward).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace bs {

// whether each row of src (its dims after the first) is contiguous
inline bool row_contiguous(const at::Tensor& src) {
  int64_t expected = 1;
  for (int64_t d = src.dim() - 1; d >= 1; --d) {
    if (src.size(d) != 1 && src.stride(d) != expected) return false;
    expected *= src.size(d);
  }
  return true;
}

inline void write_kv_rows(const at::Tensor& cache, const at::Tensor& src, const int64_t* slots,
                          int64_t n) {
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && src.dim() >= 2 && src.size(0) == n &&
                  src.numel() == n * cache.size(1) * cache.size(2) &&
                  row_contiguous(src) &&
                  src.scalar_type() == cache.scalar_type(),
              "write_kv: keys or values do not match the cache");
  const int64_t bytes = cache.size(1) * cache.size(2) * cache.element_size();
  const int64_t row = src.stride(0) * src.element_size(), slots_total = cache.size(0);
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(cache.data_ptr());
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < slots_total, "write_kv: cache slot ", slots[t],
                " out of range");
    std::memcpy(to + slots[t] * bytes, from + t * row, bytes);
  }
}

}  // namespace bs
