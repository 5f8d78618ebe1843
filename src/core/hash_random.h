// A counter-based random number: uniform in [0, 1) from (seed, index), the same on the host and on
// the GPU (dummy weights, fill_random), so backends can be compared on identical random data.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define NIBBLE_HOST_DEVICE __host__ __device__
#else
#define NIBBLE_HOST_DEVICE
#endif

namespace nibble {

NIBBLE_HOST_DEVICE inline float hash_uniform(uint64_t seed, uint64_t index) {
  uint64_t z = seed + (index + 1) * 0x9e3779b97f4a7c15ull;  // splitmix64 of the counter
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return float(z >> 40) * (1.f / 16777216.f);
}

}  // namespace nibble
