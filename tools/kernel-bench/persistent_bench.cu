// What a persistent decode step could reach: the skeleton of one kernel for a whole batch-1 decode
// step (no lm_head), with the real byte counts and dependencies of a model's layers and synthetic
// arithmetic. The question behind it (issue 6): the per-kernel decode spends ~4x its bandwidth
// time per layer, and BENCHMARKS.md traced it to each launch's ramp and tail plus the chain of
// L2 round trips after each PDL wait; earlier bytes (L2 prefetch, early triggers) queued ahead of
// the critical loads. In one persistent kernel a producer warp per SM streams that SM's weight
// tiles for the whole step, in step order, through a shared-memory ring, while the consumer warps
// take the phases in order, each after a grid barrier. The ring bounds what is in flight, the
// order keeps the bytes of the running phase ahead of the next ones, and DRAM can stay busy
// across phase boundaries. How close to the copy bandwidth does that get, with the barriers and
// the activations' L2 reads a step really has?
//
// A layer is a list of phases (bytes, tile size, and whether the producer must first wait for a
// barrier: the experts are known only once the router's phase is done). Every phase ends in a
// grid barrier (step_sync.cuh beside this file: a counter a phase, one release-add per block, polled with
// acquire loads, never reset, so a captured graph can replay the launch), and its consumers start
// by reading the previous phase's output row from L2 (the activation staging of the real
// kernels). The variants, each timed for a whole step (the persistent ones also as a replayed
// graph, which says whether a cooperative launch can be captured):
//   weights in registers, as the shipped kernels hold them (a block loads its first tiles of a
//   phase before it waits for the phase's input):
//     layers:     one PDL launch a phase, replayed as a CUDA graph: the shipped design in these
//                 terms, the figure the others compare with on the same machine
//     persistent: the same phases in one cooperative launch, grid barriers in place of launches
//                 (no boundaries, no blocks resident late; the existing kernels' code could move
//                 into it as it is)
//   weights through a shared-memory ring that a producer warp an SM fills:
//     layers:     one PDL launch a phase, a small ring so the next launch's block fits beside
//     persistent, ahead:  bounded only by the ring and the routing (the design of
//                 docs/persistent-decode.md)
//     persistent, pdl:    phase p's tiles only after phase p - 2's barrier (PDL's lookahead)
//     persistent, serial: phase p's tiles only after phase p - 1's barrier
//     barriers and rows only (no bytes): the floor the dependency chain alone sets
// The consumers' arithmetic is `work` dependent multiply-adds a 16-byte unit. A calibration first
// times the real INT4 products (kernels/int4_stream.cuh) on a staged tile against work 0, 8 and
// 24, so the work that stands for them can be read off.
// Run by hand on the GPU: build/cuda90/persistent_bench [work] [--layers-only]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_common.cuh"
#include "step_sync.cuh"
#include "kernels/bulk_copy.cuh"
#include "kernels/int4_stream.cuh"
#include "kernels/pdl.cuh"

namespace {

using namespace nibble::kernels;

constexpr int kConsumers = 8;  // consumer warps a block; one more warp produces

struct Phase {
  const uint8_t* base;  // tiles of tile_bytes, contiguous
  int64_t tiles;
  int tile_bytes;
  int dep;  // the producer waits for this phase's barrier first (-1: none)
};

enum Mode { kAhead = 0, kPdl = 1, kSerial = 2 };

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(32 * kConsumers) : "memory"); }

// This block's k-th tile of phase p: tiles are dealt round-robin from a per-phase offset, so the
// blocks that get one more tile differ from phase to phase.
__device__ __forceinline__ int64_t my_tiles(const Phase& ph, int p) {
  const int64_t g = gridDim.x, first = (int64_t(blockIdx.x) - 37 * p % g + g) % g;
  return ph.tiles > first ? (ph.tiles - 1 - first) / g + 1 : 0;
}
__device__ __forceinline__ int64_t tile_index(int p, int64_t k) {
  const int64_t g = gridDim.x;
  return (int64_t(blockIdx.x) - 37 * p % g + g) % g + k * g;
}

// The consumers' arithmetic on one 16-byte unit of weights.
__device__ __forceinline__ void use_unit(uint4 v, int work, uint32_t& acc) {
  uint32_t h = v.x ^ v.y ^ v.z ^ v.w;
  for (int i = 0; i < work; ++i) h = h * 2654435761u + (h >> 7);
  acc += h;
}

// The previous phase's output row, from L2 (as the real kernels stage their input).
__device__ __forceinline__ void read_row(const float* row, int act_floats, uint32_t& acc) {
  float x = 0.f;
  for (int i = threadIdx.x; i < act_floats; i += 32 * kConsumers) x += __ldcg(row + i);
  acc += __float_as_uint(x);
}

