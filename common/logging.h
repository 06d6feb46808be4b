// The one logging facility of optimus (abseil 20220623 has no absl/log).
// Writes one line per event to stderr: time, level, pid, component and
// message, as text or as one JSON object per line (for log collectors such
// as Fluent Bit or Loki on Kubernetes). Thread-safe.
#ifndef OPTIMUS_COMMON_LOGGING_H_
#define OPTIMUS_COMMON_LOGGING_H_

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace optimus {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Lines below this level are dropped. Default kInfo. Binaries set it from a flag.
void SetMinLogLevel(LogLevel level);
LogLevel MinLogLevel();

enum class LogFormat {
  // 2026-11-23T09:00:00.123456Z INFO pid=7 shard: message
  kText = 0,
  // {"ts": "2026-11-23T09:00:00.123456Z", "level": "INFO", "pid": 7,
  //  "component": "shard", "msg": "message"}   (one line)
  kJson = 1,
};

// Default kText. Binaries set it from --log_format.
void SetLogFormat(LogFormat format);
// "text" or "json"; false for anything else (the format is unchanged).
bool ParseLogFormat(absl::string_view name, LogFormat* format);

// Where lines go; borrowed, must stay open. Default stderr. For tests.
void SetLogOutput(std::FILE* out);

// Writes one line (see LogFormat) atomically with respect to other lines.
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
