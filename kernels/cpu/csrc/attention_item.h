// The paged attention work item, the cache geometry it reads through, and the split of a batch
// into items (paged_attention.cpp draws the cache layout; attention_portable.h and the vector
// bodies in attention_simd.h run one item).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_fp8.h"

namespace deltaserve_cpu {
namespace paged {

constexpr int kChunk = 16;        // key positions per step of the online softmax
constexpr int kTileRows = 48;     // query rows (tokens x heads) per work item at most
constexpr int kMaxGroup = 128;    // query heads per kv head (DeepSeek-V3's 128 on one latent)

struct Item {
  int64_t req, head, tok0, ntok;  // kv head; tokens tok0 .. tok0+ntok-1 of the request's queries
  int g0, ng;                     // the kv head's query heads g0 .. g0+ng-1 (row r: head r % ng)
  int64_t cost;                   // ~ rows x keys, to order the dynamic schedule
};

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
struct Geometry {
  const T* kv;                    // cache base
  int64_t half;                   // elements from the key cache to the value cache
  int64_t block_stride, row_stride, head_stride;   // elements
  int64_t block_size;
  const int32_t* blocks;          // this request's block-table row
};

inline std::vector<Item> make_items(const int32_t* qsl, const int32_t* seq_lens, int64_t num_reqs,
                                    int64_t num_kv_heads, int group, int64_t window) {
  // head tiles: the whole group, or kTileRows heads at a time (one token each) past it
  const int tile_heads = std::min(group, kTileRows);
  const int64_t tile_tokens = std::max(1, kTileRows / tile_heads);
  std::vector<Item> items;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t qlen = qsl[r + 1] - qsl[r];
    const int64_t first_pos = seq_lens[r] - qlen;
    for (int64_t t0 = 0; t0 < qlen; t0 += tile_tokens) {
      const int64_t n = std::min(tile_tokens, qlen - t0);
      const int64_t keys = first_pos + t0 + n;           // a window reads about W + n of them
      for (int g0 = 0; g0 < group; g0 += tile_heads) {
        const int ng = std::min(tile_heads, group - g0);
        const int64_t cost = (window ? std::min(keys, window + n) : keys) * n * ng + 64;
        for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({r, h, t0, n, g0, ng, cost});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

}  // namespace paged
}  // namespace deltaserve_cpu
