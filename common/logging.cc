#include "common/logging.h"

#include <atomic>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <sys/time.h>
#include <unistd.h>

namespace optimus {
namespace {
std::atomic<int> g_min_level{static_cast<int>(LogLevel::kInfo)};
std::mutex g_write_mu;

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
LogLevel MinLogLevel() { return static_cast<LogLevel>(g_min_level.load()); }

void LogLine(LogLevel level, absl::string_view component, absl::string_view message) {
  struct timeval tv;
  gettimeofday(&tv, nullptr);
  struct tm tm_utc;
  gmtime_r(&tv.tv_sec, &tm_utc);
  char when[32];
  std::strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S", &tm_utc);
  std::lock_guard<std::mutex> lock(g_write_mu);
  std::fprintf(stderr, "%s.%06ldZ %s pid=%d %.*s: %.*s\n", when,
               static_cast<long>(tv.tv_usec), LevelName(level),
               static_cast<int>(getpid()), static_cast<int>(component.size()),
               component.data(), static_cast<int>(message.size()), message.data());
}

}  // namespace optimus