// The consumers' partial sums meet and the block writes its share of a phase's output row.
__device__ __forceinline__ void phase_epilogue(uint32_t acc, float* row, int act_floats) {
  __shared__ float s_partial[kConsumers];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float part = float(acc & 0xff);
  for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
  if (lane == 0) s_partial[warp] = part;
  consumers_sync();
  if (threadIdx.x < 16) {
    float sum = 0.f;
    for (int w = 0; w < kConsumers; ++w) sum += s_partial[w];
    row[(int64_t(blockIdx.x) * 16 + threadIdx.x) % act_floats] = sum;
  }
  consumers_sync();
}

// A ring of `stages` shared-memory stages of stage_bytes: the producer warp copies tile j of the
// block's sequence into stage j % stages (kernels/bulk_copy.cuh's protocol), the consumer warps
// read it and release it.
struct Ring {
  uint8_t* smem;
  int stages, stage_bytes;
  uint64_t *full, *empty;

  __device__ Ring(uint8_t* smem_, int stages_, int stage_bytes_) : smem(smem_), stages(stages_), stage_bytes(stage_bytes_) {
    full = reinterpret_cast<uint64_t*>(smem + int64_t(stages) * stage_bytes);
    empty = full + stages;
    if (threadIdx.x == 0) {
      for (int s = 0; s < stages; ++s) mbarrier_init(&full[s], 1), mbarrier_init(&empty[s], kConsumers);
      fence_barrier_init();
    }
    __syncthreads();
  }

  // Producer warp: tile k of phase p as the block's j-th.
  __device__ void produce(const Phase& ph, int p, int64_t k, int64_t j, uint64_t policy) {
    const int s = int(j % stages);
    if (j >= stages) mbarrier_wait(&empty[s], uint32_t((j / stages - 1) & 1));
    if (threadIdx.x % 32 == 0) {
      mbarrier_arrive_expect(&full[s], uint32_t(ph.tile_bytes));
      bulk_load(smem + int64_t(s) * stage_bytes, ph.base + tile_index(p, k) * ph.tile_bytes, uint32_t(ph.tile_bytes),
                &full[s], policy);
    }
    __syncwarp();
  }

  // Consumer warps: the block's `mine` tiles of a phase, from the j-th on.
  __device__ void consume(const Phase& ph, int64_t mine, int64_t& j, int work, uint32_t& acc) {
    const int units = ph.tile_bytes / 16;
    for (int64_t k = 0; k < mine; ++k, ++j) {
      const int s = int(j % stages);
      mbarrier_wait(&full[s], uint32_t((j / stages) & 1));
      const uint4* stage = reinterpret_cast<const uint4*>(smem + int64_t(s) * stage_bytes);
      for (int u = threadIdx.x; u < units; u += 32 * kConsumers) use_unit(stage[u], work, acc);
      __syncwarp();
      if (threadIdx.x % 32 == 0) mbarrier_arrive(&empty[s]);
    }
  }
};

