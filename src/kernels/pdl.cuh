// Programmatic dependent launch (sm_90+): a kernel launched with the programmatic-serialization
// attribute (cuda/ops.cu launch_pdl) may start while its predecessor is still running. Its
// blocks first do what needs nothing from earlier kernels (issue the weight loads of their rows),
// then pdl_wait() until the predecessor has finished and its writes are visible, and only then
// read activations. So each kernel's DRAM latency and launch ramp overlap the previous kernel's
// tail, which at batch 1 is most of a small kernel's time.
//
// The rule every PDL kernel keeps: nothing is written, and no activation read, before pdl_wait;
// pdl_launch_dependents comes after pdl_wait. Then when a kernel starts, its predecessor's
// predecessor has completed, so the pre-wait part may read data from two launches back (the MoE
// down projection reads the routing that way to prefetch its experts).
// Where the trigger goes: most kernels release their successor at their wait (pdl_enter), so its
// weight loads start as early as possible. The tensor-core decode attention releases it after its
// loop instead: the successor's weight loads queued ahead of the loop's L2 reads of K/V rows
// (BENCHMARKS.md). Earlier than the wait measured worse everywhere it was tried.
// On older GPUs both are no-ops and launches serialise as usual.
#pragma once

namespace nibble::kernels {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Both, in the order the rule above requires.
__device__ __forceinline__ void pdl_enter() {
  pdl_wait();
  pdl_launch_dependents();
}

// Fire-and-forget fetch of the 128-byte line holding p into L2.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// The same into this SM's L1 (and L2).
__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

}  // namespace nibble::kernels
