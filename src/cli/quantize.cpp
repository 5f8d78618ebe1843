// nibble quantize: BF16/F16/F32 checkpoint in, GPTQ-format INT4 checkpoint out (round to nearest
// with per-group scales; see format/quant/int4_gptq.h). Every Linear inside the decoder layers is
// quantized except the MoE router (`mlp.gate`), which GPTQ/AutoRound releases keep in 16 bits too;
// embeddings, norms and lm_head are copied unchanged. Tokenizer and other files are copied, and
// config.json gains a quantization_config that nibble, vLLM and transformers read.
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include "cli/commands.h"
#include "core/status.h"
#include "format/hf_config.h"
#include "format/quant/int4_gptq.h"
#include "format/safetensors.h"
#include "format/safetensors_writer.h"
#include "model/model.h"
#include "model/weights.h"

namespace nibble::cli {
namespace {
namespace fs = std::filesystem;

struct QuantizeOptions {
  std::string in_dir, out_dir, format = "int4";
  int group_size = 128;
  bool asym = false;
};

// A Linear weight [n, k] (or expert e's slice of a fused [E, n, k] tensor) as f32.
std::vector<float> to_f32(const TensorInfo& t, int64_t offset_rows, int64_t n, int64_t k) {
  const LinearWeight view = view_dense(t.name, t, offset_rows, n, k);
  std::vector<float> out(static_cast<size_t>(n * k));
  for (int64_t r = 0; r < n; ++r) view.row_f32(r, out.data() + r * k);
  return out;
}

void add_quantized(SafetensorsWriter& w, const std::string& prefix, const TensorInfo& t,
                   int64_t offset_rows, int64_t n, int64_t k, const QuantizeOptions& o) {
  NIBBLE_CHECK(n % 8 == 0 && k % 8 == 0, "{}: '{}' is [{}, {}]; GPTQ packing needs both dimensions "
               "to be multiples of 8", t.file, prefix, n, k);
  const int64_t g = o.group_size > 0 ? o.group_size : k;
  const int64_t n_groups = (k + g - 1) / g;
  // The four tensors of a module come from one quantization; compute it once, on first use.
  auto packed = std::make_shared<std::optional<GptqPacked>>();
  auto get = [=, &t]() -> const GptqPacked& {
    if (!*packed) *packed = quantize_gptq_int4(to_f32(t, offset_rows, n, k).data(), n, k,
                                               o.group_size, !o.asym);
    return **packed;
  };
  // Writer order is by name: .g_idx < .qweight < .qzeros < .scales; the last one frees the result.
  w.add(prefix + ".g_idx", DType::I32, {k}, [=] { return to_bytes(get().g_idx); });
  w.add(prefix + ".qweight", DType::I32, {k / 8, n}, [=] { return to_bytes(get().qweight); });
  w.add(prefix + ".qzeros", DType::I32, {n_groups, n / 8}, [=] { return to_bytes(get().qzeros); });
  w.add(prefix + ".scales", DType::F16, {n_groups, n}, [=] {
    auto bytes = to_bytes(get().scales);
    packed->reset();
    return bytes;
  });
}

void quantize(const QuantizeOptions& o) {
  NIBBLE_CHECK(o.format == "int4", "--format {}: only int4 is supported", o.format);
  NIBBLE_CHECK(o.group_size == -1 || (o.group_size >= 8 && o.group_size % 8 == 0),
               "--group-size {}: must be -1 or a positive multiple of 8 (32, 64, 128)", o.group_size);
  NIBBLE_CHECK(fs::weakly_canonical(o.in_dir) != fs::weakly_canonical(o.out_dir),
               "--out must differ from --model");
  const std::string config_path = (fs::path(o.in_dir) / "config.json").string();
  nlohmann::json config_json = read_json_file(config_path);
  ModelConfig config = parse_model_config(config_json, config_path);
  NIBBLE_CHECK(config.quant.method.empty(), "{}: the model is already quantized ({})", config_path,
               config.quant.method);
  auto types = supported_model_types();
  NIBBLE_CHECK(std::find(types.begin(), types.end(), config.model_type) != types.end(),
               "{}: model_type '{}' is not supported", config_path, config.model_type);
  Checkpoint ckpt = Checkpoint::open(o.in_dir);

  const std::regex linear(R"(^model\.layers\.\d+\..*_proj\.weight$)");
  const std::regex fused(R"(^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$)");
  SafetensorsWriter writer;
  int64_t n_quantized = 0;
  for (auto& [name, t] : ckpt.tensors()) {
    std::smatch m;
    if (std::regex_match(name, linear) && t->shape.size() == 2) {
      add_quantized(writer, name.substr(0, name.size() - 7), *t, 0, t->shape[0], t->shape[1], o);
      ++n_quantized;
    } else if (std::regex_match(name, m, fused) && t->shape.size() == 3) {
      // transformers 5 layout: split back into the per-expert modules checkpoints hold.
      const int64_t E = t->shape[0], rows = t->shape[1], k = t->shape[2];
      for (int64_t e = 0; e < E; ++e) {
        const std::string p = m[1].str() + "." + std::to_string(e);
        if (m[2] == "gate_up_proj") {
          add_quantized(writer, p + ".gate_proj", *t, e * rows, rows / 2, k, o);
          add_quantized(writer, p + ".up_proj", *t, e * rows + rows / 2, rows / 2, k, o);
        } else {
          add_quantized(writer, p + ".down_proj", *t, e * rows, rows, k, o);
        }
        n_quantized += m[2] == "gate_up_proj" ? 2 : 1;
      }
    } else {
      const TensorInfo* src = t;
      writer.add(name, t->dtype, t->shape,
                 [src] { return std::vector<uint8_t>(src->data, src->data + src->nbytes); });
    }
  }
  NIBBLE_CHECK(n_quantized > 0, "{}: found no Linear weights to quantize", o.in_dir);

  fs::create_directories(o.out_dir);
  for (auto& entry : fs::directory_iterator(o.in_dir)) {
    const std::string file = entry.path().filename();
    if (!entry.is_regular_file() || entry.path().extension() == ".safetensors" ||
        file == "model.safetensors.index.json" || file == "config.json")
      continue;
    fs::copy_file(entry.path(), fs::path(o.out_dir) / file, fs::copy_options::overwrite_existing);
  }
  config_json["quantization_config"] = {
      {"quant_method", "gptq"}, {"bits", 4}, {"group_size", o.group_size}, {"sym", !o.asym},
      {"desc_act", false}, {"checkpoint_format", "gptq"}, {"static_groups", false},
      {"true_sequential", true}, {"lm_head", false},
      // GPTQModel's per-module override: "-:" means "leave unquantized".
      {"dynamic", {{R"(-:model\.layers\.\d+\.mlp\.gate$)", nlohmann::json::object()}}},
      {"meta", {{"quantizer", {std::string("nibble:") + NIBBLE_VERSION}}, {"method", "rtn"}}}};
  std::ofstream(fs::path(o.out_dir) / "config.json") << config_json.dump(2) << '\n';
  writer.write((fs::path(o.out_dir) / "model.safetensors").string(),
               {{"format", "pt"}, {"quantizer", std::string("nibble ") + NIBBLE_VERSION}});
  fmt::print(stderr, "quantized {} Linear modules to INT4 (group {}, {}) -> {}\n", n_quantized,
             o.group_size, o.asym ? "asym" : "sym", o.out_dir);
}

}  // namespace

void add_quantize_command(CLI::App& app) {
  auto o = std::make_shared<QuantizeOptions>();
  CLI::App* cmd = app.add_subcommand("quantize", "Write a GPTQ-format INT4 copy of a checkpoint");
  cmd->add_option("-m,--model", o->in_dir, "Input model directory (BF16/F16/F32)")->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("-o,--out", o->out_dir, "Output directory")->required();
  cmd->add_option("--format", o->format, "int4");
  cmd->add_option("--group-size", o->group_size, "Quantization group size along K (-1: per channel)");
  cmd->add_flag("--asym", o->asym, "Asymmetric (per-group zero points) instead of symmetric");
  cmd->callback([o] { quantize(*o); });
}

}  // namespace nibble::cli
