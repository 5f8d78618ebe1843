#include "format/safetensors_writer.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/status.h"

namespace nibble {

void SafetensorsWriter::add(const std::string& name, DType dtype, std::vector<int64_t> shape,
                            Producer produce) {
  NIBBLE_ASSERT(!entries_.count(name));
  entries_.emplace(name, Entry{dtype, std::move(shape), std::move(produce)});
}

void SafetensorsWriter::write(const std::string& path,
                              const std::map<std::string, std::string>& metadata) const {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::vector<uint64_t> sizes;
  for (auto& [name, e] : entries_) {
    uint64_t bytes = dtype_size_bytes(e.dtype);
    for (int64_t d : e.shape) bytes *= uint64_t(d);
    header[name] = {{"dtype", std::string(dtype_name(e.dtype))}, {"shape", e.shape},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    sizes.push_back(bytes);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data section 8-byte aligned
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  NIBBLE_CHECK(out.good(), "{}: cannot create", path);
  uint64_t n = text.size();
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(n >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), std::streamsize(text.size()));
  size_t i = 0;
  for (auto& [name, e] : entries_) {
    std::vector<uint8_t> bytes = e.produce();
    NIBBLE_ASSERT(bytes.size() == sizes[i]);
    out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    ++i;
  }
  out.close();
  NIBBLE_CHECK(!out.fail(), "{}: write failed (disk full?)", path);
}

}  // namespace nibble
