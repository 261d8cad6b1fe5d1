// Minimal leveled logging to stderr.
//
// Level comes from MORI_IO_LOG_LEVEL, else MORI_GLOBAL_LOG_LEVEL, else
// "warning"; Python can change it with mori_core.io.set_log_level().
#pragma once

#include <sstream>
#include <string>

namespace mori::log {

enum class Level : int { Trace = 0, Debug = 1, Info = 2, Warning = 3, Error = 4, Off = 5 };

// Parses "trace|debug|info|warn|warning|error|critical|off" (case-insensitive).
// Throws mori::InvalidArgument naming the accepted values on anything else.
Level ParseLevel(const std::string& name);
void SetLevel(Level level);
Level GetLevel();
bool Enabled(Level level);
void Write(Level level, const char* file, int line, const std::string& message);

}  // namespace mori::log

#define MORI_LOG(level, expr)                                                          \
  do {                                                                                 \
    if (::mori::log::Enabled(::mori::log::Level::level)) {                             \
      std::ostringstream mori_log_os_;                                                 \
      mori_log_os_ << expr;                                                            \
      ::mori::log::Write(::mori::log::Level::level, __FILE__, __LINE__, mori_log_os_.str()); \
    }                                                                                  \
  } while (0)

#define MORI_DEBUG(expr) MORI_LOG(Debug, expr)
#define MORI_INFO(expr) MORI_LOG(Info, expr)
#define MORI_WARN(expr) MORI_LOG(Warning, expr)
#define MORI_ERROR(expr) MORI_LOG(Error, expr)
