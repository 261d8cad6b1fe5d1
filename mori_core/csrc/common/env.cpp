#include "common/env.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>

#include "common/error.hpp"

namespace mori::env {

std::optional<std::string> GetString(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

int64_t GetInt(const char* name, int64_t fallback) {
  auto v = GetString(name);
  if (!v) return fallback;
  char* end = nullptr;
  long long x = std::strtoll(v->c_str(), &end, 10);
  if (end == v->c_str() || *end != '\0')
    throw InvalidArgument(std::string(name) + "='" + *v + "' is not an integer");
  return x;
}

bool GetBool(const char* name, bool fallback) {
  auto v = GetString(name);
  if (!v) return fallback;
  std::string s = *v;
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  if (s == "0" || s == "false" || s == "no" || s == "off") return false;
  throw InvalidArgument(std::string(name) + "='" + *v + "' is not a boolean (use 0/1)");
}

uint64_t ParseSize(const std::string& text, const char* what) {
  std::string s;
  for (char c : text)
    if (!std::isspace(static_cast<unsigned char>(c))) s.push_back(c);
  char* end = nullptr;
  double value = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || value < 0 || !std::isfinite(value))
    throw InvalidArgument(std::string(what) + "='" + text + "' is not a size (e.g. 512M, 6G)");
  std::string unit(end);
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return std::toupper(c); });
  if (!unit.empty() && unit.back() == 'B') unit.pop_back();
  if (unit.size() == 2 && unit[1] == 'I') unit.pop_back();
  double mult = 1;
  if (unit.empty()) mult = 1;
  else if (unit == "K") mult = 1024.0;
  else if (unit == "M") mult = 1024.0 * 1024;
  else if (unit == "G") mult = 1024.0 * 1024 * 1024;
  else if (unit == "T") mult = 1024.0 * 1024 * 1024 * 1024;
  else throw InvalidArgument(std::string(what) + "='" + text + "' has an unknown unit (use K, M, G or T)");
  return static_cast<uint64_t>(value * mult);
}

uint64_t GetSize(const char* name, uint64_t fallback) {
  auto v = GetString(name);
  if (!v) return fallback;
  return ParseSize(*v, name);
}

}  // namespace mori::env
