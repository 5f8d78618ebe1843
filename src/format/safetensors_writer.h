// Writes a safetensors file tensor by tensor: the header is computed from the declared shapes
// first, then each tensor's bytes are produced and written in turn, so a checkpoint larger than
// memory can be converted with one tensor in memory at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace nibble {

class SafetensorsWriter {
 public:
  using Producer = std::function<std::vector<uint8_t>()>;
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape, Producer produce);
  // Throws Error if a producer returns the wrong number of bytes or the file cannot be written.
  void write(const std::string& path, const std::map<std::string, std::string>& metadata) const;

 private:
  struct Entry {
    DType dtype;
    std::vector<int64_t> shape;
    Producer produce;
  };
  std::map<std::string, Entry> entries_;  // sorted by name: deterministic output
};

template <typename T>
std::vector<uint8_t> to_bytes(const std::vector<T>& v) {
  const auto* p = reinterpret_cast<const uint8_t*>(v.data());
  return std::vector<uint8_t>(p, p + v.size() * sizeof(T));
}

}  // namespace nibble