// The persistent step with the ring: warp kConsumers produces, the others consume.
__global__ void __launch_bounds__(32 * (kConsumers + 1), 1)
    step_kernel(const Phase* __restrict__ phases, int n_phases, int stages, int stage_bytes, int mode, int work,
                uint32_t* __restrict__ counters, uint32_t* __restrict__ epoch, float* __restrict__ act, int act_floats,
                uint32_t* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  Ring ring(smem, stages, stage_bytes);
  const uint32_t e = step_epoch(epoch), done = phase_target(e, gridDim.x);
  if (threadIdx.x / 32 == kConsumers) {
    const uint64_t policy = l2_evict_first_policy();
    int64_t j = 0;
    for (int p = 0; p < n_phases; ++p) {
      const Phase ph = phases[p];
      int dep = ph.dep;
      if (mode == kSerial && p >= 1) dep = max(dep, p - 1);
      if (mode == kPdl && p >= 2) dep = max(dep, p - 2);
      if (dep >= 0 && threadIdx.x % 32 == 0) phase_wait(counters + dep, done);
      __syncwarp();
      const int64_t mine = my_tiles(ph, p);
      for (int64_t k = 0; k < mine; ++k, ++j) ring.produce(ph, p, k, j, policy);
    }
    return;
  }
  uint32_t acc = 0;
  int64_t j = 0;
  for (int p = 0; p < n_phases; ++p) {
    const Phase ph = phases[p];
    if (p > 0) {
      if (threadIdx.x == 0) phase_wait(counters + p - 1, done);
      consumers_sync();
      read_row(act + int64_t(p - 1) * act_floats, act_floats, acc);
      consumers_sync();
    }
    ring.consume(ph, my_tiles(ph, p), j, work, acc);
    phase_epilogue(acc, act + int64_t(p) * act_floats, act_floats);
    if (threadIdx.x == 0) phase_arrive(counters + p);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) step_finish(epoch, counters + n_phases - 1, e, gridDim.x);
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// Weights in registers instead of a ring, as the shipped decode kernels hold them: each block
// loads up to kRegTiles of its tiles of a phase (16 bytes x 4 a thread a 16 KB tile) before it
// waits for the phase's input, the rest kRegTiles at a time after. As one persistent kernel
// (grid barriers: what PDL gives without launches, late blocks or boundaries) and as one launch
// a phase (PDL, graph-replayed: the shipped design in these terms).
constexpr int kRegTiles = 4;
constexpr int kRegUnits = 4;  // 16-byte units a thread a tile: tiles up to 16 KB
constexpr int kRegMaxTileBytes = 16 * kRegUnits * 32 * kConsumers;

struct RegisterTiles {
  uint4 r[kRegTiles][kRegUnits];

  __device__ __forceinline__ void load(const Phase& ph, int p, int64_t k0, int64_t mine) {
    const int units = ph.tile_bytes / 16;
#pragma unroll
    for (int b = 0; b < kRegTiles; ++b)
#pragma unroll
      for (int i = 0; i < kRegUnits; ++i) {
        const int u = threadIdx.x + i * 32 * kConsumers;
        if (k0 + b < mine && u < units)
          r[b][i] = __ldcs(reinterpret_cast<const uint4*>(ph.base + tile_index(p, k0 + b) * ph.tile_bytes) + u);
      }
  }

  __device__ __forceinline__ void use(const Phase& ph, int64_t k0, int64_t mine, int work, uint32_t& acc) const {
    const int units = ph.tile_bytes / 16;
#pragma unroll
    for (int b = 0; b < kRegTiles; ++b)
#pragma unroll
      for (int i = 0; i < kRegUnits; ++i)
        if (k0 + b < mine && threadIdx.x + i * 32 * kConsumers < units) use_unit(r[b][i], work, acc);
  }

  // All of the block's tiles of phase p, the first kRegTiles already loaded.
  __device__ __forceinline__ void finish(const Phase& ph, int p, int64_t mine, int work, uint32_t& acc) {
    for (int64_t k0 = 0; k0 < mine; k0 += kRegTiles) {
      if (k0 > 0) load(ph, p, k0, mine);
      use(ph, k0, mine, work, acc);
    }
  }
};

// Whether phase p's tiles follow from the barrier just before it (the experts after the router).
__device__ __forceinline__ bool loads_after_wait(const Phase& ph, int p) { return ph.dep >= 0 && ph.dep == p - 1; }

__global__ void __launch_bounds__(32 * kConsumers, 1)
    step_registers_kernel(const Phase* __restrict__ phases, int n_phases, int work, uint32_t* __restrict__ counters,
                          uint32_t* __restrict__ epoch, float* __restrict__ act, int act_floats, uint32_t* sink) {
  const uint32_t e = step_epoch(epoch), done = phase_target(e, gridDim.x);
  uint32_t acc = 0;
  RegisterTiles tiles;
  for (int p = 0; p < n_phases; ++p) {
    const Phase ph = phases[p];
    const int64_t mine = my_tiles(ph, p);
    if (!loads_after_wait(ph, p)) tiles.load(ph, p, 0, mine);
    if (p > 0) {
      if (threadIdx.x == 0) phase_wait(counters + p - 1, done);
      consumers_sync();
      read_row(act + int64_t(p - 1) * act_floats, act_floats, acc);
    }
    if (loads_after_wait(ph, p)) tiles.load(ph, p, 0, mine);
    tiles.finish(ph, p, mine, work, acc);
    phase_epilogue(acc, act + int64_t(p) * act_floats, act_floats);
    if (threadIdx.x == 0) phase_arrive(counters + p);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) step_finish(epoch, counters + n_phases - 1, e, gridDim.x);
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// The per-kernel design in the same terms, for a side-by-side figure: one launch a phase (PDL,
// replayed as a CUDA graph as nibble's decode steps are). As the real kernels do, a phase's
// weights are issued before griddepcontrol.wait unless they depend on the previous launch (the
// experts of the phase right after the router), and the successor is released once the row is
// staged. Registers: 256 threads of ~124 registers, so the next launch's block fits beside.
__global__ void __launch_bounds__(32 * kConsumers, 1)
    phase_registers_kernel(Phase ph, int p, int work, const float* __restrict__ act_in, float* __restrict__ act_out,
                           int act_floats, uint32_t* sink) {
  uint32_t acc = 0;
  RegisterTiles tiles;
  const int64_t mine = my_tiles(ph, p);
  if (!loads_after_wait(ph, p)) tiles.load(ph, p, 0, mine);
  pdl_wait();
  if (act_in) read_row(act_in, act_floats, acc);
  consumers_sync();
  pdl_launch_dependents();
  if (loads_after_wait(ph, p)) tiles.load(ph, p, 0, mine);
  tiles.finish(ph, p, mine, work, acc);
  phase_epilogue(acc, act_out, act_floats);
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// The ring: a small one, so the next launch's block fits beside.
__global__ void __launch_bounds__(32 * (kConsumers + 1), 1)
    phase_kernel(Phase ph, int p, int stages, int stage_bytes, int work, const float* __restrict__ act_in,
                 float* __restrict__ act_out, int act_floats, uint32_t* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  Ring ring(smem, stages, stage_bytes);
  const int64_t mine = my_tiles(ph, p);
  if (threadIdx.x / 32 == kConsumers) {
    const uint64_t policy = l2_evict_first_policy();
    if (loads_after_wait(ph, p)) pdl_wait();
    for (int64_t k = 0; k < mine; ++k) ring.produce(ph, p, k, k, policy);
    return;
  }
  pdl_wait();
  uint32_t acc = 0;
  if (act_in) read_row(act_in, act_floats, acc);
  consumers_sync();
  pdl_launch_dependents();
  int64_t j = 0;
  ring.consume(ph, mine, j, work, acc);
  phase_epilogue(acc, act_out, act_floats);
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// What `work` stands for: the consumers' time on a tile already in shared memory, synthetic
// against the real INT4 products (kernels/int4_stream.cuh's int4_stage_dot: a Qwen3 tile of 16
// rows x 2048 k, group 128, no zero points, two warps a tile and four tiles at once, as the
// streamed GEMV takes them). No DRAM: each block stages one tile and consumes it `rounds` times.
constexpr int64_t kCalK = 2048, kCalGroups = kCalK / 128;

template <bool kInt4>
__global__ void __launch_bounds__(32 * kConsumers, 1)
    consume_calibration_kernel(const uint8_t* __restrict__ src, int rounds, int work, uint32_t* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int64_t stage_bytes = int4_stream_stage_bytes(kCalK, kCalGroups, false);
  __half* xs = reinterpret_cast<__half*>(smem + stage_bytes);
  for (int64_t i = threadIdx.x; i < stage_bytes / 16; i += blockDim.x)
    reinterpret_cast<uint4*>(smem)[i] = reinterpret_cast<const uint4*>(src)[i];
  // Finite scales and activations, so the products are ordinary numbers.
  auto* scales = reinterpret_cast<__half*>(smem + int4_stream_scales_offset(kCalK));
  for (int i = threadIdx.x; i < 16 * kCalGroups; i += blockDim.x) scales[i] = __float2half(0.01f * (1 + i % 7));
  for (int i = threadIdx.x; i < kCalK; i += blockDim.x) xs[i] = __float2half(0.001f * (i % 13));
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint32_t acc_bits = 0;
  if constexpr (kInt4) {
    const int tile_warps = int4_stream_tile_warps(kCalK, kConsumers);
    const uint2* xb = mma_x_units(xs, kCalK, 1);
    for (int r = 0; r < rounds; ++r) {  // each round: `batch` tiles (the same stage)
      asm volatile("" ::: "memory");     // the stage is read again each round, not kept in registers
      float acc[kMmaChains][4] = {};
      int4_stage_dot<4>(Int4StageRows{smem, kCalK, kCalGroups, false}, 7, warp % tile_warps, tile_warps, xb, acc);
      acc_bits += __float_as_uint(mma_chains_sum(acc).x);
    }
  } else {
    const int units = int(stage_bytes / 16);
    for (int r = 0; r < rounds; ++r) {  // each round: one tile, all warps
      asm volatile("" ::: "memory");
      for (int u = threadIdx.x; u < units; u += 32 * kConsumers) use_unit(reinterpret_cast<const uint4*>(smem)[u], work, acc_bits);
      __syncwarp();
    }
  }
  if (acc_bits == 0x9e3779b9u && lane == 0) sink[warp] = acc_bits;
}

struct PhaseShape {
  const char* name;
  double bytes;
  int tile_bytes;
  bool routed;  // the producer waits for the router's barrier
};

struct ModelShape {
  const char* name;
  int layers;
  int act_floats;  // the hidden size: the row each phase reads
  std::vector<PhaseShape> phases;
};

int64_t round_tiles(double bytes, int tile) { return bytes <= 0 ? 0 : int64_t((bytes + tile - 1) / tile); }

// Median µs of 20 timed calls of run(stream) after 3 warm-ups.
template <typename Run>
double median_us(cudaStream_t stream, Run&& run) {
  for (int i = 0; i < 3; ++i) run(stream);
  BENCH_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> times;
  cudaEvent_t a, b;
  BENCH_CHECK(cudaEventCreate(&a));
  BENCH_CHECK(cudaEventCreate(&b));
  for (int r = 0; r < 20; ++r) {
    BENCH_CHECK(cudaEventRecord(a, stream));
    run(stream);
    BENCH_CHECK(cudaEventRecord(b, stream));
    BENCH_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    BENCH_CHECK(cudaEventElapsedTime(&ms, a, b));
    times.push_back(ms);
  }
  BENCH_CHECK(cudaGetLastError());
  BENCH_CHECK(cudaEventDestroy(a));
  BENCH_CHECK(cudaEventDestroy(b));
  std::sort(times.begin(), times.end());
  return 1000.0 * times[times.size() / 2];
}

void calibrate_consumers(int sms) {
  const int64_t stage_bytes = int4_stream_stage_bytes(kCalK, kCalGroups, false);
  uint8_t* src = nullptr;
  uint32_t* sink = nullptr;
  BENCH_CHECK(cudaMalloc(&src, stage_bytes));
  BENCH_CHECK(cudaMalloc(&sink, 64));
  kernel_bench::fill_bytes_kernel<<<64, 256>>>(src, stage_bytes, 5u, 0u, 256u);
  const size_t smem = size_t(stage_bytes + 2 * (kCalK + 16));
  const int rounds = 2000;
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("\nconsumers on a staged %lld-byte INT4 tile (16 x %lld, group 128), no DRAM: ns a tile an SM\n",
              (long long)stage_bytes, (long long)kCalK);
  const double int4_tiles = double(rounds) * int4_stream_batch(kCalK, kConsumers);
  const double us_int4 = median_us(stream, [&](cudaStream_t s) {
    consume_calibration_kernel<true><<<sms, 32 * kConsumers, smem, s>>>(src, rounds, 0, sink);
  });
  std::printf("%-44s %8.1f\n", "int4_stage_dot (the streamed GEMV's products)", 1000.0 * us_int4 / int4_tiles);
  for (int work : {0, 8, 24}) {
    const double us = median_us(stream, [&](cudaStream_t s) {
      consume_calibration_kernel<false><<<sms, 32 * kConsumers, smem, s>>>(src, rounds, work, sink);
    });
    char name[64];
    std::snprintf(name, sizeof name, "synthetic, work %d", work);
    std::printf("%-44s %8.1f\n", name, 1000.0 * us / rounds);
  }
  BENCH_CHECK(cudaStreamDestroy(stream));
  BENCH_CHECK(cudaFree(src));
  BENCH_CHECK(cudaFree(sink));
}

void run_model(const ModelShape& m, int sms, int optin, int work, double copy_tbs, bool layers_only) {
  std::vector<PhaseShape> layer = m.phases;
  double layer_bytes = 0;
  int max_tile = 0;
  for (const auto& p : layer) {
    layer_bytes += double(round_tiles(p.bytes, p.tile_bytes)) * p.tile_bytes;
    max_tile = std::max(max_tile, p.tile_bytes);
  }
  if (max_tile > kRegMaxTileBytes) {
    std::fprintf(stderr, "persistent_bench: tiles above %d bytes do not fit the register variants\n", kRegMaxTileBytes);
    std::exit(2);
  }
  const double step_bytes = layer_bytes * m.layers;
  uint8_t* buf = nullptr;
  BENCH_CHECK(cudaMalloc(&buf, size_t(step_bytes)));
  kernel_bench::fill_bytes_kernel<<<1024, 256>>>(buf, int64_t(step_bytes), 11u, 0u, 256u);
  // Phase tables: the real one, and one with no bytes (the chain alone).
  std::vector<Phase> table, empty_table;
  const uint8_t* at = buf;
  int router = -1;
  for (int l = 0; l < m.layers; ++l)
    for (const auto& p : layer) {
      const int idx = int(table.size());
      const int64_t tiles = round_tiles(p.bytes, p.tile_bytes);
      table.push_back({at, tiles, p.tile_bytes, p.routed ? router : -1});
      empty_table.push_back({at, 0, p.tile_bytes, -1});
      if (std::string(p.name) == "router") router = idx;
      at += tiles * p.tile_bytes;
    }
  const int n = int(table.size());
  Phase *d_table = nullptr, *d_empty = nullptr;
  BENCH_CHECK(cudaMalloc(&d_table, n * sizeof(Phase)));
  BENCH_CHECK(cudaMalloc(&d_empty, n * sizeof(Phase)));
  BENCH_CHECK(cudaMemcpy(d_table, table.data(), n * sizeof(Phase), cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaMemcpy(d_empty, empty_table.data(), n * sizeof(Phase), cudaMemcpyHostToDevice));
  // The phase counters and, after them, the epoch (step_sync.cuh): zeroed once a variant,
  // never between its launches.
  uint32_t* counters = nullptr;
  BENCH_CHECK(cudaMalloc(&counters, (n + 1) * 4));
  uint32_t* epoch = counters + n;
  float* act = kernel_bench::device_floats(int64_t(n) * m.act_floats, 0.5f);
  uint32_t* sink = nullptr;
  BENCH_CHECK(cudaMalloc(&sink, 4));
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  BENCH_CHECK(cudaDeviceSynchronize());
  std::printf("\n%s: %d layers of %zu phases, %.1f MB a layer, %.3f GB a step (no lm_head); at %.2f TB/s: %.2f us a "
              "layer\n",
              m.name, m.layers, layer.size(), layer_bytes / 1e6, step_bytes / 1e9, copy_tbs,
              layer_bytes / copy_tbs / 1e6);
  std::printf("%-44s %10s %10s %9s\n", "variant", "us a step", "us a layer", "TB/s");
  auto report = [&](const char* name, double us, double bytes) {
    std::printf("%-44s %10.1f %10.2f %9.2f\n", name, us, us / m.layers, bytes > 0 ? bytes / us / 1e6 : 0.0);
  };
  int n_phases = n, act_floats = m.act_floats, w = work;
  // A whole step as one cooperative launch, timed launched directly and as a captured graph (as
  // nibble would replay it). The graph row says whether a cooperative launch can be captured.
  auto time_persistent = [&](const char* name, const void* kernel, int threads, size_t smem, void** args,
                             double bytes) {
    BENCH_CHECK(cudaMemset(counters, 0, (n + 1) * 4));
    report(name, median_us(stream, [&](cudaStream_t s) {
             BENCH_CHECK(cudaLaunchCooperativeKernel(kernel, dim3(sms), dim3(threads), args, smem, s));
           }),
           bytes);
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeCooperative;
    attr.val.cooperative = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(sms);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = &attr;
    config.numAttrs = 1;
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    cudaError_t err = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
    if (err == cudaSuccess) {
      const cudaError_t launched = cudaLaunchKernelExC(&config, kernel, args);
      err = cudaStreamEndCapture(stream, &graph);
      if (launched != cudaSuccess) err = launched;
    }
    if (err == cudaSuccess) err = cudaGraphInstantiate(&exec, graph, 0);
    if (err == cudaSuccess) err = cudaGraphLaunch(exec, stream);  // a trial replay
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    char graph_name[128];
    std::snprintf(graph_name, sizeof graph_name, "  the same, graph-replayed");
    if (err != cudaSuccess) {
      std::printf("%-44s not captured: %s\n", graph_name, cudaGetErrorString(err));
      (void)cudaGetLastError();
    } else {
      report(graph_name, median_us(stream, [&](cudaStream_t s) { BENCH_CHECK(cudaGraphLaunch(exec, s)); }), bytes);
    }
    if (exec) BENCH_CHECK(cudaGraphExecDestroy(exec));
    if (graph) BENCH_CHECK(cudaGraphDestroy(graph));
  };
  auto time_ring = [&](const char* name, const Phase* d_phases, int mode, int stages, double bytes) {
    const size_t smem = size_t(stages) * max_tile + 16 * size_t(stages);
    if (int(smem) > optin) return;
    BENCH_CHECK(cudaFuncSetAttribute(step_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    int stage_bytes = max_tile;
    void* args[] = {(void*)&d_phases, &n_phases, &stages,     &stage_bytes, &mode, &w,
                    &counters,        &epoch,    &act,        &act_floats,  &sink};
    time_persistent(name, (const void*)step_kernel, 32 * (kConsumers + 1), smem, args, bytes);
  };
  // One PDL launch a phase, captured as a graph (as nibble replays its decode steps).
  auto time_graph = [&](const char* name, auto&& launch_phase, double bytes = -1) {
    cudaGraph_t graph;
    BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int p = 0; p < n; ++p) {
      cudaLaunchAttribute attr{};
      attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr.val.programmaticStreamSerializationAllowed = 1;
      cudaLaunchConfig_t config{};
      config.gridDim = dim3(sms);
      config.stream = stream;
      config.attrs = &attr;
      config.numAttrs = 1;
      const float* in = p > 0 ? act + int64_t(p - 1) * m.act_floats : nullptr;
      launch_phase(config, p, in, act + int64_t(p) * m.act_floats);
    }
    BENCH_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec;
    BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    const double us = median_us(stream, [&](cudaStream_t s) { BENCH_CHECK(cudaGraphLaunch(exec, s)); });
    report(name, us, bytes < 0 ? step_bytes : bytes);
    BENCH_CHECK(cudaGraphExecDestroy(exec));
    BENCH_CHECK(cudaGraphDestroy(graph));
    return us;
  };
  char name[96];
  std::printf("-- weights in registers (as the shipped kernels)\n");
  auto layers_on = [&](const std::vector<Phase>& phases) {
    return [&](cudaLaunchConfig_t& config, int p, const float* in, float* out) {
      config.blockDim = dim3(32 * kConsumers);
      BENCH_CHECK(cudaLaunchKernelEx(&config, phase_registers_kernel, phases[size_t(p)], p, work, in, out,
                                     m.act_floats, sink));
    };
  };
  const double layers_us = time_graph("layers: one PDL launch a phase", layers_on(table));
  std::vector<Phase> none = table;  // every launch, no bytes: the chain alone
  for (auto& ph : none) ph.tiles = 0;
  // The same launches, each block taking more than half an SM's shared memory, so that a launch's
  // blocks cannot sit beside its predecessor's (as when two kernels' registers do not fit one SM
  // together): what the next phase's early loads are worth.
  {
    const int pad = optin / 2 + 1024;
    BENCH_CHECK(cudaFuncSetAttribute(phase_registers_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, pad));
    auto alone = layers_on(table);
    time_graph("layers, one block an SM (none beside the last)", [&](cudaLaunchConfig_t& config, int p,
                                                                      const float* in, float* out) {
      config.dynamicSmemBytes = size_t(pad);
      alone(config, p, in, out);
    });
    auto alone_none = layers_on(none);
    time_graph("  the same, no bytes", [&](cudaLaunchConfig_t& config, int p, const float* in, float* out) {
      config.dynamicSmemBytes = size_t(pad);
      alone_none(config, p, in, out);
    }, 0);
  }
  // Where the per-kernel design's layer goes, a phase at a time, to set beside `nibble bench
  // --profile`'s table of kernels: every launch as above, but only one phase of each layer has its
  // bytes (the others stage their rows and end). Its time less the chain's (no bytes at all) is
  // what that phase adds; what the phases add together less the whole says how much they overlap.
  {
    const double chain_us = time_graph("layers, no bytes (the launches' chain)", layers_on(none));
    double added = 0;
    for (size_t i = 0; i < layer.size(); ++i) {
      std::vector<Phase> one = none;
      for (size_t p = i; p < one.size(); p += layer.size()) one[p].tiles = table[p].tiles;
      std::snprintf(name, sizeof name, "layers, %s's bytes only", layer[i].name);
      const double us = time_graph(name, layers_on(one), layer[i].bytes * m.layers);
      std::printf("%-44s %10s %10.2f\n", "  what it adds", "", (us - chain_us) / m.layers);
      added += us - chain_us;
    }
    std::printf("%-44s %10s %10.2f  (the phases' sum less the whole: %.2f a layer overlapped)\n",
                "chain + every phase's addition", "", (chain_us + added) / m.layers,
                (chain_us + added - layers_us) / m.layers);
  }
  if (!layers_only) {
    const Phase* d_phases = d_table;
    void* args[] = {(void*)&d_phases, &n_phases, &w, &counters, &epoch, &act, &act_floats, &sink};
    time_persistent("persistent: one launch, grid barriers", (const void*)step_registers_kernel, 32 * kConsumers, 0,
                    args, step_bytes);
  }
  if (!layers_only) std::printf("-- weights through a shared-memory ring (a producer warp an SM)\n");
  for (int stages : {2, 4}) {
    if (layers_only) break;
    const size_t smem = size_t(stages) * max_tile + 16 * size_t(stages);
    BENCH_CHECK(cudaFuncSetAttribute(phase_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    std::snprintf(name, sizeof name, "layers: one PDL launch a phase, %d stages", stages);
    time_graph(name, [&](cudaLaunchConfig_t& config, int p, const float* in, float* out) {
      config.blockDim = dim3(32 * (kConsumers + 1));
      config.dynamicSmemBytes = smem;
      BENCH_CHECK(cudaLaunchKernelEx(&config, phase_kernel, table[size_t(p)], p, stages, max_tile, work, in, out,
                                     m.act_floats, sink));
    });
  }
  for (int stages : {2, 4, 8, 13})
    for (int mode : {kAhead, kPdl, kSerial}) {
      if (layers_only) break;
      static const char* modes[] = {"ahead", "pdl", "serial"};
      std::snprintf(name, sizeof name, "persistent, %s, %d stages of %d KB", modes[mode], stages, max_tile / 1024);
      time_ring(name, d_table, mode, stages, step_bytes);
    }
  if (!layers_only) time_ring("persistent, barriers and rows only (no bytes)", d_empty, kAhead, 2, 0);
  BENCH_CHECK(cudaStreamDestroy(stream));
  BENCH_CHECK(cudaFree(buf));
  BENCH_CHECK(cudaFree(d_table));
  BENCH_CHECK(cudaFree(d_empty));
  BENCH_CHECK(cudaFree(counters));
  BENCH_CHECK(cudaFree(act));
  BENCH_CHECK(cudaFree(sink));
}

double copy_bandwidth_tbs() {
  const size_t bytes = size_t(1) << 30;
  void *a = nullptr, *b = nullptr;
  BENCH_CHECK(cudaMalloc(&a, bytes));
  BENCH_CHECK(cudaMalloc(&b, bytes));
  BENCH_CHECK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  for (int i = 0; i < 10; ++i) BENCH_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
  cudaEventRecord(e1);
  BENCH_CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  BENCH_CHECK(cudaFree(a));
  BENCH_CHECK(cudaFree(b));
  return 2.0 * bytes * 10 / (ms * 1e-3) / 1e12;  // read + write
}

}  // namespace

int main(int argc, char** argv) {
  const int work = argc > 1 ? std::atoi(argv[1]) : 8;
  const bool layers_only = argc > 2 && std::string(argv[2]) == "--layers-only";
  int sms = 0, optin = 0, coop = 0, major = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major < 9) {
    std::fprintf(stderr, "persistent_bench: needs sm_90 or newer (bulk copies, PDL)\n");
    return 2;
  }
  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  BENCH_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  BENCH_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, 0));
  if (!coop) {
    std::fprintf(stderr, "persistent_bench: the device cannot launch cooperative kernels\n");
    return 2;
  }
  const double tbs = copy_bandwidth_tbs();
  std::printf("%d SMs, copy bandwidth %.2f TB/s, consumer work %d a 16-byte unit\n", sms, tbs, work);
  calibrate_consumers(sms);
  // INT4 group 128 with f16 scales and zero points: 0.5 + 4/128 bytes a weight.
  const double int4 = 0.5 + 4.0 / 128, mxfp4 = 0.5 + 1.0 / 32;
  for (double depth : {0.0, 8192.0}) {
    // Qwen3-30B-A3B: hidden 2048, q 32 x 128, kv 4 x 128 (f16 K and V), 128 experts top 8 of 768.
    const double kv = depth * 4 * 128 * 2 * 2;
    ModelShape qwen3{depth == 0 ? "Qwen3-30B-A3B INT4, depth 0" : "Qwen3-30B-A3B INT4, depth 8192", 48, 2048,
                     {{"qkv", 5120 * 2048 * int4, 16384, false},
                      {"attention", kv, 16384, false},
                      {"o", 2048 * 4096 * int4, 16384, false},
                      {"router", 128 * 2048 * 2, 16384, false},
                      {"gate_up", 8 * 1536 * 2048 * int4, 16384, true},
                      {"down", 8 * 2048 * 768 * int4, 16384, true}}};
    run_model(qwen3, sms, optin, work, tbs, layers_only);
  }
  // gpt-oss-20b with every layer in MXFP4: hidden 2880, q 64 x 64, kv 8 x 64, 32 experts top 4.
  ModelShape oss{"gpt-oss-20b all-MXFP4, depth 0", 24, 2880,
                 {{"qkv", 5120 * 2880 * mxfp4, 16384, false},
                  {"attention", 0, 16384, false},
                  {"o", 2880 * 4096 * mxfp4, 16384, false},
                  {"router", 32 * 2880 * 2, 16384, false},
                  {"gate_up", 4 * 5760 * 2880 * mxfp4, 16384, true},
                  {"down", 4 * 2880 * 2880 * mxfp4, 16384, true}}};
  run_model(oss, sms, optin, work, tbs, layers_only);
  return 0;
}
