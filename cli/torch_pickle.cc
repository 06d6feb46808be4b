#include "cli/torch_pickle.h"

#include <cstring>
#include <exception>
#include <fstream>
#include <map>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "caffe2/serialize/inline_container.h"

namespace optimus {
namespace {

using Ptr = std::shared_ptr<PyValue>;
using Kind = PyValue::Kind;

// Deeper nesting than any state dict has is refused (it would only cost
// stack).
constexpr int kMaxDepth = 64;

Ptr Make(Kind kind) {
  auto v = std::make_shared<PyValue>();
  v->kind = kind;
  return v;
}

// The element types of torch's storage classes, as torch.save names them
// in a tensor's persistent id.
std::optional<torch::ScalarType> StorageDtype(absl::string_view global) {
  static const std::pair<const char*, torch::ScalarType> kTypes[] = {
      {"torch.FloatStorage", torch::kFloat32},   {"torch.DoubleStorage", torch::kFloat64},
      {"torch.HalfStorage", torch::kFloat16},    {"torch.BFloat16Storage", torch::kBFloat16},
      {"torch.LongStorage", torch::kInt64},      {"torch.IntStorage", torch::kInt32},
      {"torch.ShortStorage", torch::kInt16},     {"torch.CharStorage", torch::kInt8},
      {"torch.ByteStorage", torch::kUInt8},      {"torch.BoolStorage", torch::kBool},
  };
  for (const auto& [name, type] : kTypes) {
    if (global == name) return type;
  }
  return std::nullopt;
}

// A pickle virtual machine for the opcodes of protocols 2 to 4 that
// describe plain data; objects are only built for the globals torch.save
// uses (see Reduce).
class Unpickler {
 public:
  Unpickler(absl::string_view pickle, caffe2::serialize::PyTorchStreamReader* zip,
            std::string path)
      : data_(pickle), zip_(zip), path_(std::move(path)) {}

  absl::StatusOr<Ptr> Run();

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": pickle byte ", op_pos_, ": ", what));
  }
  bool Read(size_t n, const char** out) {
    if (data_.size() - pos_ < n) return false;
    *out = data_.data() + pos_;
    pos_ += n;
    return true;
  }
  template <typename T>
  bool ReadLE(T* out) {
    const char* p;
    if (!Read(sizeof(T), &p)) return false;
    std::memcpy(out, p, sizeof(T));  // Little-endian, as every host we run on.
    return true;
  }
  bool ReadLine(std::string* out) {
    const size_t end = data_.find('\n', pos_);
    if (end == absl::string_view::npos) return false;
    *out = std::string(data_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return true;
  }
  absl::StatusOr<Ptr> Pop() {
    if (stack_.size() <= (marks_.empty() ? 0 : marks_.back())) return Error("stack underflow");
    Ptr v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  absl::StatusOr<Ptr> Top(Kind want) {
    if (stack_.empty() || stack_.back()->kind != want) {
      return Error(absl::StrCat("expected a ", PyKindName(want), " on the stack"));
    }
    return stack_.back();
  }
  // The items pushed since the last MARK, which goes.
  absl::StatusOr<std::vector<Ptr>> PopMark() {
    if (marks_.empty()) return Error("no MARK");
    const size_t k = marks_.back();
    marks_.pop_back();
    std::vector<Ptr> items(std::make_move_iterator(stack_.begin() + k),
                           std::make_move_iterator(stack_.end()));
    stack_.resize(k);
    return items;
  }
  absl::Status Memo(uint64_t index) {
    if (stack_.empty()) return Error("memo of an empty stack");
    memo_[index] = stack_.back();
    return absl::OkStatus();
  }
  absl::Status Get(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) return Error(absl::StrCat("memo ", index, " was never set"));
    stack_.push_back(it->second);
    return absl::OkStatus();
  }
  absl::Status PushString(uint64_t n) {
    const char* p;
    if (!Read(n, &p)) return Error("truncated string");
    Ptr v = Make(Kind::kString);
    v->string.assign(p, n);
    stack_.push_back(std::move(v));
    return absl::OkStatus();
  }
  absl::Status PushInt(int64_t x) {
    Ptr v = Make(Kind::kInt);
    v->integer = x;
    stack_.push_back(std::move(v));
    return absl::OkStatus();
  }
  absl::Status PushLong(uint64_t n) {
    if (n > 8) return Error("integer wider than 64 bits");
    const char* p;
    if (!Read(n, &p)) return Error("truncated integer");
    uint64_t u = 0;
    for (uint64_t i = 0; i < n; ++i) u |= uint64_t{static_cast<unsigned char>(p[i])} << (8 * i);
    // Two's complement of n bytes: sign-extend.
    if (n > 0 && n < 8 && (p[n - 1] & 0x80)) u |= ~uint64_t{0} << (8 * n);
    return PushInt(static_cast<int64_t>(u));
  }
  absl::Status Step(unsigned char op);
  absl::StatusOr<Ptr> Reduce(const PyValue& callable, const PyValue& args);
  absl::StatusOr<Ptr> LoadStorage(const PyValue& pid);
  absl::StatusOr<Ptr> RebuildTensor(const PyValue& args);
  // Refuses a result that still holds a global or a storage, or nests
  // deeper than kMaxDepth.
  absl::Status CheckPlain(const PyValue& v, int depth,
                          std::unordered_set<const PyValue*>* seen) const;

  absl::string_view data_;
  caffe2::serialize::PyTorchStreamReader* zip_;  // Not owned.
  std::string path_;
  size_t pos_ = 0;
  size_t op_pos_ = 0;  // Of the opcode being run, for errors.
  std::vector<Ptr> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Ptr> memo_;
  std::map<std::string, Ptr> storages_;  // By record key: views share one.
  bool stopped_ = false;
};

