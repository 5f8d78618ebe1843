// In-kernel timeline of a decode step (a build configured with -DNIBBLE_TIMELINE=ON only): thread
// 0 of every block of the instrumented kernels records the global timer when the block starts,
// when its PDL wait returns, at one mark inside the kernel and when it ends, with its SM. Why: the
// CUPTI trace serialises the kernels, so it cannot show what PDL overlaps, when a grid's blocks
// become resident, or how long a kernel's blocks wait for their predecessor; these records can
// (tools/timeline.py turns them into per-kernel critical times and boundary gaps).
//
// Records go to a ring (the newest `capacity` blocks survive), each block taking its slot with one
// atomic issued at its start, so the round trip overlaps the block's weight loads and its wait.
// In a normal build every macro here is empty and the kernels are unchanged.
#pragma once

#include <cstdint>

namespace nibble::kernels {

// The instrumented kernels; tools/timeline.py reads the names from the dump's first line.
enum class TimelineKernel : uint16_t {
  kEmbed,
  kGemvInt4,
  kMoeGateUp,
  kMoeDown,
  kMoeRouter,
  kMoeRoute,
  kAttentionTc,
  kAttention,
  kQkNormRope,
  kRmsNorm,
  kGemvDense,
  kArgmaxPartial,
  kArgmaxFinal,
  kCount
};

inline constexpr const char* kTimelineKernelNames =
    "embed,gemv_int4,moe_gate_up,moe_down,moe_router,moe_route,attention_tc,attention,qk_norm_rope,rms_norm,"
    "gemv_dense,argmax_partial,argmax_final";

struct TimelineRecord {
  uint16_t kernel;
  uint16_t sm;
  uint32_t block;     // linear block index
  uint32_t blocks;    // blocks in the grid: tools/timeline.py groups launches by it (kernels overlap)
  uint32_t reserved;  // keeps the timestamps 8-byte aligned, as tools/timeline.py's REC reads them
  uint64_t entry;     // ns, global timer
  uint64_t waited;    // after pdl_enter (0: the kernel has no wait)
  uint64_t mark;      // the kernel's one inner mark (0: none reached)
  uint64_t end;
};
static_assert(sizeof(TimelineRecord) == 48, "tools/timeline.py's REC reads this layout");

#ifdef NIBBLE_TIMELINE
// One copy per translation unit (no relocatable device code): the backend enables the copy in the
// unit that launches the decode kernels (backend/cuda/ops.cu); elsewhere it stays null.
static __device__ TimelineRecord* g_timeline_records = nullptr;
static __device__ unsigned long long g_timeline_next = 0;
static __device__ unsigned long long g_timeline_mask = 0;
// Which of a kernel's alternative mark points records (NIBBLE_TIMELINE_MARK_AT, default 0): a
// kernel with several NIBBLE_TIMELINE_MARK_AT(n) points is timed to each in turn, one run a point.
static __device__ int g_timeline_mark_at = 0;
// Written by NIBBLE_TIMELINE_MARK_AFTER: a volatile store of the value issues only once it is ready
// (a warp issues in order), so the mark after it cannot read the timer before the value exists.
static __device__ float g_timeline_sink = 0.f;

__device__ __forceinline__ uint64_t timeline_now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct TimelineBlock {
  TimelineRecord r{};
  unsigned long long slot = 0;
  int mark_at = 0;  // g_timeline_mark_at, read once at the start: a global load at each mark
                    // would sit in the times it measures
  bool on = false;

  __device__ explicit TimelineBlock(TimelineKernel k) {
    if (threadIdx.x != 0 || threadIdx.y != 0 || g_timeline_records == nullptr) return;
    on = true;
    r.entry = timeline_now();
    r.kernel = uint16_t(k);
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    r.sm = uint16_t(sm);
    r.block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    r.blocks = gridDim.x * gridDim.y * gridDim.z;
    mark_at = g_timeline_mark_at;
    slot = atomicAdd(&g_timeline_next, 1ull);
  }
  __device__ void waited() {
    if (on) r.waited = timeline_now();
  }
  __device__ void mark() {
    if (on) r.mark = timeline_now();
  }
  __device__ void mark_if(int n) {
    if (on && mark_at == n) r.mark = timeline_now();
  }
  __device__ void mark_if_after(int n, float value) {
    if (!on || mark_at != n) return;
    *static_cast<volatile float*>(&g_timeline_sink) = value;
    r.mark = timeline_now();
  }
  __device__ ~TimelineBlock() {
    if (!on) return;
    r.end = timeline_now();
    g_timeline_records[slot & g_timeline_mask] = r;
  }
};

#define NIBBLE_TIMELINE_BLOCK(kernel) ::nibble::kernels::TimelineBlock timeline_(::nibble::kernels::TimelineKernel::kernel)
#define NIBBLE_TIMELINE_WAITED() timeline_.waited()
#define NIBBLE_TIMELINE_MARK() timeline_.mark()
#define NIBBLE_TIMELINE_MARK_AT(n) timeline_.mark_if(n)
// A mark point inside a device function the kernel calls: pass it NIBBLE_TIMELINE_MARKER and
// call marker(n, value) there (a mark once value is ready).
#define NIBBLE_TIMELINE_MARKER [&](int n, float value) { timeline_.mark_if_after(n, value); }
// A mark once `value` (a float the kernel computed) is ready.
#define NIBBLE_TIMELINE_MARK_AFTER(n, value) timeline_.mark_if_after(n, value)
#else
#define NIBBLE_TIMELINE_BLOCK(kernel) ((void)0)
#define NIBBLE_TIMELINE_WAITED() ((void)0)
#define NIBBLE_TIMELINE_MARK() ((void)0)
#define NIBBLE_TIMELINE_MARK_AT(n) ((void)0)
#define NIBBLE_TIMELINE_MARKER ::nibble::kernels::NoTimelineMarker{}
#define NIBBLE_TIMELINE_MARK_AFTER(n, value) ((void)0)
#endif
// The marker of a build without the timeline (and the default of functions taking one).
struct NoTimelineMarker {
  __device__ void operator()(int, float) const {}
};

}  // namespace nibble::kernels
