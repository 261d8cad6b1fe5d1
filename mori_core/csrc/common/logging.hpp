// Minimal leveled logging to stderr.
//
// Level comes from MORI_IO_LOG_LEVEL, else MORI_GLOBAL_LOG_LEVEL, else
// "warning"; Python can change it with mori_core.io.set_log_level().
//
// Messages are built with LogStream, not std::ostream: some toolchains (seen
// on our GPU image) link a private copy of libstdc++ into the extension, and
// formatting numbers through iostreams then crashes on clashing locale facets
// when the host process already loaded the system libstdc++. Use
// mori::log::Hex(x) for hexadecimal.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

namespace mori::log {

enum class Level : int { Trace = 0, Debug = 1, Info = 2, Warning = 3, Error = 4, Off = 5 };

// Parses "trace|debug|info|warn|warning|error|critical|off" (case-insensitive).
// Throws mori::InvalidArgument naming the accepted values on anything else.
Level ParseLevel(const std::string& name);
void SetLevel(Level level);
Level GetLevel();
bool Enabled(Level level);
void Write(Level level, const char* file, int line, const std::string& message);

struct Hex {
  explicit Hex(uint64_t v) : value(v) {}
  uint64_t value;
};

// Locale-free message builder with the `<<` syntax of a stream.
class LogStream {
 public:
  LogStream& operator<<(const std::string& s) {
    text_ += s;
    return *this;
  }
  LogStream& operator<<(const char* s) {
    text_ += s ? s : "(null)";
    return *this;
  }
  LogStream& operator<<(char c) {
    text_.push_back(c);
    return *this;
  }
  LogStream& operator<<(bool b) {
    text_ += b ? "true" : "false";
    return *this;
  }
  LogStream& operator<<(Hex h);
  LogStream& operator<<(double d);
  LogStream& operator<<(const void* p);
  template <typename T, typename = std::enable_if_t<std::is_integral_v<T> || std::is_enum_v<T>>>
  LogStream& operator<<(T v) {
    if constexpr (std::is_enum_v<T>)
      text_ += std::to_string(static_cast<std::underlying_type_t<T>>(v));
    else
      text_ += std::to_string(v);
    return *this;
  }
  const std::string& str() const { return text_; }

 private:
  std::string text_;
};

}  // namespace mori::log

#define MORI_LOG(level, expr)                                                           \
  do {                                                                                  \
    if (::mori::log::Enabled(::mori::log::Level::level)) {                              \
      ::mori::log::LogStream mori_log_os_;                                              \
      mori_log_os_ << expr;                                                             \
      ::mori::log::Write(::mori::log::Level::level, __FILE__, __LINE__, mori_log_os_.str()); \
    }                                                                                   \
  } while (0)

#define MORI_DEBUG(expr) MORI_LOG(Debug, expr)
#define MORI_INFO(expr) MORI_LOG(Info, expr)
#define MORI_WARN(expr) MORI_LOG(Warning, expr)
#define MORI_ERROR(expr) MORI_LOG(Error, expr)
