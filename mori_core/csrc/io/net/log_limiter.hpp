// Rate limit for log lines caused by remote input (malformed frames, failed
// or timed-out handshakes, floods): at most one line per source per interval
// AND at most `linesPerInterval` lines per interval over all sources, so
// neither one hostile peer nor thousands of source addresses can flood the
// log. Nothing is hidden without a count: a source's next line says how many
// of its events were dropped, and each interval in which anything was dropped
// ends with one summary line (events, sources).
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

namespace mori::io::net {

class LogLimiter {
 public:
  explicit LogLimiter(int64_t intervalMs = 10000, size_t linesPerInterval = 10, size_t maxSources = 4096);

  // True when a line for `source` may be written now; *suppressed is then the
  // number of events of that source dropped since its previous line.
  bool Allow(const std::string& source, uint64_t* suppressed);
  // Writes the summary of an interval that ended with drops in it (Allow does
  // too; the listener's event loop calls this so it also comes when the flood
  // stopped). `now`: also the summary of the current interval (a listener stops).
  void Flush(bool now = false);

  int64_t intervalMs() const { return intervalMs_; }
  size_t linesPerInterval() const { return linesPerInterval_; }

 private:
  struct Source {
    int64_t lastMs = 0;
    uint64_t suppressed = 0;
    uint64_t droppedWindow = 0;  // the window in which it last had an event dropped
  };
  // Starts a new window if the current one ended (or `force`); returns its summary ("" if none).
  std::string RollLocked(int64_t nowMs, bool force = false);

  const int64_t intervalMs_;
  const size_t linesPerInterval_;
  const size_t maxSources_;
  std::mutex mu_;
  std::unordered_map<std::string, Source> sources_;
  uint64_t window_ = 1;
  int64_t windowStartMs_ = 0;
  size_t linesInWindow_ = 0;
  uint64_t droppedInWindow_ = 0;
  uint64_t sourcesDroppedInWindow_ = 0;
};

// Process-wide limiter for input from the network (MORI_IO_LOG_REMOTE_LINES
// lines per MORI_IO_LOG_REMOTE_INTERVAL_MS, default 10 per 10 s);
// " (N similar suppressed)" suffix helper.
LogLimiter& RemoteInputLog();
std::string SuppressedNote(uint64_t n);

}  // namespace mori::io::net

// Logs a warning caused by remote input, rate-limited per `source` and in total.
#define MORI_WARN_REMOTE(source, expr)                                                        \
  do {                                                                                        \
    uint64_t mori_suppressed_ = 0;                                                            \
    if (::mori::io::net::RemoteInputLog().Allow((source), &mori_suppressed_))                 \
      MORI_WARN(expr << ::mori::io::net::SuppressedNote(mori_suppressed_));                   \
  } while (0)
