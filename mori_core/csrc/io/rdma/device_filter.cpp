#include "io/rdma/device_filter.hpp"

#include <algorithm>
#include <cctype>

#include "common/error.hpp"

namespace mori::io::rdma {
namespace {

constexpr size_t kMaxNameLength = 64;

std::string Trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

bool ValidName(const std::string& n) {
  if (n.empty() || n.size() > kMaxNameLength) return false;
  return std::all_of(n.begin(), n.end(), [](unsigned char c) { return std::isalnum(c) || c == '_' || c == '-' || c == '.'; });
}

}  // namespace

DeviceFilter ParseDeviceFilter(const std::string& spec, const char* what) {
  DeviceFilter f;
  std::string s = Trim(spec);
  if (s.empty()) return f;
  if (s[0] == '^') {
    f.exclude = true;
    s = Trim(s.substr(1));
    if (s.empty()) throw InvalidArgument(std::string(what) + "='" + spec + "': '^' must be followed by device names");
  }
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    std::string item = Trim(s.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (item.empty())
      throw InvalidArgument(std::string(what) + "='" + spec + "': empty entry (expected name[:port],name[:port],...)");
    DeviceFilterEntry e;
    size_t colon = item.find(':');
    e.name = Trim(item.substr(0, colon));
    if (!ValidName(e.name))
      throw InvalidArgument(std::string(what) + "='" + spec + "': '" + e.name +
                            "' is not a device name (letters, digits, '_', '-', '.'; at most 64 characters)");
    if (colon != std::string::npos) {
      std::string p = Trim(item.substr(colon + 1));
      bool digits = !p.empty() && p.size() <= 3 &&
                    std::all_of(p.begin(), p.end(), [](unsigned char c) { return std::isdigit(c); });
      int port = digits ? std::stoi(p) : 0;
      if (port < 1 || port > 255)
        throw InvalidArgument(std::string(what) + "='" + spec + "': port '" + p + "' of " + e.name +
                              " must be an integer in [1, 255]");
      e.port = port;
    }
    f.entries.push_back(std::move(e));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return f;
}

bool DeviceFilter::Accepts(const std::string& name, int port) const {
  if (entries.empty()) return true;
  bool listed = std::any_of(entries.begin(), entries.end(), [&](const DeviceFilterEntry& e) {
    return e.name == name && (e.port == 0 || e.port == port);
  });
  return exclude ? !listed : listed;
}

std::vector<std::string> DeviceFilter::UnmatchedIncludes(const std::vector<std::string>& present) const {
  std::vector<std::string> out;
  if (exclude) return out;
  for (const auto& e : entries)
    if (std::find(present.begin(), present.end(), e.name) == present.end()) out.push_back(e.name);
  return out;
}

}  // namespace mori::io::rdma
