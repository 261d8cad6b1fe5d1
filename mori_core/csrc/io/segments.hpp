// A transfer is a list of (local offset, remote offset, size) segments between
// one local and one remote memory region. These helpers are shared by every
// backend: bounds checking (the same rule on both sides of the wire) and
// merging of segments that are contiguous in both regions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mori::io {

struct Segment {
  uint64_t localOffset;
  uint64_t remoteOffset;
  uint64_t size;
};
using SegmentList = std::vector<Segment>;

// Builds segments from MORI's parallel offset/size lists. Throws
// InvalidArgument when the three lists differ in length.
SegmentList MakeSegments(const std::vector<uint64_t>& localOffsets,
                         const std::vector<uint64_t>& remoteOffsets,
                         const std::vector<uint64_t>& sizes);

// "" when every (offset, size) lies inside a region of `regionSize` bytes.
std::string CheckRangeInRegion(uint64_t offset, uint64_t size, uint64_t regionSize);

// Checks that every segment lies inside both regions and, in the same pass and in
// place, drops empty segments and merges each segment into the one before it when it
// continues it in both regions. The order given is kept: planners emit segments in
// address order already, and a stable sort of 8,192 segments took 0.5-0.8 ms of host
// time per call on the 2-core development VM (about what the GPU needs to move
// 256 MiB). Returns "" with `segs` merged, or a message naming the first offending
// segment (numbered as given), its range and the limit it exceeds; `segs` is then
// partly merged and must be dropped.
std::string CheckAndMerge(SegmentList* segs, uint64_t localSize, uint64_t remoteSize);

uint64_t TotalBytes(const SegmentList& segs);

// One run of a KV-cache plan: layers of one geometry between two regions. Layer l's
// block b starts at layerOffset[l] + block * blockStride on each side; a block pair
// moves the template's pieces (offsets relative to the block starts, and sizes).
struct BlockRun {
  const int64_t* srcLayerOffsets;
  const int64_t* dstLayerOffsets;
  size_t layers;
  int64_t srcBlockStride;
  int64_t dstBlockStride;
  const int64_t* tmplSrc;
  const int64_t* tmplDst;
  const int64_t* tmplSize;
  size_t tmplLen;
};

// Segments of every (run, layer, block pair, template piece), in that order, merged where
// a segment continues the one before it on both sides (also across runs and layers).
// Writes them to out{Src,Dst,Size} (room for the unmerged count: the sum over runs of
// layers x blocks x template length) and returns how many there are. The KV planners'
// hot path: a numpy version took 80-170 us per 2,048-token request in a real process.
size_t ExpandBlockSegments(const std::vector<BlockRun>& runs, const int64_t* srcBlocks, const int64_t* dstBlocks,
                           size_t blocks, int64_t* outSrc, int64_t* outDst, int64_t* outSize);

}  // namespace mori::io
