// Shared memory above the 48 KB default needs an opt-in per kernel (the launchers of ops.cu and
// gemm.cu): the kernel's static arrays count toward the 48 KB too, so a kernel whose dynamic part
// alone fits can still fail to launch without it (a 5-row decode GEMV at K 4096: 41 KB staged
// plus 8 KB of static partial sums).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <unordered_map>
#include <utility>

namespace nibble::cuda {

// Allows `bytes` of dynamic shared memory for `kernel`; done once per kernel and size (host code,
// one thread launches).
template <typename... Params>
void allow_smem(void (*kernel)(Params...), size_t bytes) {
  static std::unordered_map<const void*, std::pair<size_t, size_t>> seen;  // kernel -> static, allowed
  auto [it, first] = seen.try_emplace(reinterpret_cast<const void*>(kernel), 0, 0);
  if (first) {
    cudaFuncAttributes attr{};
    cudaFuncGetAttributes(&attr, kernel);
    it->second.first = attr.sharedSizeBytes;
  }
  auto& [static_bytes, allowed] = it->second;
  if (static_bytes + bytes <= 48 * 1024 || bytes <= allowed) return;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  allowed = bytes;
}

// The bytes of shared memory one block may opt in to on this device (read once).
inline int smem_optin_bytes() {
  static const int bytes = [] {
    int b = 0;
    cudaDeviceGetAttribute(&b, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0);
    return b;
  }();
  return bytes;
}

}  // namespace nibble::cuda
