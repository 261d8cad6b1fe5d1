#include "io/net/log_limiter.hpp"

#include <algorithm>
#include <iterator>

#include "common/env.hpp"
#include "common/logging.hpp"

namespace mori::io::net {
namespace {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t EnvOr(const char* name, int64_t fallback, int64_t lo) {
  try {
    int64_t v = env::GetInt(name, fallback);
    if (v >= lo) return v;
    MORI_WARN("ignoring " << name << "=" << v << " (must be >= " << lo << "); using " << fallback);
  } catch (const std::exception& e) {
    MORI_WARN("ignoring " << name << ": " << e.what() << "; using " << fallback);
  }
  return fallback;
}

}  // namespace

LogLimiter::LogLimiter(int64_t intervalMs, size_t linesPerInterval, size_t maxSources)
    : intervalMs_(std::max<int64_t>(intervalMs, 1)),
      linesPerInterval_(std::max<size_t>(linesPerInterval, 1)),
      maxSources_(std::max<size_t>(maxSources, 1)) {}

std::string LogLimiter::RollLocked(int64_t nowMs, bool force) {
  if (!force && windowStartMs_ != 0 && nowMs - windowStartMs_ < intervalMs_) return "";
  std::string summary;
  if (droppedInWindow_ > 0)
    summary = "remote input: " + std::to_string(droppedInWindow_) + " log line(s) suppressed in the last " +
              std::to_string((nowMs - windowStartMs_ + 500) / 1000) + " s, from " +
              std::to_string(sourcesDroppedInWindow_) + " source(s) (at most " + std::to_string(linesPerInterval_) +
              " lines per " + std::to_string(intervalMs_) + " ms over all peers, 1 per source)";
  ++window_;
  windowStartMs_ = nowMs;
  linesInWindow_ = 0;
  droppedInWindow_ = 0;
  sourcesDroppedInWindow_ = 0;
  return summary;
}

bool LogLimiter::Allow(const std::string& source, uint64_t* suppressed) {
  const int64_t now = NowMs();
  std::string summary;
  bool allowed = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    summary = RollLocked(now);
    if (sources_.size() >= maxSources_ && !sources_.count(source)) {
      // Too many distinct sources: forget the quiet ones, else share one bucket.
      for (auto it = sources_.begin(); it != sources_.end();)
        it = now - it->second.lastMs > intervalMs_ && it->second.suppressed == 0 ? sources_.erase(it) : std::next(it);
    }
    Source& s = sources_.size() >= maxSources_ && !sources_.count(source) ? sources_["(other sources)"]
                                                                           : sources_[source];
    const bool sourceQuiet = s.lastMs == 0 || now - s.lastMs >= intervalMs_;
    if (sourceQuiet && linesInWindow_ < linesPerInterval_) {
      *suppressed = s.suppressed;
      s.suppressed = 0;
      s.lastMs = now;
      ++linesInWindow_;
      allowed = true;
    } else {
      ++s.suppressed;
      ++droppedInWindow_;
      if (s.droppedWindow != window_) {
        s.droppedWindow = window_;
        ++sourcesDroppedInWindow_;
      }
    }
  }
  if (!summary.empty()) MORI_WARN(summary);
  return allowed;
}

void LogLimiter::Flush(bool now) {
  std::string summary;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (droppedInWindow_ == 0) return;
    summary = RollLocked(NowMs(), now);
  }
  if (!summary.empty()) MORI_WARN(summary);
}

LogLimiter& RemoteInputLog() {
  static LogLimiter limiter(EnvOr("MORI_IO_LOG_REMOTE_INTERVAL_MS", 10000, 1),
                            static_cast<size_t>(EnvOr("MORI_IO_LOG_REMOTE_LINES", 10, 1)));
  return limiter;
}

std::string SuppressedNote(uint64_t n) {
  return n == 0 ? "" : " (" + std::to_string(n) + " similar events from this peer suppressed)";
}

}  // namespace mori::io::net
