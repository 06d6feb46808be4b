// Reading files that Python's torch.save writes (the zip format, pickle
// protocol 2; what libtorch's own writer, torch::pickle_save, writes too)
// into a tree of plain values: None, bool, int, float, str, tuple, list,
// dict and CPU tensors. Debian's libtorch 1.13 cannot do it: its
// torch::pickle_load stops at SETITEM and APPEND, the opcodes Python emits
// for a dict or list of one element. Only the Python objects that torch.save
// writes for these values are understood (tensors, parameters, storages,
// OrderedDict); any other is refused, never run.
// Stateless and thread-safe; a returned tree belongs to the caller.
#ifndef OPTIMUS_CLI_TORCH_PICKLE_H_
#define OPTIMUS_CLI_TORCH_PICKLE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "torch/torch.h"

namespace optimus {

struct PyValue {
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kTuple,
    kList,
    kDict,
    kTensor,
    // Only while reading (a callable or a tensor's storage); a file whose
    // result holds one is refused.
    kGlobal,
    kStorage,
  };
  Kind kind = Kind::kNone;
  bool boolean = false;
  int64_t integer = 0;
  double number = 0;
  std::string string;                // kString; kGlobal: "module.name".
  std::vector<std::shared_ptr<PyValue>> items;  // kTuple, kList.
  // kDict, in the file's order (Python dicts keep insertion order).
  std::vector<std::pair<std::shared_ptr<PyValue>, std::shared_ptr<PyValue>>> entries;
  // kTensor: contiguous, on the CPU, of the dtype it was saved with.
  // kStorage: the storage's elements, one dimension.
  torch::Tensor tensor;

  // The dict entry whose key is the string `key` (or the int `key`);
  // nullptr when absent or when this is not a dict.
  const PyValue* Find(absl::string_view key) const;
  const PyValue* Find(int64_t key) const;
};

// "None", "bool", "int", "float", "str", "tuple", "list", "dict", "tensor".
const char* PyKindName(PyValue::Kind kind);

// Reads the torch.save file at `path`. NOT_FOUND when it does not exist;
// INVALID_ARGUMENT naming the path when it is not a torch.save zip file
// (the legacy non-zip format included), its pickle is malformed (with the
// byte offset), or it holds a Python object other than those above.
absl::StatusOr<std::shared_ptr<PyValue>> LoadTorchFile(const std::string& path);

}  // namespace optimus

#endif  // OPTIMUS_CLI_TORCH_PICKLE_H_
