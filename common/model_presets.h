// Published model architectures as lists of named tensors with their shapes,
// for sizing a deployment (`optimusctl plan --model=...`) and for job specs
// that name a model instead of listing its tensors (`model: llama-7b`).
// Names and shapes follow the Hugging Face checkpoints ([out, in] for linear
// weights). Pure functions over plain values; safe from any thread.
#ifndef OPTIMUS_COMMON_MODEL_PRESETS_H_
#define OPTIMUS_COMMON_MODEL_PRESETS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace optimus {

struct PresetTensor {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t num_elems() const;
};

struct ModelPreset {
  std::string name;         // "llama-70b"
  std::string description;  // "LLaMA-2 70B: 80 layers, hidden 8192, ..."
  std::vector<PresetTensor> tensors;
  uint64_t num_params() const;  // Sum of the tensors' elements.
};

// The presets' names, in the order `--help` lists them:
// gpt2-124m, llama-7b, llama-13b, llama-70b.
const std::vector<std::string>& ModelPresetNames();

// The preset named `name` (case-insensitive). NOT_FOUND naming the known
// presets for any other name.
absl::StatusOr<ModelPreset> FindModelPreset(absl::string_view name);

}  // namespace optimus

#endif  // OPTIMUS_COMMON_MODEL_PRESETS_H_
