#include "common/logging.h"

#include <atomic>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <string>
#include <sys/time.h>
#include <unistd.h>

#include "common/json.h"

namespace optimus {
namespace {
std::atomic<int> g_min_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<int> g_format{static_cast<int>(LogFormat::kText)};
std::mutex g_write_mu;
std::FILE* g_out = nullptr;  // Guarded by g_write_mu; null means stderr.

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "DEBUG";
    case LogLevel::kInfo: return "INFO";
    case LogLevel::kWarning: return "WARN";
    case LogLevel::kError: return "ERROR";
  }
  return "?";
}
}  // namespace

void SetMinLogLevel(LogLevel level) { g_min_level.store(static_cast<int>(level)); }

void SetLogFormat(LogFormat format) { g_format.store(static_cast<int>(format)); }

bool ParseLogFormat(absl::string_view name, LogFormat* format) {
  if (name == "text") {
    *format = LogFormat::kText;
  } else if (name == "json") {
    *format = LogFormat::kJson;
  } else {
    return false;
  }
  return true;
}

void SetLogOutput(std::FILE* out) {
  std::lock_guard<std::mutex> lock(g_write_mu);
  g_out = out;
}
LogLevel MinLogLevel() { return static_cast<LogLevel>(g_min_level.load()); }

void LogLine(LogLevel level, absl::string_view component, absl::string_view message) {
  struct timeval tv;
  gettimeofday(&tv, nullptr);
  struct tm tm_utc;
  gmtime_r(&tv.tv_sec, &tm_utc);
  char when[32];
  std::strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S", &tm_utc);
  std::lock_guard<std::mutex> lock(g_write_mu);
  std::FILE* out = g_out != nullptr ? g_out : stderr;
  if (static_cast<LogFormat>(g_format.load()) == LogFormat::kJson) {
    Json doc;
    doc["ts"] = absl::StrCat(when, ".", absl::Dec(tv.tv_usec, absl::kZeroPad6), "Z");
    doc["level"] = LevelName(level);
    doc["pid"] = static_cast<int>(getpid());
    doc["component"] = std::string(component);
    doc["msg"] = std::string(message);
    const std::string line = JsonDump(doc) + "\n";
    std::fwrite(line.data(), 1, line.size(), out);
    std::fflush(out);
    return;
  }
  std::fprintf(out, "%s.%06ldZ %s pid=%d %.*s: %.*s\n", when,
               static_cast<long>(tv.tv_usec), LevelName(level),
               static_cast<int>(getpid()), static_cast<int>(component.size()),
               component.data(), static_cast<int>(message.size()), message.data());
}

}  // namespace optimus