absl::StatusOr<Ptr> Unpickler::Run() {
  while (!stopped_) {
    op_pos_ = pos_;
    const char* op;
    if (!Read(1, &op)) return Error("ends without STOP");
    if (absl::Status s = Step(static_cast<unsigned char>(*op)); !s.ok()) return s;
  }
  if (stack_.size() != 1) return Error("STOP with more than one value left");
  std::unordered_set<const PyValue*> seen;
  if (absl::Status s = CheckPlain(*stack_[0], 0, &seen); !s.ok()) return s;
  return stack_[0];
}

absl::Status Unpickler::Step(unsigned char op) {
  switch (op) {
    case 0x80: {  // PROTO
      const char* p;
      if (!Read(1, &p)) return Error("truncated PROTO");
      if (static_cast<unsigned char>(*p) > 5) return Error("unknown pickle protocol");
      return absl::OkStatus();
    }
    case 0x95: {  // FRAME: a length hint.
      uint64_t n;
      return ReadLE(&n) ? absl::OkStatus() : Error("truncated FRAME");
    }
    case '.':  // STOP
      stopped_ = true;
      return absl::OkStatus();
    case '(':  // MARK
      marks_.push_back(stack_.size());
      return absl::OkStatus();
    case '0':  // POP
      return Pop().status();
    case '1':  // POP_MARK
      return PopMark().status();
    case '2':  // DUP
      if (stack_.empty()) return Error("DUP of an empty stack");
      stack_.push_back(stack_.back());
      return absl::OkStatus();
    case 'N':
      stack_.push_back(Make(Kind::kNone));
      return absl::OkStatus();
    case 0x88:  // NEWTRUE
    case 0x89: {  // NEWFALSE
      Ptr v = Make(Kind::kBool);
      v->boolean = op == 0x88;
      stack_.push_back(std::move(v));
      return absl::OkStatus();
    }
    case 'J': {  // BININT
      int32_t x;
      return ReadLE(&x) ? PushInt(x) : Error("truncated BININT");
    }
    case 'K': {  // BININT1
      uint8_t x;
      return ReadLE(&x) ? PushInt(x) : Error("truncated BININT1");
    }
    case 'M': {  // BININT2
      uint16_t x;
      return ReadLE(&x) ? PushInt(x) : Error("truncated BININT2");
    }
    case 0x8a: {  // LONG1
      uint8_t n;
      return ReadLE(&n) ? PushLong(n) : Error("truncated LONG1");
    }
    case 0x8b: {  // LONG4
      uint32_t n;
      return ReadLE(&n) ? PushLong(n) : Error("truncated LONG4");
    }
    case 'G': {  // BINFLOAT: big-endian.
      const char* p;
      if (!Read(8, &p)) return Error("truncated BINFLOAT");
      uint64_t u = 0;
      for (int i = 0; i < 8; ++i) u = (u << 8) | static_cast<unsigned char>(p[i]);
      Ptr v = Make(Kind::kFloat);
      std::memcpy(&v->number, &u, 8);
      stack_.push_back(std::move(v));
      return absl::OkStatus();
    }
    case 'X': {  // BINUNICODE
      uint32_t n;
      return ReadLE(&n) ? PushString(n) : Error("truncated BINUNICODE");
    }
    case 0x8c: {  // SHORT_BINUNICODE
      uint8_t n;
      return ReadLE(&n) ? PushString(n) : Error("truncated SHORT_BINUNICODE");
    }
    case 0x8d: {  // BINUNICODE8
      uint64_t n;
      return ReadLE(&n) ? PushString(n) : Error("truncated BINUNICODE8");
    }
    case ')':
      stack_.push_back(Make(Kind::kTuple));
      return absl::OkStatus();
    case 't':
    case 'l': {  // TUPLE, LIST
      absl::StatusOr<std::vector<Ptr>> items = PopMark();
      if (!items.ok()) return items.status();
      Ptr v = Make(op == 't' ? Kind::kTuple : Kind::kList);
      v->items = *std::move(items);
      stack_.push_back(std::move(v));
      return absl::OkStatus();
    }
    case 0x85:
    case 0x86:
    case 0x87: {  // TUPLE1, TUPLE2, TUPLE3
      const size_t n = op - 0x84;
      if (stack_.size() < n + (marks_.empty() ? 0 : marks_.back())) return Error("stack underflow");
      Ptr v = Make(Kind::kTuple);
      v->items.assign(stack_.end() - n, stack_.end());
      stack_.resize(stack_.size() - n);
      stack_.push_back(std::move(v));
      return absl::OkStatus();
    }
    case ']':
      stack_.push_back(Make(Kind::kList));
      return absl::OkStatus();
    case 'a': {  // APPEND
      absl::StatusOr<Ptr> v = Pop();
      if (!v.ok()) return v.status();
      absl::StatusOr<Ptr> list = Top(Kind::kList);
      if (!list.ok()) return list.status();
      (*list)->items.push_back(*std::move(v));
      return absl::OkStatus();
    }
    case 'e': {  // APPENDS
      absl::StatusOr<std::vector<Ptr>> items = PopMark();
      if (!items.ok()) return items.status();
      absl::StatusOr<Ptr> list = Top(Kind::kList);
      if (!list.ok()) return list.status();
      for (Ptr& v : *items) (*list)->items.push_back(std::move(v));
      return absl::OkStatus();
    }
    case '}':
      stack_.push_back(Make(Kind::kDict));
      return absl::OkStatus();
    case 's': {  // SETITEM
      absl::StatusOr<Ptr> v = Pop();
      if (!v.ok()) return v.status();
      absl::StatusOr<Ptr> k = Pop();
      if (!k.ok()) return k.status();
      absl::StatusOr<Ptr> dict = Top(Kind::kDict);
      if (!dict.ok()) return dict.status();
      (*dict)->entries.emplace_back(*std::move(k), *std::move(v));
      return absl::OkStatus();
    }
    case 'u':
    case 'd': {  // SETITEMS, DICT
      absl::StatusOr<std::vector<Ptr>> items = PopMark();
      if (!items.ok()) return items.status();
      if (items->size() % 2 != 0) return Error("odd number of dict items");
      Ptr dict;
      if (op == 'd') {
        dict = Make(Kind::kDict);
        stack_.push_back(dict);
      } else {
        absl::StatusOr<Ptr> top = Top(Kind::kDict);
        if (!top.ok()) return top.status();
        dict = *top;
      }
      for (size_t i = 0; i < items->size(); i += 2) {
        dict->entries.emplace_back(std::move((*items)[i]), std::move((*items)[i + 1]));
      }
      return absl::OkStatus();
    }
    case 'q': {  // BINPUT
      uint8_t i;
      return ReadLE(&i) ? Memo(i) : Error("truncated BINPUT");
    }
    case 'r': {  // LONG_BINPUT
      uint32_t i;
      return ReadLE(&i) ? Memo(i) : Error("truncated LONG_BINPUT");
    }
    case 0x94:  // MEMOIZE
      return Memo(memo_.size());
    case 'h': {  // BINGET
      uint8_t i;
      return ReadLE(&i) ? Get(i) : Error("truncated BINGET");
    }
    case 'j': {  // LONG_BINGET
      uint32_t i;
      return ReadLE(&i) ? Get(i) : Error("truncated LONG_BINGET");
    }
    case 'c': {  // GLOBAL "module\nname\n"
      std::string module, name;
      if (!ReadLine(&module) || !ReadLine(&name)) return Error("truncated GLOBAL");
      Ptr v = Make(Kind::kGlobal);
      v->string = absl::StrCat(module, ".", name);
      stack_.push_back(std::move(v));
      return absl::OkStatus();
    }
    case 0x93: {  // STACK_GLOBAL
      absl::StatusOr<Ptr> name = Pop();
      if (!name.ok()) return name.status();
      absl::StatusOr<Ptr> module = Pop();
      if (!module.ok()) return module.status();
      if ((*module)->kind != Kind::kString || (*name)->kind != Kind::kString) {
        return Error("STACK_GLOBAL of non-strings");
      }
      Ptr v = Make(Kind::kGlobal);
      v->string = absl::StrCat((*module)->string, ".", (*name)->string);
      stack_.push_back(std::move(v));
      return absl::OkStatus();
    }
    case 'R':
    case 0x81: {  // REDUCE, NEWOBJ
      absl::StatusOr<Ptr> args = Pop();
      if (!args.ok()) return args.status();
      absl::StatusOr<Ptr> callable = Pop();
      if (!callable.ok()) return callable.status();
      absl::StatusOr<Ptr> v = Reduce(**callable, **args);
      if (!v.ok()) return v.status();
      stack_.push_back(*std::move(v));
      return absl::OkStatus();
    }
    case 'b': {  // BUILD: only the empty state (no attributes) is understood.
      absl::StatusOr<Ptr> state = Pop();
      if (!state.ok()) return state.status();
      const PyValue& s = **state;
      const bool empty = s.kind == Kind::kNone || (s.kind == Kind::kDict && s.entries.empty());
      if (!empty || stack_.empty()) return Error("BUILD with attributes is not supported");
      return absl::OkStatus();
    }
    case 'Q': {  // BINPERSID: a tensor's storage.
      absl::StatusOr<Ptr> pid = Pop();
      if (!pid.ok()) return pid.status();
      absl::StatusOr<Ptr> storage = LoadStorage(**pid);
      if (!storage.ok()) return storage.status();
      stack_.push_back(*std::move(storage));
      return absl::OkStatus();
    }
    default:
      return Error(absl::StrCat("unsupported pickle opcode 0x", absl::Hex(op)));
  }
}

