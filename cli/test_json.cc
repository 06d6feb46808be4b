#include "cli/test_json.h"

#include <cctype>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace optimus {
namespace {

class Parser {
 public:
  explicit Parser(absl::string_view text) : text_(text) {}

  absl::StatusOr<JsonValue> ParseDocument() {
    JsonValue v;
    if (!Value(v)) return Error();
    SkipSpace();
    if (pos_ != text_.size()) return Error();
    return v;
  }

 private:
  absl::Status Error() const {
    return absl::InvalidArgumentError(absl::StrCat("invalid JSON at byte ", pos_));
  }
  void SkipSpace() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  bool Consume(absl::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }
  bool Value(JsonValue& v) {
    if (++depth_ > 64) return false;
    SkipSpace();
    bool ok = false;
    if (pos_ >= text_.size()) {
      ok = false;
    } else if (text_[pos_] == '{') {
      ok = Object(v);
    } else if (text_[pos_] == '[') {
      ok = Array(v);
    } else if (text_[pos_] == '"') {
      v.type = JsonValue::Type::kString;
      ok = String(v.string);
    } else if (Consume("true")) {
      v.type = JsonValue::Type::kBool;
      v.boolean = ok = true;
    } else if (Consume("false")) {
      v.type = JsonValue::Type::kBool;
      ok = true;
    } else if (Consume("null")) {
      ok = true;
    } else {
      ok = Number(v);
    }
    --depth_;
    return ok;
  }
  bool Object(JsonValue& v) {
    v.type = JsonValue::Type::kObject;
    ++pos_;
    SkipSpace();
    if (Consume("}")) return true;
    while (true) {
      SkipSpace();
      std::string key;
      if (pos_ >= text_.size() || text_[pos_] != '"' || !String(key)) return false;
      SkipSpace();
      if (!Consume(":")) return false;
      JsonValue member;
      if (!Value(member)) return false;
      if (!v.object.emplace(key, std::move(member)).second) return false;  // Duplicate key.
      SkipSpace();
      if (Consume("}")) return true;
      if (!Consume(",")) return false;
    }
  }
  bool Array(JsonValue& v) {
    v.type = JsonValue::Type::kArray;
    ++pos_;
    SkipSpace();
    if (Consume("]")) return true;
    while (true) {
      JsonValue element;
      if (!Value(element)) return false;
      v.array.push_back(std::move(element));
      SkipSpace();
      if (Consume("]")) return true;
      if (!Consume(",")) return false;
    }
  }
  bool String(std::string& out) {
    ++pos_;  // Opening quote.
    while (pos_ < text_.size()) {
      const char c = text_[pos_++];
      if (c == '"') return true;
      if (static_cast<unsigned char>(c) < 0x20) return false;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= text_.size()) return false;
      const char e = text_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t code = 0;
          if (pos_ + 4 > text_.size()) return false;
          for (int i = 0; i < 4; ++i) {
            const char h = text_[pos_++];
            if (!std::isxdigit(static_cast<unsigned char>(h))) return false;
            code = code * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(h))
                                                         ? h - '0'
                                                         : (std::tolower(h) - 'a' + 10));
          }
          if (code >= 0x80) return false;  // Tests only need ASCII escapes.
          out += static_cast<char>(code);
          break;
        }
        default: return false;
      }
    }
    return false;
  }
  bool Number(JsonValue& v) {
    const size_t start = pos_;
    if (pos_ < text_.size() && text_[pos_] == '-') ++pos_;
    size_t digits = 0;
    while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
      ++pos_;
      ++digits;
    }
    if (digits == 0) return false;
    if (digits > 1 && text_[start + (text_[start] == '-' ? 1 : 0)] == '0') return false;
    if (pos_ < text_.size() && text_[pos_] == '.') {
      ++pos_;
      size_t frac = 0;
      while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
        ++pos_;
        ++frac;
      }
      if (frac == 0) return false;
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      size_t exp = 0;
      while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
        ++pos_;
        ++exp;
      }
      if (exp == 0) return false;
    }
    v.type = JsonValue::Type::kNumber;
    v.number_text = std::string(text_.substr(start, pos_ - start));
    return true;
  }

  absl::string_view text_;
  size_t pos_ = 0;
  int depth_ = 0;
};

}  // namespace

bool JsonValue::IsInteger() const {
  uint64_t unused;
  return type == Type::kNumber && absl::SimpleAtoi(number_text, &unused);
}

uint64_t JsonValue::AsUint() const {
  uint64_t v = 0;
  if (type != Type::kNumber || !absl::SimpleAtoi(number_text, &v)) return 0;
  return v;
}

const JsonValue& JsonValue::operator[](const std::string& key) const {
  static const JsonValue* const kNull = new JsonValue();
  auto it = object.find(key);
  return it == object.end() ? *kNull : it->second;
}

absl::StatusOr<JsonValue> ParseJson(absl::string_view text) { return Parser(text).ParseDocument(); }

}  // namespace optimus
