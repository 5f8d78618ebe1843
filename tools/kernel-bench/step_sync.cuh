// Phase counters for a persistent kernel (docs/persistent-decode.md; used by persistent_bench.cu,
// not by nibble: the persistent step was measured and not built): the blocks of one
// cooperative launch (all resident) take a step's phases in order, and a block may start phase
// p + 1's work, or a producer warp may issue the loads that depend on phase p, once every block
// has finished phase p. Unlike a grid barrier, a wait names the phase it needs, so a producer can
// run ahead of its own block's consumers.
//
// Nothing is reset between launches, so a captured graph can replay the step: counts[p] grows by
// `arrivals` (the grid's blocks) each launch, and *epoch counts the launches. Every block reads
// the epoch e at its start; phase p of this launch is complete when counts[p] reaches
// (e + 1) * arrivals; one thread advances the epoch once the last phase is complete everywhere
// (so every block has read it by then). The arithmetic is modulo 2^32 and the comparison
// wrap-safe, so the counters may wrap. A launch that stops half-way (a trap) leaves them
// inconsistent: the host zeroes counts and epoch before the next one.
//
// Ordering: a block's writes for phase p happen before its arrival (release, after a block-wide
// barrier among the threads that wrote), and a waiter's acquire load orders its later reads after
// them; threads that did not make the acquire load need a block-wide barrier after it.
#pragma once

#include <cstdint>

namespace nibble::kernels {

__device__ __forceinline__ uint32_t step_load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The launch's epoch, read once at the start of every block.
__device__ __forceinline__ uint32_t step_epoch(const uint32_t* epoch) { return step_load_acquire(epoch); }

// What counts[p] reads once every block of the launch of epoch e has finished phase p.
__device__ __forceinline__ uint32_t phase_target(uint32_t e, uint32_t arrivals) { return (e + 1u) * arrivals; }

__device__ __forceinline__ bool phase_reached(const uint32_t* count, uint32_t target) {
  return int32_t(step_load_acquire(count) - target) >= 0;
}

// One block done with a phase: one thread, after the block's writes for it (and a barrier).
__device__ __forceinline__ void phase_arrive(uint32_t* count) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
}

// Until the phase is complete. A wait of more than ~2 s means a block never arrived (a bug, or a
// grid that was not all resident): it traps, so the launch fails with an error instead of hanging.
__device__ __forceinline__ void phase_wait(const uint32_t* count, uint32_t target) {
  if (phase_reached(count, target)) return;
  uint64_t start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  while (!phase_reached(count, target)) {
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > 2'000'000'000ull) __trap();
  }
}

// The launch's end, by one thread of one block: waits for the last phase, then advances the epoch
// for the next launch.
__device__ __forceinline__ void step_finish(uint32_t* epoch, const uint32_t* last_count, uint32_t e,
                                           uint32_t arrivals) {
  phase_wait(last_count, phase_target(e, arrivals));
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(epoch), "r"(e + 1u) : "memory");
}

}  // namespace nibble::kernels
