// The one logging facility of optimus (abseil 20220623 has no absl/log).
// Writes one line per event to stderr: time, level, component, message, and
// optional key=value fields, so logs can be grepped and parsed. Thread-safe.
#ifndef OPTIMUS_COMMON_LOGGING_H_
#define OPTIMUS_COMMON_LOGGING_H_

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace optimus {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Lines below this level are dropped. Default kInfo. Binaries set it from a flag.
void SetMinLogLevel(LogLevel level);
LogLevel MinLogLevel();

// Writes `level component: message` with a timestamp, atomically per line.
void LogLine(LogLevel level, absl::string_view component, absl::string_view message);

}  // namespace optimus

// OPTIMUS_LOG(Info, "shard", "registered id=", id);  (Debug, Info, Warning, Error)
#define OPTIMUS_LOG(level, component, ...)                                    \
  do {                                                                        \
    if (::optimus::LogLevel::k##level >= ::optimus::MinLogLevel()) {          \
      ::optimus::LogLine(::optimus::LogLevel::k##level, component,            \
                         ::absl::StrCat(__VA_ARGS__));                        \
    }                                                                         \
  } while (0)

#endif  // OPTIMUS_COMMON_LOGGING_H_
