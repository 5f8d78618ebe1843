// Reads safetensors files and Hugging Face checkpoint directories (one file, or shards listed in
// model.safetensors.index.json). Files are memory-mapped; tensors are views into the mapping, so
// opening a 60 GB checkpoint costs only its headers. Every header is validated before use: a
// header that lies (offsets past the end, overlapping tensors, a size that disagrees with dtype
// and shape) is an Error naming the file and the tensor, never an out-of-bounds read.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace nibble {

std::string shape_str(const std::vector<int64_t>& shape);  // "[128, 2048]"

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // into the file's mapping
  size_t nbytes = 0;
  std::string file;  // path of the file that holds it, for error messages

  int64_t numel() const;
  std::string shape_str() const { return nibble::shape_str(shape); }
};

// One parsed safetensors file. `parse` validates a header held in memory (used by the fuzzer and
// by `open`, which maps the file first).
class SafetensorsFile {
 public:
  static std::unique_ptr<SafetensorsFile> open(const std::string& path);
  static std::unique_ptr<SafetensorsFile> parse(std::span<const uint8_t> bytes, const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint directory by name.
class Checkpoint {
 public:
  static Checkpoint open(const std::string& dir);

  const TensorInfo* find(const std::string& name) const;
  const TensorInfo& get(const std::string& name) const;  // Error when absent
  bool has(const std::string& name) const { return find(name) != nullptr; }
  const std::map<std::string, const TensorInfo*>& tensors() const { return index_; }
  const std::string& dir() const { return dir_; }
  std::vector<std::string> files() const;

 private:
  std::string dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorInfo*> index_;
};

}  // namespace nibble
