#include "common/logging.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/error.hpp"

namespace mori::log {
namespace {

Level InitialLevel() {
  for (const char* var : {"MORI_IO_LOG_LEVEL", "MORI_GLOBAL_LOG_LEVEL"}) {
    const char* v = std::getenv(var);
    if (v && *v) {
      try {
        return ParseLevel(v);
      } catch (const Error&) {
        std::fprintf(stderr, "[mori] ignoring %s=%s (unknown level)\n", var, v);
      }
    }
  }
  return Level::Warning;
}

std::atomic<int>& CurrentLevel() {
  static std::atomic<int> level{static_cast<int>(InitialLevel())};
  return level;
}

const char* LevelName(Level l) {
  switch (l) {
    case Level::Trace: return "TRACE";
    case Level::Debug: return "DEBUG";
    case Level::Info: return "INFO";
    case Level::Warning: return "WARN";
    case Level::Error: return "ERROR";
    default: return "";
  }
}

}  // namespace

LogStream& LogStream::operator<<(Hex h) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(h.value));
  text_ += buf;
  return *this;
}

LogStream& LogStream::operator<<(double d) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", d);
  text_ += buf;
  return *this;
}

LogStream& LogStream::operator<<(const void* p) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%p", p);
  text_ += buf;
  return *this;
}

Level ParseLevel(const std::string& name) {
  std::string n(name);
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  if (n == "trace") return Level::Trace;
  if (n == "debug") return Level::Debug;
  if (n == "info") return Level::Info;
  if (n == "warn" || n == "warning") return Level::Warning;
  if (n == "error" || n == "critical") return Level::Error;
  if (n == "off") return Level::Off;
  throw InvalidArgument("log level '" + name +
                        "' is not one of trace, debug, info, warning, error, critical, off");
}

void SetLevel(Level level) { CurrentLevel().store(static_cast<int>(level)); }
Level GetLevel() { return static_cast<Level>(CurrentLevel().load()); }
bool Enabled(Level level) { return static_cast<int>(level) >= CurrentLevel().load(std::memory_order_relaxed); }

void Write(Level level, const char* file, int line, const std::string& message) {
  static std::mutex mu;
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
                 std::chrono::system_clock::now().time_since_epoch())
                 .count();
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(stderr, "[mori %s %lld.%03lld pid=%d %s:%d] %s\n", LevelName(level),
               static_cast<long long>(now / 1000), static_cast<long long>(now % 1000), getpid(),
               base, line, message.c_str());
  std::fflush(stderr);
}

}  // namespace mori::log
