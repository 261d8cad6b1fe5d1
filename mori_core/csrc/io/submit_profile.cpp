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

const char* PathName(Path p) {
  switch (p) {
    case kPathKernel: return "kernel";
    case kPathCopyEngines: return "copy_engines";
    case kPathProxy: return "proxy";
    case kPathCopyEngineBatch: return "copy_engine_batch";
    default: return "none";
  }
}

Stamps& ThreadStamps() {
  static thread_local Stamps stamps;
  return stamps;
}

}  // namespace mori::io::profile
