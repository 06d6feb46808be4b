#include "common/model_presets.h"

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace optimus {
namespace {

// GPT-2 (Radford et al. 2019), the 124M configuration: learned position
// embeddings, pre-norm blocks with biases, the output layer tied to the token
// embedding (so it adds no tensor). Conv1D weights are [in, out] as in the
// published checkpoint.
ModelPreset Gpt2Small() {
  constexpr int64_t kVocab = 50257, kContext = 1024, kHidden = 768, kLayers = 12;
  ModelPreset m;
  m.name = "gpt2-124m";
  m.description = "GPT-2 124M: 12 layers, hidden 768, 12 heads, vocab 50257, context 1024, "
                  "tied embeddings";
  m.tensors.push_back({"transformer.wte.weight", {kVocab, kHidden}});
  m.tensors.push_back({"transformer.wpe.weight", {kContext, kHidden}});
  for (int64_t l = 0; l < kLayers; ++l) {
    const std::string p = absl::StrCat("transformer.h.", l, ".");
    m.tensors.push_back({p + "ln_1.weight", {kHidden}});
    m.tensors.push_back({p + "ln_1.bias", {kHidden}});
    m.tensors.push_back({p + "attn.c_attn.weight", {kHidden, 3 * kHidden}});
    m.tensors.push_back({p + "attn.c_attn.bias", {3 * kHidden}});
    m.tensors.push_back({p + "attn.c_proj.weight", {kHidden, kHidden}});
    m.tensors.push_back({p + "attn.c_proj.bias", {kHidden}});
    m.tensors.push_back({p + "ln_2.weight", {kHidden}});
    m.tensors.push_back({p + "ln_2.bias", {kHidden}});
    m.tensors.push_back({p + "mlp.c_fc.weight", {kHidden, 4 * kHidden}});
    m.tensors.push_back({p + "mlp.c_fc.bias", {4 * kHidden}});
    m.tensors.push_back({p + "mlp.c_proj.weight", {4 * kHidden, kHidden}});
    m.tensors.push_back({p + "mlp.c_proj.bias", {kHidden}});
  }
  m.tensors.push_back({"transformer.ln_f.weight", {kHidden}});
  m.tensors.push_back({"transformer.ln_f.bias", {kHidden}});
  return m;
}

// LLaMA-2 (Touvron et al. 2023): no biases, RMSNorm weights, SwiGLU MLP,
// untied output layer, vocab 32000; grouped-query attention where
// kv_heads < heads (70B: 8 KV heads).
struct LlamaArch {
  const char* name;
  const char* label;
  int64_t hidden, layers, ffn, heads, kv_heads;
};

ModelPreset Llama(const LlamaArch& a) {
  constexpr int64_t kVocab = 32000;
  const int64_t kv_dim = a.hidden / a.heads * a.kv_heads;
  ModelPreset m;
  m.name = a.name;
  m.description = absl::StrCat(a.label, ": ", a.layers, " layers, hidden ", a.hidden, ", ",
                               a.heads, " heads (", a.kv_heads, " KV), MLP ", a.ffn,
                               ", vocab 32000");
  m.tensors.push_back({"model.embed_tokens.weight", {kVocab, a.hidden}});
  for (int64_t l = 0; l < a.layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    m.tensors.push_back({p + "self_attn.q_proj.weight", {a.hidden, a.hidden}});
    m.tensors.push_back({p + "self_attn.k_proj.weight", {kv_dim, a.hidden}});
    m.tensors.push_back({p + "self_attn.v_proj.weight", {kv_dim, a.hidden}});
    m.tensors.push_back({p + "self_attn.o_proj.weight", {a.hidden, a.hidden}});
    m.tensors.push_back({p + "mlp.gate_proj.weight", {a.ffn, a.hidden}});
    m.tensors.push_back({p + "mlp.up_proj.weight", {a.ffn, a.hidden}});
    m.tensors.push_back({p + "mlp.down_proj.weight", {a.hidden, a.ffn}});
    m.tensors.push_back({p + "input_layernorm.weight", {a.hidden}});
    m.tensors.push_back({p + "post_attention_layernorm.weight", {a.hidden}});
  }
  m.tensors.push_back({"model.norm.weight", {a.hidden}});
  m.tensors.push_back({"lm_head.weight", {kVocab, a.hidden}});
  return m;
}

constexpr LlamaArch kLlama7b{"llama-7b", "LLaMA-2 7B", 4096, 32, 11008, 32, 32};
constexpr LlamaArch kLlama13b{"llama-13b", "LLaMA-2 13B", 5120, 40, 13824, 40, 40};
constexpr LlamaArch kLlama70b{"llama-70b", "LLaMA-2 70B", 8192, 80, 28672, 64, 8};

}  // namespace

uint64_t PresetTensor::num_elems() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

uint64_t ModelPreset::num_params() const {
  uint64_t n = 0;
  for (const PresetTensor& t : tensors) n += t.num_elems();
  return n;
}

const std::vector<std::string>& ModelPresetNames() {
  static const std::vector<std::string>* names =
      new std::vector<std::string>{"gpt2-124m", "llama-7b", "llama-13b", "llama-70b"};
  return *names;
}

absl::StatusOr<ModelPreset> FindModelPreset(absl::string_view name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "gpt2-124m") return Gpt2Small();
  if (n == kLlama7b.name) return Llama(kLlama7b);
  if (n == kLlama13b.name) return Llama(kLlama13b);
  if (n == kLlama70b.name) return Llama(kLlama70b);
  return absl::NotFoundError(absl::StrCat("unknown model preset '", name, "' (known: ",
                                          absl::StrJoin(ModelPresetNames(), ", "), ")"));
}

}  // namespace optimus
