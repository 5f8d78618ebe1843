// safetensors layout: u64 little-endian header length N, N bytes of JSON
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the data section; offsets are relative to the start of the data section.
#include "format/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/status.h"

namespace nibble {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
// Large enough for any real header (18,867 tensors of Qwen3-30B take ~2 MB), small enough that a
// corrupt length cannot make us parse gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::parse(std::span<const uint8_t> bytes,
                                                        const std::string& path) {
  NIBBLE_CHECK(bytes.size() >= 8, "{}: file is {} bytes, too short for a safetensors header "
               "(truncated?)", path, bytes.size());
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = header_bytes << 8 | bytes[i];
  NIBBLE_CHECK(header_bytes <= kMaxHeaderBytes, "{}: header length {} is implausible (corrupt file?)",
               path, header_bytes);
  NIBBLE_CHECK(8 + header_bytes <= bytes.size(), "{}: header length {} runs past the end of the "
               "file ({} bytes): truncated file", path, header_bytes, bytes.size());
  const uint8_t* data_begin = bytes.data() + 8 + header_bytes;
  const uint64_t data_bytes = bytes.size() - 8 - header_bytes;

  json header;
  try {
    header = json::parse(bytes.begin() + 8, bytes.begin() + 8 + header_bytes);
  } catch (const json::exception& e) {
    fail("{}: header is not valid JSON: {}", path, e.what());
  }
  NIBBLE_CHECK(header.is_object(), "{}: header is not a JSON object", path);

  auto file = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  file->path_ = path;
  std::vector<std::pair<uint64_t, uint64_t>> extents;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      NIBBLE_CHECK(entry.is_object(), "{}: __metadata__ is not an object", path);
      for (auto& [k, v] : entry.items()) {
        NIBBLE_CHECK(v.is_string(), "{}: __metadata__.{} is not a string", path, k);
        file->metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    NIBBLE_CHECK(entry.is_object(), "{}: tensor '{}': entry is not an object", path, name);
    auto dtype_it = entry.find("dtype");
    NIBBLE_CHECK(dtype_it != entry.end() && dtype_it->is_string(),
                 "{}: tensor '{}': missing field 'dtype'", path, name);
    auto dtype = dtype_from_name(dtype_it->get<std::string>());
    NIBBLE_CHECK(dtype.has_value(), "{}: tensor '{}': unknown dtype '{}'", path, name,
                 dtype_it->get<std::string>());
    auto shape_it = entry.find("shape");
    NIBBLE_CHECK(shape_it != entry.end() && shape_it->is_array(),
                 "{}: tensor '{}': missing field 'shape'", path, name);
    TensorInfo info;
    info.name = name;
    info.dtype = *dtype;
    info.file = path;
    uint64_t numel = 1;
    for (auto& d : *shape_it) {
      NIBBLE_CHECK(d.is_number_unsigned(), "{}: tensor '{}': shape entry {} is not a "
                   "non-negative integer", path, name, d.dump());
      uint64_t dim = d.get<uint64_t>();
      NIBBLE_CHECK(dim == 0 || numel <= (1ull << 62) / dim, "{}: tensor '{}': shape too large",
                   path, name);
      numel *= dim;
      info.shape.push_back(int64_t(dim));
    }
    auto off_it = entry.find("data_offsets");
    NIBBLE_CHECK(off_it != entry.end() && off_it->is_array() && off_it->size() == 2 &&
                 (*off_it)[0].is_number_unsigned() && (*off_it)[1].is_number_unsigned(),
                 "{}: tensor '{}': field 'data_offsets' must be [begin, end]", path, name);
    uint64_t begin = (*off_it)[0].get<uint64_t>(), end = (*off_it)[1].get<uint64_t>();
    NIBBLE_CHECK(begin <= end, "{}: tensor '{}': data_offsets [{}, {}] are reversed", path, name,
                 begin, end);
    NIBBLE_CHECK(end <= data_bytes, "{}: tensor '{}': data_offsets [{}, {}] run past the end of "
                 "the data ({} bytes): truncated file", path, name, begin, end, data_bytes);
    uint64_t expect = numel * dtype_size_bytes(info.dtype);
    NIBBLE_CHECK(end - begin == expect, "{}: tensor '{}': {} {} needs {} bytes but data_offsets "
                 "span {}", path, name, dtype_name(info.dtype), info.shape_str(), expect, end - begin);
    info.data = data_begin + begin;
    info.nbytes = end - begin;
    extents.push_back({begin, end});
    file->tensors_.emplace(name, std::move(info));
  }
  std::sort(extents.begin(), extents.end());
  for (size_t i = 1; i < extents.size(); ++i) {
    if (extents[i].first < extents[i - 1].second) {
      std::string a, b;
      for (auto& [n, t] : file->tensors_) {
        uint64_t off = uint64_t(t.data - data_begin);
        if (off == extents[i - 1].first && a.empty()) a = n;
        else if (off == extents[i].first) b = n;
      }
      fail("{}: tensors '{}' and '{}' overlap in the data section", path, a, b);
    }
  }
  return file;
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  NIBBLE_CHECK(fd >= 0, "{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    fail("{}: cannot stat: {}", path, std::strerror(errno));
  }
  size_t size = size_t(st.st_size);
  void* map = nullptr;
  if (size > 0) {
    map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
      ::close(fd);
      fail("{}: cannot mmap: {}", path, std::strerror(errno));
    }
  }
  ::close(fd);
  std::unique_ptr<SafetensorsFile> file;
  try {
    file = parse({static_cast<const uint8_t*>(map), size}, path);
  } catch (...) {
    if (map) munmap(map, size);
    throw;
  }
  file->map_ = map;
  file->map_bytes_ = size;
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) munmap(map_, map_bytes_);
}

