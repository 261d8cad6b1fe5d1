// Environment-variable parsing shared by all layers. Malformed values raise
// InvalidArgument naming the variable, instead of being silently ignored.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace mori::env {

std::optional<std::string> GetString(const char* name);
int64_t GetInt(const char* name, int64_t fallback);
bool GetBool(const char* name, bool fallback);
// Sizes such as "4096", "512K", "6G", "1.5GiB" -> bytes.
uint64_t GetSize(const char* name, uint64_t fallback);
uint64_t ParseSize(const std::string& text, const char* what);

}  // namespace mori::env
