#include "io/submit_profile.hpp"

namespace mori::io::profile {

std::atomic<bool> gEnabled{false};

const char* StampName(Stamp s) {
  switch (s) {
    case kEnter: return "enter";
    case kConverted: return "converted";
    case kValidated: return "validated";
    case kLaunchBegin: return "launch_begin";
    case kLaunchEnd: return "launch_end";
    case kSubmitted: return "submitted";
    default: return "unknown";
  }
}

Stamps& ThreadStamps() {
  static thread_local Stamps stamps;
  return stamps;
}

}  // namespace mori::io::profile