// ('storage', torch.<Type>Storage, key, location, numel): the record
// data/<key> of the zip holds its elements.
absl::StatusOr<Ptr> Unpickler::LoadStorage(const PyValue& pid) {
  if (pid.kind != Kind::kTuple || pid.items.size() != 5 ||
      pid.items[0]->kind != Kind::kString || pid.items[0]->string != "storage" ||
      pid.items[1]->kind != Kind::kGlobal || pid.items[2]->kind != Kind::kString ||
      pid.items[4]->kind != Kind::kInt || pid.items[4]->integer < 0) {
    return Error("a persistent id that is not a tensor storage");
  }
  const std::optional<torch::ScalarType> dtype = StorageDtype(pid.items[1]->string);
  if (!dtype.has_value()) {
    return Error(absl::StrCat("unsupported storage type ", pid.items[1]->string));
  }
  const std::string& key = pid.items[2]->string;
  if (auto it = storages_.find(key); it != storages_.end()) return it->second;
  const std::string record = absl::StrCat("data/", key);
  if (!zip_->hasRecord(record)) return Error(absl::StrCat("no record ", record, " in the zip"));
  at::DataPtr bytes;
  size_t size_bytes = 0;
  std::tie(bytes, size_bytes) = zip_->getRecord(record);
  const int64_t numel = pid.items[4]->integer;
  const size_t elem_bytes = c10::elementSize(*dtype);
  if (static_cast<uint64_t>(numel) > size_bytes / elem_bytes) {
    return Error(absl::StrCat("record ", record, " holds ", size_bytes, " bytes, fewer than ",
                              numel, " elements"));
  }
  Ptr v = Make(Kind::kStorage);
  v->tensor = torch::from_blob(bytes.get(), {numel}, torch::TensorOptions().dtype(*dtype)).clone();
  storages_[key] = v;
  return v;
}

// torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride,
// requires_grad, backward_hooks[, metadata]).
absl::StatusOr<Ptr> Unpickler::RebuildTensor(const PyValue& args) {
  if (args.kind != Kind::kTuple || args.items.size() < 4 ||
      args.items[0]->kind != Kind::kStorage || args.items[1]->kind != Kind::kInt ||
      args.items[2]->kind != Kind::kTuple || args.items[3]->kind != Kind::kTuple ||
      args.items[2]->items.size() != args.items[3]->items.size()) {
    return Error("malformed _rebuild_tensor_v2 arguments");
  }
  const torch::Tensor& storage = args.items[0]->tensor;
  const int64_t offset = args.items[1]->integer;
  std::vector<int64_t> sizes, strides;
  bool empty = false;
  int64_t last = offset;  // Largest element index the view touches.
  for (size_t d = 0; d < args.items[2]->items.size(); ++d) {
    const PyValue& size = *args.items[2]->items[d];
    const PyValue& stride = *args.items[3]->items[d];
    if (size.kind != Kind::kInt || stride.kind != Kind::kInt || size.integer < 0 ||
        stride.integer < 0 || size.integer > (int64_t{1} << 48) ||
        stride.integer > (int64_t{1} << 48)) {
      return Error("malformed tensor size or stride");
    }
    sizes.push_back(size.integer);
    strides.push_back(stride.integer);
    if (size.integer == 0) empty = true;
    else last += (size.integer - 1) * stride.integer;
  }
  if (offset < 0 || (!empty && last >= storage.numel())) {
    return Error(absl::StrCat("tensor view past the end of its storage (", storage.numel(),
                              " elements)"));
  }
  Ptr v = Make(Kind::kTensor);
  v->tensor = empty ? torch::empty(sizes, storage.options())
                    : storage.as_strided(sizes, strides, offset).contiguous();
  return v;
}

