#include "ccl/ce_watchdog.hpp"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace mori::ccl {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPeriod = std::chrono::milliseconds(5);

struct Watched {
  StuckListener* who;
  const volatile uint32_t* busy;
  int sites;
  Clock::duration timeout;
  std::vector<Clock::time_point> since;  // first sample of the current busy stretch (epoch: idle)
};

// One thread for the process, started with the first watched handle and never stopped
// (it sleeps on the condition variable while nothing is watched). The object is leaked
// on purpose: the thread may outlive static destruction at exit.
struct Watchdog {
  std::mutex mu;  // guards `watched`; callbacks run under it, so UnwatchSites waits for them
  std::condition_variable cv;
  std::vector<Watched> watched;
  bool started = false;

  void Loop() {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      if (watched.empty())
        cv.wait(lk);
      else
        cv.wait_for(lk, kPeriod);
      const auto now = Clock::now();
      for (Watched& w : watched) {
        for (int s = 0; s < w.sites; ++s) {
          if (w.busy[s] == 0) {
            w.since[s] = Clock::time_point();
          } else if (w.since[s] == Clock::time_point()) {
            w.since[s] = now;
          } else if (now - w.since[s] > w.timeout) {
            w.who->OnStuck(s);
            w.since[s] = Clock::time_point();
          }
        }
      }
    }
  }
};

Watchdog& Dog() {
  static Watchdog* dog = new Watchdog();
  return *dog;
}

}  // namespace

void WatchSites(StuckListener* who, const volatile uint32_t* busy, int sites, double timeout_s) {
  Watchdog& d = Dog();
  {
    std::lock_guard<std::mutex> lk(d.mu);
    const auto timeout = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
    d.watched.push_back(Watched{who, busy, sites, timeout, std::vector<Clock::time_point>(sites)});
    if (!d.started) {
      d.started = true;
      std::thread([&d] { d.Loop(); }).detach();
    }
  }
  d.cv.notify_all();
}

void UnwatchSites(StuckListener* who) {
  Watchdog& d = Dog();
  std::lock_guard<std::mutex> lk(d.mu);
  for (size_t i = 0; i < d.watched.size(); ++i) {
    if (d.watched[i].who == who) {
      d.watched.erase(d.watched.begin() + static_cast<long>(i));
      break;
    }
  }
}

}  // namespace mori::ccl
