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
// Where the trigger goes: as soon as the kernel's own critical L2 reads are done, not sooner. Once
// released, the successor's blocks issue their weight loads, and a read on this kernel's critical
// path then queues behind them. So the decode GEMVs release it after staging their input row, the
// INT4 MoE gate/up after its routing and row, the INT4 MoE down after copying its activations, the
// tensor-core decode attention after its loop (its "products"); the routers (Qwen3's and
// gpt-oss's) and the MXFP4 expert stream release it at the wait (pdl_enter / pdl_enter_at). Every
// place was measured (BENCHMARKS.md); earlier than the wait measured worse everywhere it was
// tried, and so did the end of the MXFP4 MoE kernels.
// On older GPUs both are no-ops and launches serialise as usual.
#pragma once

#include "kernels/pdl_sites.h"

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

// Where a decode kernel releases its successor. Each kernel names its site and its default place
// (kernels/pdl_sites.h); NIBBLE_PDL_TRIGGER (backend/pdl_trigger.h, for A/B runs) may override a
// site's place: three bits a site, 0 for no override, else the place + 1.
static __constant__ unsigned g_pdl_trigger = 0;

template <int kSite, PdlWhere kDefault = kPdlAtWait>
__device__ __forceinline__ void pdl_trigger_at(PdlWhere where) {
  if constexpr (kSite < 0) {
    if (where == kDefault) pdl_launch_dependents();
  } else {
    const unsigned o = (g_pdl_trigger >> (3 * kSite)) & 7u;
    if ((o ? o - 1 : unsigned(kDefault)) == where) pdl_launch_dependents();
  }
}

template <int kSite, PdlWhere kDefault = kPdlAtWait>
__device__ __forceinline__ void pdl_enter_at() {
  pdl_wait();
  pdl_trigger_at<kSite, kDefault>(kPdlAtWait);
}

// Fire-and-forget fetch of the 128-byte line holding p into L2.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

}  // namespace nibble::kernels