// The callables torch.save's files use; anything else is refused.
absl::StatusOr<Ptr> Unpickler::Reduce(const PyValue& callable, const PyValue& args) {
  if (callable.kind != Kind::kGlobal || args.kind != Kind::kTuple) {
    return Error("REDUCE of something that is not a global with a tuple");
  }
  const std::string& f = callable.string;
  if (f == "torch._utils._rebuild_tensor_v2") return RebuildTensor(args);
  if (f == "torch._utils._rebuild_parameter" || f == "torch._utils._rebuild_parameter_with_state") {
    // An nn.Parameter: its data.
    if (args.items.empty() || args.items[0]->kind != Kind::kTensor) {
      return Error("malformed _rebuild_parameter arguments");
    }
    return args.items[0];
  }
  if (f == "collections.OrderedDict") {
    Ptr dict = Make(Kind::kDict);
    if (args.items.empty()) return dict;
    if (args.items.size() == 1 && args.items[0]->kind == Kind::kList) {
      for (const Ptr& pair : args.items[0]->items) {
        if (pair->kind != Kind::kTuple || pair->items.size() != 2) {
          return Error("OrderedDict of something else than pairs");
        }
        dict->entries.emplace_back(pair->items[0], pair->items[1]);
      }
      return dict;
    }
    return Error("malformed OrderedDict arguments");
  }
  // libtorch's writer (torch::pickle_save) tags containers with their type.
  if (f == "torch.jit._pickle.restore_type_tag" && args.items.size() == 2) return args.items[0];
  if ((f == "torch.jit._pickle.build_intlist" || f == "torch.jit._pickle.build_doublelist" ||
       f == "torch.jit._pickle.build_boollist" || f == "torch.jit._pickle.build_tensorlist" ||
       f == "torch.jit._pickle.build_genericlist") &&
      args.items.size() == 1 && args.items[0]->kind == Kind::kList) {
    return args.items[0];
  }
  return Error(absl::StrCat("unsupported Python object ", f));
}

