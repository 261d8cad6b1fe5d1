#include "io/segments.hpp"

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
  SegmentList segs;
  segs.reserve(sizes.size());  // not resize(): no zeroing pass before the copy
  for (size_t i = 0; i < sizes.size(); ++i) segs.push_back({localOffsets[i], remoteOffsets[i], sizes[i]});
  return segs;
}

std::string CheckRangeInRegion(uint64_t offset, uint64_t size, uint64_t regionSize) {
  if (offset > regionSize || size > regionSize - offset)
    return "range [" + std::to_string(offset) + ", " + std::to_string(offset) + "+" +
           std::to_string(size) + ") exceeds the registered size " + std::to_string(regionSize);
  return "";
}

std::string CheckAndMerge(SegmentList* list, uint64_t localSize, uint64_t remoteSize) {
  // In place: `out` trails `i`, so the list is merged without a second allocation.
  SegmentList& segs = *list;
  size_t out = 0;
  bool any = false;
  for (size_t i = 0; i < segs.size(); ++i) {
    const Segment s = segs[i];
    // Every segment is checked, empty ones included.
    if (!(s.localOffset <= localSize && s.size <= localSize - s.localOffset &&
          s.remoteOffset <= remoteSize && s.size <= remoteSize - s.remoteOffset)) {
      std::string e = CheckRangeInRegion(s.localOffset, s.size, localSize);
      if (!e.empty()) return "segment " + std::to_string(i) + ": local " + e;
      return "segment " + std::to_string(i) + ": remote " + CheckRangeInRegion(s.remoteOffset, s.size, remoteSize);
    }
    if (s.size == 0) continue;
    if (any) {
      Segment& last = segs[out];
      if (last.remoteOffset + last.size == s.remoteOffset && last.localOffset + last.size == s.localOffset) {
        last.size += s.size;
        continue;
      }
      ++out;
    }
    segs[out] = s;
    any = true;
  }
  segs.resize(any ? out + 1 : 0);
  return "";
}

size_t ExpandBlockSegments(const std::vector<BlockRun>& runs, const int64_t* srcBlocks, const int64_t* dstBlocks,
                           size_t blocks, int64_t* outSrc, int64_t* outDst, int64_t* outSize) {
  size_t n = 0;
  for (const BlockRun& run : runs) {
    for (size_t l = 0; l < run.layers; ++l) {
      for (size_t b = 0; b < blocks; ++b) {
        const int64_t sBase = run.srcLayerOffsets[l] + srcBlocks[b] * run.srcBlockStride;
        const int64_t dBase = run.dstLayerOffsets[l] + dstBlocks[b] * run.dstBlockStride;
        for (size_t k = 0; k < run.tmplLen; ++k) {
          const int64_t so = sBase + run.tmplSrc[k], d = dBase + run.tmplDst[k], sz = run.tmplSize[k];
          if (n > 0 && outSrc[n - 1] + outSize[n - 1] == so && outDst[n - 1] + outSize[n - 1] == d) {
            outSize[n - 1] += sz;
            continue;
          }
          outSrc[n] = so;
          outDst[n] = d;
          outSize[n] = sz;
          ++n;
        }
      }
    }
  }
  return n;
}

uint64_t TotalBytes(const SegmentList& segs) {
  uint64_t t = 0;
  for (const auto& s : segs) t += s.size;
  return t;
}

}  // namespace mori::io
