// safetensors header validation: every way a header can lie is an Error naming file and tensor.
#include "format/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/status.h"
#include "format/safetensors_writer.h"

namespace nibble {
namespace {

std::vector<uint8_t> file_bytes(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> out(8);
  uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  out.insert(out.end(), header.begin(), header.end());
  for (size_t i = 0; i < data_bytes; ++i) out.push_back(uint8_t(i * 7 + 1));
  return out;
}

std::string parse_error(const std::string& header, size_t data_bytes) {
  auto bytes = file_bytes(header, data_bytes);
  try {
    SafetensorsFile::parse(bytes, "x.safetensors");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Safetensors, ParsesValidHeader) {
  auto bytes = file_bytes(R"({"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,3],)"
                          R"("data_offsets":[0,12]},"b":{"dtype":"F32","shape":[],"data_offsets":[12,16]}})", 16);
  auto f = SafetensorsFile::parse(bytes, "x.safetensors");
  ASSERT_EQ(f->tensors().size(), 2u);
  const TensorInfo& a = f->tensors().at("a");
  EXPECT_EQ(a.dtype, DType::BF16);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.nbytes, 12u);
  EXPECT_EQ(f->tensors().at("b").numel(), 1);
  EXPECT_EQ(f->metadata().at("format"), "pt");
}

TEST(Safetensors, RejectsBadHeaders) {
  EXPECT_NE(parse_error("{", 0).find("not valid JSON"), std::string::npos);
  EXPECT_NE(parse_error("[]", 0).find("not a JSON object"), std::string::npos);
  EXPECT_NE(parse_error(R"({"a":{"dtype":"Q9","shape":[1],"data_offsets":[0,1]}})", 1).find("unknown dtype"),
            std::string::npos);
  // Offsets past the end of the data: a truncated file.
  std::string e = parse_error(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8);
  EXPECT_NE(e.find("'a'"), std::string::npos) << e;
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  // Size that disagrees with dtype and shape.
  e = parse_error(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", 16);
  EXPECT_NE(e.find("needs 12 bytes"), std::string::npos) << e;
  // Overlapping tensors.
  e = parse_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12);
  EXPECT_NE(e.find("overlap"), std::string::npos) << e;
  EXPECT_NE(parse_error(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4).find("shape"),
            std::string::npos);
  EXPECT_NE(parse_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", 4).find("reversed"),
            std::string::npos);
  EXPECT_NE(parse_error(R"({"a":{"dtype":"F32","shape":[1]}})", 4).find("data_offsets"), std::string::npos);
  // Header length beyond the file.
  std::vector<uint8_t> short_file = {200, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
  EXPECT_THROW(SafetensorsFile::parse(short_file, "x"), Error);
  EXPECT_THROW(SafetensorsFile::parse(std::vector<uint8_t>{1, 2, 3}, "x"), Error);
}

TEST(Safetensors, WriterRoundTripsAndCheckpointOpensDirectories) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / "nibble_st_test";
  fs::remove_all(dir);
  fs::create_directories(dir);
  SafetensorsWriter w;
  std::vector<float> values = {1.5f, -2.f, 3.25f};
  w.add("w", DType::F32, {3}, [&] { return to_bytes(values); });
  w.add("i", DType::I32, {2}, [] { return to_bytes(std::vector<int32_t>{7, -9}); });
  w.write((dir / "model.safetensors").string(), {{"format", "pt"}});
  Checkpoint ckpt = Checkpoint::open(dir.string());
  const TensorInfo& t = ckpt.get("w");
  ASSERT_EQ(t.dtype, DType::F32);
  float back[3];
  std::memcpy(back, t.data, 12);
  EXPECT_EQ(back[2], 3.25f);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data) % 8, 0u);
  try {
    ckpt.get("missing");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'missing'"), std::string::npos);
  }
  // A sharded index naming a tensor that its shard lacks.
  fs::rename(dir / "model.safetensors", dir / "model-00001-of-00001.safetensors");
  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"weight_map":{"w":"model-00001-of-00001.safetensors","gone":"model-00001-of-00001.safetensors"}})";
  try {
    Checkpoint::open(dir.string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'gone'"), std::string::npos) << e.what();
  }
  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"weight_map":{"w":"model-00002-of-00002.safetensors"}})";
  EXPECT_THROW(Checkpoint::open(dir.string()), Error);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace nibble
