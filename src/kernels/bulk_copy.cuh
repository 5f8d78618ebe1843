// Bulk copies from global into shared memory and the mbarriers that count their bytes (sm_90+:
// cp.async.bulk, the copy engine of the TMA, one instruction for a contiguous range). A block
// issues its weight tiles' loads into a ring of shared-memory stages without holding them in
// registers, so the bytes it has in flight are bounded by shared memory (hundreds of KB an SM)
// instead of by registers (kernels/mxfp4_stream.cuh says why that matters at batch 1).
//
// Protocol of a stage (the usual producer/consumer ring): the producer arms the stage's `full`
// barrier with the bytes to expect and issues the copies, which complete those bytes on it; the
// consumers wait on `full` for the phase, read the stage, and arrive on its `empty` barrier; the
// producer waits on `empty` before it writes the stage again. Phases alternate parity 0, 1, 0, ...
// On older GPUs these compile to traps: the launchers use them on sm_90+ only.
#pragma once

#include <cstdint>

namespace nibble::kernels {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define NIBBLE_BULK_ASM(...) asm volatile(__VA_ARGS__)
#else
#define NIBBLE_BULK_ASM(...) __trap()
#endif

// count: the arrivals a phase needs. Before any use: the block syncs after init (and
// fence_barrier_init makes the init visible to the copy engine).
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  NIBBLE_BULK_ASM("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void fence_barrier_init() {
  NIBBLE_BULK_ASM("fence.proxy.async.shared::cta;" ::: "memory");
}

// One arrival, and `bytes` more for the copies of this phase to complete.
__device__ __forceinline__ void mbarrier_arrive_expect(uint64_t* bar, uint32_t bytes) {
  NIBBLE_BULK_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
                  : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  NIBBLE_BULK_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
}

// Until the phase of this parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t done = 0;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
  } while (!done);
#else
  __trap();
#endif
}

// bytes (a multiple of 16, both addresses 16-byte aligned) from global to this block's shared
// memory, completed on bar. Streamed weights are read once a step: evict them from L2 first, so
// the activations and the KV cache stay there.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                          uint64_t policy) {
  NIBBLE_BULK_ASM(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar)), "l"(policy)
      : "memory");
}

// The same without a cache hint: activations a predecessor kernel wrote, which other blocks read too.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  NIBBLE_BULK_ASM("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                      shared_address(dst)),
                  "l"(src), "r"(bytes), "r"(shared_address(bar))
                  : "memory");
}

__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy = 0;
  NIBBLE_BULK_ASM("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

#undef NIBBLE_BULK_ASM

}  // namespace nibble::kernels