Checkpoint Checkpoint::open(const std::string& dir) {
  NIBBLE_CHECK(fs::is_directory(dir), "{}: not a directory", dir);
  Checkpoint ckpt;
  ckpt.dir_ = dir;
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  std::vector<std::string> shard_names;
  std::map<std::string, std::string> weight_map;
  if (fs::exists(index_path)) {
    json index;
    try {
      std::ifstream in(index_path);
      index = json::parse(in);
    } catch (const json::exception& e) {
      fail("{}: not valid JSON: {}", index_path.string(), e.what());
    }
    NIBBLE_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
                 "{}: missing field 'weight_map'", index_path.string());
    for (auto& [name, shard] : index["weight_map"].items()) {
      NIBBLE_CHECK(shard.is_string(), "{}: weight_map['{}'] is not a file name",
                   index_path.string(), name);
      std::string s = shard.get<std::string>();
      NIBBLE_CHECK(s.find('/') == std::string::npos && s != "..",
                   "{}: weight_map['{}'] = '{}' is not a file in this directory",
                   index_path.string(), name, s);
      weight_map[name] = s;
      if (std::find(shard_names.begin(), shard_names.end(), s) == shard_names.end())
        shard_names.push_back(s);
    }
  } else if (fs::exists(fs::path(dir) / "model.safetensors")) {
    shard_names.push_back("model.safetensors");
  } else {
    // Unindexed shards (model-00001-of-00002.safetensors); other .safetensors files in a model
    // directory (adapters, consolidated originals) are not weights of this model.
    for (auto& e : fs::directory_iterator(dir)) {
      const std::string file = e.path().filename();
      if (file.starts_with("model") && file.ends_with(".safetensors")) shard_names.push_back(file);
    }
    std::sort(shard_names.begin(), shard_names.end());
    NIBBLE_CHECK(!shard_names.empty(), "{}: no model.safetensors, model.safetensors.index.json or "
                 "model-*.safetensors file", dir);
  }
  for (auto& shard : shard_names) {
    const std::string path = (fs::path(dir) / shard).string();
    NIBBLE_CHECK(fs::exists(path), "{}: missing (listed in model.safetensors.index.json)", path);
    ckpt.files_.push_back(SafetensorsFile::open(path));
  }
  for (auto& file : ckpt.files_) {
    for (auto& [name, info] : file->tensors()) {
      auto [it, inserted] = ckpt.index_.emplace(name, &info);
      NIBBLE_CHECK(inserted, "{}: tensor '{}' appears in both {} and {}", dir, name, it->second->file,
                   info.file);
    }
  }
  for (auto& [name, shard] : weight_map) {
    auto it = ckpt.index_.find(name);
    NIBBLE_CHECK(it != ckpt.index_.end(), "{}: tensor '{}' is listed in model.safetensors.index.json "
                 "but missing from {}", dir, name, shard);
    NIBBLE_CHECK(fs::path(it->second->file).filename() == shard, "{}: tensor '{}' is listed in {} "
                 "but found in {}", dir, name, shard, it->second->file);
  }
  return ckpt;
}

const TensorInfo* Checkpoint::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}

const TensorInfo& Checkpoint::get(const std::string& name) const {
  const TensorInfo* t = find(name);
  NIBBLE_CHECK(t != nullptr, "{}: tensor '{}' not found in the checkpoint", dir_, name);
  return *t;
}

std::vector<std::string> Checkpoint::files() const {
  std::vector<std::string> out;
  for (auto& f : files_) out.push_back(f->path());
  return out;
}

}  // namespace nibble
