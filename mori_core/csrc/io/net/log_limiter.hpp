// Rate limit for log lines caused by remote input (malformed frames, failed
// handshakes): at most one line per source per interval, each line saying how
// many similar events were suppressed since the last one, so a hostile or
// broken peer cannot flood the log, and nothing is hidden without a count.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

namespace mori::io::net {

class LogLimiter {
 public:
  explicit LogLimiter(int64_t intervalMs = 10000, size_t maxSources = 4096)
      : intervalMs_(intervalMs), maxSources_(maxSources) {}

  // True when a line for `source` may be written now; *suppressed is then the
  // number of events of that source dropped since its previous line.
  bool Allow(const std::string& source, uint64_t* suppressed) {
    const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::steady_clock::now().time_since_epoch())
                            .count();
    std::lock_guard<std::mutex> lock(mu_);
    if (sources_.size() >= maxSources_ && !sources_.count(source)) {
      // Too many distinct sources: forget the quiet ones, else share one bucket.
      for (auto it = sources_.begin(); it != sources_.end();)
        it = now - it->second.lastMs > intervalMs_ ? sources_.erase(it) : std::next(it);
    }
    auto& s = sources_.size() >= maxSources_ && !sources_.count(source) ? sources_["(other sources)"]
                                                                        : sources_[source];
    if (s.lastMs != 0 && now - s.lastMs < intervalMs_) {
      ++s.suppressed;
      return false;
    }
    *suppressed = s.suppressed;
    s.suppressed = 0;
    s.lastMs = now;
    return true;
  }

 private:
  struct Source {
    int64_t lastMs = 0;
    uint64_t suppressed = 0;
  };
  const int64_t intervalMs_;
  const size_t maxSources_;
  std::mutex mu_;
  std::unordered_map<std::string, Source> sources_;
};

// Process-wide limiter for input from the network; " (N similar suppressed)" suffix helper.
LogLimiter& RemoteInputLog();
std::string SuppressedNote(uint64_t n);

}  // namespace mori::io::net

// Logs a warning caused by remote input, rate-limited per `source`.
#define MORI_WARN_REMOTE(source, expr)                                                        \
  do {                                                                                        \
    uint64_t mori_suppressed_ = 0;                                                            \
    if (::mori::io::net::RemoteInputLog().Allow((source), &mori_suppressed_))                 \
      MORI_WARN(expr << ::mori::io::net::SuppressedNote(mori_suppressed_));                   \
  } while (0)
