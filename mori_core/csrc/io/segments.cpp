#include "io/segments.hpp"

#include <algorithm>

#include "common/error.hpp"

namespace mori::io {

SegmentList MakeSegments(const std::vector<uint64_t>& localOffsets,
                         const std::vector<uint64_t>& remoteOffsets,
                         const std::vector<uint64_t>& sizes) {
  if (localOffsets.size() != remoteOffsets.size() || localOffsets.size() != sizes.size())
    throw InvalidArgument("local_offsets, remote_offsets and sizes must have the same length (got " +
                          std::to_string(localOffsets.size()) + ", " +
                          std::to_string(remoteOffsets.size()) + ", " + std::to_string(sizes.size()) +
                          ")");
  SegmentList segs(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) segs[i] = {localOffsets[i], remoteOffsets[i], sizes[i]};
  return segs;
}

std::string CheckRangeInRegion(uint64_t offset, uint64_t size, uint64_t regionSize) {
  if (offset > regionSize || size > regionSize - offset)
    return "range [" + std::to_string(offset) + ", " + std::to_string(offset) + "+" +
           std::to_string(size) + ") exceeds the registered size " + std::to_string(regionSize);
  return "";
}

std::string CheckBounds(const SegmentList& segs, uint64_t localSize, uint64_t remoteSize) {
  for (size_t i = 0; i < segs.size(); ++i) {
    const Segment& s = segs[i];
    std::string e = CheckRangeInRegion(s.localOffset, s.size, localSize);
    if (!e.empty()) return "segment " + std::to_string(i) + ": local " + e;
    e = CheckRangeInRegion(s.remoteOffset, s.size, remoteSize);
    if (!e.empty()) return "segment " + std::to_string(i) + ": remote " + e;
  }
  return "";
}

SegmentList MergeContiguous(SegmentList segs) {
  segs.erase(std::remove_if(segs.begin(), segs.end(), [](const Segment& s) { return s.size == 0; }),
             segs.end());
  if (segs.size() < 2) return segs;
  auto byRemote = [](const Segment& a, const Segment& b) { return a.remoteOffset < b.remoteOffset; };
  if (!std::is_sorted(segs.begin(), segs.end(), byRemote))
    std::stable_sort(segs.begin(), segs.end(), byRemote);
  // In place: `out` trails `i`, so the list is merged without a second allocation.
  size_t out = 0;
  for (size_t i = 1; i < segs.size(); ++i) {
    Segment& last = segs[out];
    const Segment& s = segs[i];
    if (last.remoteOffset + last.size == s.remoteOffset && last.localOffset + last.size == s.localOffset)
      last.size += s.size;
    else
      segs[++out] = s;
  }
  segs.resize(out + 1);
  return segs;
}

uint64_t TotalBytes(const SegmentList& segs) {
  uint64_t t = 0;
  for (const auto& s : segs) t += s.size;
  return t;
}

}  // namespace mori::io
