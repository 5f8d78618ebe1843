// Launch helpers shared by the CUDA launchers (ops.cu, gemv_dense.cu): programmatic dependent
// launch (kernels/pdl.cuh states the rule the kernels keep), clusters, the SM count, occupancy.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <map>
#include <utility>

namespace nibble::cuda {

// Launches a kernel that follows the PDL rule of kernels/pdl.cuh with programmatic stream
// serialisation, so it may start before its predecessor ends (sm_90+; plain launch before).
inline bool pdl_supported() {
  static const bool supported = [] {
    int major = 0;
    if (std::getenv("NIBBLE_NO_PDL")) return false;  // for measuring what PDL buys
    return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) == cudaSuccess && major >= 9;
  }();
  return supported;
}

// Thread-block clusters (sm_90+).
inline bool clusters_supported() {
  static const bool supported = [] {
    int major = 0;
    return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) == cudaSuccess && major >= 9;
  }();
  return supported;
}

// cluster > 0: the grid's blocks form clusters of that many along x (clusters_supported() only).
template <typename... Params, typename... Args>
inline void launch_pdl_cluster(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, unsigned cluster,
                               Args&&... args) {
  cudaLaunchAttribute attrs[2]{};
  unsigned n = 0;
  if (pdl_supported()) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 0) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n++].val.clusterDim = {cluster, 1, 1};
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = cudaStreamPerThread;
  config.attrs = attrs;
  config.numAttrs = n;
  cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

template <typename... Params, typename... Args>
inline void launch_pdl_smem(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Args&&... args) {
  launch_pdl_cluster(kernel, grid, block, smem, 0, std::forward<Args>(args)...);
}

template <typename... Params, typename... Args>
inline void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, Args&&... args) {
  launch_pdl_smem(kernel, grid, block, 0, std::forward<Args>(args)...);
}

// A kernel's preferred split of an SM's L1 and shared memory (percent of the most shared memory,
// cudaFuncAttributePreferredSharedMemoryCarveout; -1 the driver's default), set once a kernel.
template <typename... Params>
inline void prefer_smem_carveout(void (*kernel)(Params...), int percent) {
  static std::map<const void*, int> seen;
  auto [it, first] = seen.try_emplace(reinterpret_cast<const void*>(kernel), percent);
  if (first || it->second != percent)
    cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, percent);
  it->second = percent;
}

// Clusters of `cluster` blocks of `kernel` (`threads` a block, `smem` bytes of dynamic shared
// memory) that can be resident at once, 0 where none can (memoised). Sizes past the portable 8
// are allowed for the kernel first.
template <typename... Params>
inline int max_active_clusters(void (*kernel)(Params...), int threads, size_t smem, unsigned cluster) {
  static std::map<std::pair<const void*, std::pair<size_t, unsigned>>, int> seen;
  auto [it, first] = seen.try_emplace({reinterpret_cast<const void*>(kernel), {smem, cluster}}, 0);
  if (first && clusters_supported()) {
    if (cluster > 8) cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim = {cluster, 1, 1};
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(cluster);
    config.blockDim = dim3(unsigned(threads));
    config.dynamicSmemBytes = smem;
    config.attrs = &attr;
    config.numAttrs = 1;
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, kernel, &config) == cudaSuccess) it->second = n;
    cudaGetLastError();  // a size the device refuses: none
  }
  return it->second;
}

inline unsigned sm_count() {
  static const unsigned count = [] {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, 0);
    return unsigned(n > 0 ? n : 1);
  }();
  return count;
}

// Blocks of `kernel` that fit an SM at once with `smem` bytes of dynamic shared memory (memoised:
// captured decode steps launch the same few shapes).
template <typename... Params>
inline int resident_blocks(void (*kernel)(Params...), int threads, size_t smem) {
  static std::map<std::pair<const void*, size_t>, int> seen;
  auto [it, first] = seen.try_emplace({reinterpret_cast<const void*>(kernel), smem}, 1);
  if (first) {
    int blocks = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem) == cudaSuccess && blocks > 0)
      it->second = blocks;
  }
  return it->second;
}

}  // namespace nibble::cuda