absl::Status Unpickler::CheckPlain(const PyValue& v, int depth,
                                   std::unordered_set<const PyValue*>* seen) const {
  if (depth > kMaxDepth) return Error(absl::StrCat("nested deeper than ", kMaxDepth));
  if (!seen->insert(&v).second) return absl::OkStatus();  // Shared (memo): checked once.
  if (v.kind == Kind::kGlobal) return Error(absl::StrCat("holds the Python object ", v.string));
  if (v.kind == Kind::kStorage) return Error("holds a bare storage");
  for (const Ptr& item : v.items) {
    if (absl::Status s = CheckPlain(*item, depth + 1, seen); !s.ok()) return s;
  }
  for (const auto& [k, val] : v.entries) {
    if (absl::Status s = CheckPlain(*k, depth + 1, seen); !s.ok()) return s;
    if (absl::Status s = CheckPlain(*val, depth + 1, seen); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<Ptr> Load(const std::string& path) {
  {
    std::ifstream in(path, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
    char magic[2] = {};
    in.read(magic, 2);
    if (in.gcount() != 2 || magic[0] != 'P' || magic[1] != 'K') {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": not a torch.save zip file (the legacy format of "
                "_use_new_zipfile_serialization=False is not read)"));
    }
  }
  caffe2::serialize::PyTorchStreamReader zip(path);
  if (!zip.hasRecord("data.pkl")) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": a zip without data.pkl"));
  }
  at::DataPtr pickle;
  size_t size_bytes = 0;
  std::tie(pickle, size_bytes) = zip.getRecord("data.pkl");
  Unpickler u(absl::string_view(static_cast<const char*>(pickle.get()), size_bytes), &zip, path);
  return u.Run();
}

}  // namespace

const char* PyKindName(PyValue::Kind kind) {
  switch (kind) {
    case Kind::kNone: return "None";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kString: return "str";
    case Kind::kTuple: return "tuple";
    case Kind::kList: return "list";
    case Kind::kDict: return "dict";
    case Kind::kTensor: return "tensor";
    case Kind::kGlobal: return "global";
    case Kind::kStorage: return "storage";
  }
  return "unknown";
}

const PyValue* PyValue::Find(absl::string_view key) const {
  for (const auto& [k, v] : entries) {
    if (k->kind == Kind::kString && k->string == key) return v.get();
  }
  return nullptr;
}

const PyValue* PyValue::Find(int64_t key) const {
  for (const auto& [k, v] : entries) {
    if (k->kind == Kind::kInt && k->integer == key) return v.get();
  }
  return nullptr;
}

absl::StatusOr<std::shared_ptr<PyValue>> LoadTorchFile(const std::string& path) {
  // libtorch's zip reader reports by exception: converted here, at its only edge.
  try {
    return Load(path);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot read as torch.save: ", e.what()));
  }
}

}  // namespace optimus
