// Helpers shared by the tests that compare nibble with transformers' outputs stored in
// safetensors fixtures (written by tools/make_fixtures.py).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "format/safetensors.h"

namespace nibble::test {

template <typename T>
std::vector<T> read_tensor(const SafetensorsFile& f, const std::string& name) {
  const TensorInfo& t = f.tensors().at(name);
  std::vector<T> out(t.nbytes / sizeof(T));
  std::memcpy(out.data(), t.data, t.nbytes);
  return out;
}

// max |a - b| / max |b|: one figure for a whole set of logits, infinite if ours are not finite.
inline double normalized_error(const float* a, const float* b, size_t n) {
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    max_diff = std::max(max_diff, double(std::fabs(a[i] - b[i])));
    max_ref = std::max(max_ref, double(std::fabs(b[i])));
  }
  return max_diff / max_ref;
}

}  // namespace nibble::test
