// Paged attention on the CPU, reading keys and values in place from the paged cache.
//
//   kv_cache[2, num_blocks, block_size, Hkv, D]   (0 = keys, 1 = values; float32 or bfloat16,
//   the query's, or one byte per value: float8_e5m2 / float8_e4m3fn, widened as read, attention_fp8.h)
//   request r: query rows query_start_loc[r] .. query_start_loc[r+1]-1 of query [T, Hq, D],
//   at positions seq_len - qlen .. seq_len - 1; query row i sees keys 0 .. its own position.
//   key position p of request r lives in block block_table[r, p / block_size], row p % block_size.
//
// Work items are (request, kv head, tile of query tokens); a tile holds up to kTileRows query
// rows, each token contributing its G = Hq / Hkv heads (rows ordered token-major). A group of
// more than kTileRows heads (DeepSeek's MLA: up to 128 query heads on its one latent head) is
// cut into head tiles of kTileRows, one token each.
// The value head DV is out's last dim: D itself, or for the latent (D = 576) its first 512
// dims, read from the value row (for MLA the same cached row as the key: kv_cache seen twice). Each item runs
// flash-attention style over chunks of kChunk key positions: scores for the whole chunk, an
// online softmax (running max m and sum l per row), and the value accumulation, all in float32.
// Chunks past the tile's last position are never read; the diagonal chunk is masked.
// A sliding window W > 0 (window; 0: none) hides key k from the query at p unless p - W < k: the
// chunks below the tile's first row's window are never read either, and those holding a key
// below its last row's window are masked too.
// Attention sinks (sinks: a float32 logit per query head, or null: none; GPT-OSS) join each
// row's softmax denominator: out = sum_k e^(s_k) v_k / (sum_k e^(s_k) + e^(sink)). Every body
// folds them in once per row when it stores it (normalizer), so a call without sinks runs the
// loops it ran before.
// With AVX-512 or AVX2 + FMA (simd.h) the item bodies in attention_simd.h run; the portable
// loops of attention_portable.h are the generic build's (attention_item.h: the work item).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "vec_math.h"
#include "attention_item.h"
#include "attention_portable.h"
#include "attention_simd.h"
#include "attention_bf16dot.h"
#include "attention_latent.h"

namespace deltaserve_cpu {
namespace paged {
namespace {

#if defined(DELTASERVE_SIMD)
// The vector bodies: wide tiles (prefill) with rows in lanes, narrow ones (decode) direct.
// T: the query's and out's type; KT: the cache's (T, or fp8: rows widened by as_f32).
template <typename T, typename KT, int D, int DV>
void attend_item_simd(const Item& it, const Geometry<KT>& g, const T* query,
                        int64_t q_tok_stride, int64_t q_head_stride, T* out,
                        int64_t o_tok_stride, int64_t o_head_stride, int64_t q_start,
                        int64_t first_pos, int group, float scale, int64_t window,
                        const float* sinks, const simd::Ahead& after) {
  const int ng = it.ng;
  const int rows = static_cast<int>(it.ntok) * ng;
  const T* qrows[kTileRows];
  int64_t pos[kTileRows];
  for (int t = 0; t < it.ntok; ++t) {
    for (int gi = 0; gi < ng; ++gi) {
      const int r = t * ng + gi;
      qrows[r] = query + (q_start + it.tok0 + t) * q_tok_stride +
                 (it.head * group + it.g0 + gi) * q_head_stride;
      pos[r] = first_pos + it.tok0 + t;
    }
  }
  const int shift = __builtin_ctzll(static_cast<uint64_t>(g.block_size));
  const int64_t mask = g.block_size - 1;
  const KT* head_base = g.kv + it.head * g.head_stride;
  auto row = [&](int64_t p, int which) -> const KT* {
    return head_base + which * g.half + g.blocks[p >> shift] * g.block_stride +
           (p & mask) * g.row_stride;
  };
  auto store_row = [&](int r, const float* acc, float m, float l) {
    const int64_t h = it.head * group + it.g0 + r % ng;
    const float inv = normalizer(m, l, sinks, h);
    T* dst = out + (q_start + it.tok0 + r / ng) * o_tok_stride + h * o_head_stride;
    for (int d = 0; d < DV; ++d) dst[d] = static_cast<T>(acc[d] * inv);
  };
  if constexpr (D > 128 || DV != D) {     // the latent (no window, no sinks: the entry checks)
    simd::latent_item_rows<T, D, DV>(qrows, scale, pos, rows, row, g.half == 0, store_row);
    return;
  } else {
#if defined(DELTASERVE_BF16DOT)
    if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<KT, T>) {
      if (rows > simd::kDirectRows) {
        simd::wide_item_bf16dot<D>(qrows, scale, pos, rows, row, store_row, window);
        return;
      }
    }
#endif
    alignas(64) float q[kTileRows][D];
    for (int r = 0; r < rows; ++r)
      for (int d = 0; d < D; ++d) q[r][d] = to_float(qrows[r][d]) * scale;
    if (rows <= simd::kDirectRows) {
      simd::narrow_item<KT, D>(q, pos, rows, row, g.block_size, g.row_stride, store_row, window,
                               after);
    } else {
      simd::wide_item<KT, D>(q, pos, rows, row, store_row, window);
    }
  }
}

// The rows of item `it`'s first chunk of keys (blocks: its request's block-table row).
template <typename KT>
simd::Ahead first_chunk(const Item& it, const Geometry<KT>& g, const int32_t* blocks,
                        const int32_t* qsl, const int32_t* seq_lens, int64_t window) {
  const int64_t qlen = qsl[it.req + 1] - qsl[it.req];
  const int64_t first_row = seq_lens[it.req] - qlen + it.tok0;        // its first position
  const int64_t keys = first_row + it.ntok;                           // its last position + 1
  const int64_t p = simd::first_key(first_row, window);
  const KT* first = g.kv + it.head * g.head_stride + blocks[p / g.block_size] * g.block_stride +
                   (p % g.block_size) * g.row_stride;
  simd::Ahead a;
  a.keys = reinterpret_cast<const char*>(first);
  a.values = reinterpret_cast<const char*>(first + g.half);
  a.row_bytes = g.row_stride * static_cast<int64_t>(sizeof(KT));
  a.n = static_cast<int>(std::min<int64_t>({simd::kChunk, keys - p,
                                            g.block_size - p % g.block_size}));
  return a;
}
#endif

template <typename T, typename KT, int D, int DV>
void run(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
         const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
         at::Tensor& out, int64_t window, const float* sinks) {
  const int64_t num_reqs = seq_lens.size(0);
  const int64_t hkv = kv_cache.size(3);
  const int group = static_cast<int>(query.size(1) / hkv);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<Item> items = make_items(qsl, lens, num_reqs, hkv, group, window);
  Geometry<KT> base{static_cast<const KT*>(kv_cache.data_ptr()), kv_cache.stride(0),
                    kv_cache.stride(1),
                   kv_cache.stride(2), kv_cache.stride(3), kv_cache.size(2), nullptr};
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t table_stride = block_table.stride(0);
  const T* q = query.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const int64_t num_items = static_cast<int64_t>(items.size());
  const bool one_thread = at::get_num_threads() == 1 || num_items < 2;
  auto body = [&](int64_t i) {
    const Item& it = items[i];
    Geometry<KT> g = base;
    g.blocks = table + it.req * table_stride;
    const int64_t qlen = qsl[it.req + 1] - qsl[it.req];
#if defined(DELTASERVE_SIMD)
    if constexpr (D % simd::kChunk == 0) {
      // one thread: item i's last chunk prefetches item i + 1's first (the next it runs)
      const simd::Ahead after = one_thread && i + 1 < num_items
          ? first_chunk(items[i + 1], base, table + items[i + 1].req * table_stride, qsl, lens,
                        window)
          : simd::Ahead();
      attend_item_simd<T, KT, D, DV>(it, g, q, query.stride(0), query.stride(1), o, out.stride(0),
                             out.stride(1), qsl[it.req], lens[it.req] - qlen, group, fscale,
                             window, sinks, after);
      return;
    }
#endif
    attend_item<T, KT, D, DV>(it, g, q, query.stride(0), query.stride(1), o, out.stride(0),
                      out.stride(1), qsl[it.req], lens[it.req] - qlen, group, fscale, window,
                      sinks);
  };
  if (one_thread) {
    for (int64_t i = 0; i < num_items; ++i) body(i);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t i = 0; i < num_items; ++i) body(i);
}

// KT: the cache's type (T, or an fp8 type: no latent, whose kernel reads T only).
template <typename T, typename KT>
void dispatch_head_dim(const at::Tensor& query, const at::Tensor& kv_cache,
                       const at::Tensor& block_table, const at::Tensor& qsl,
                       const at::Tensor& seq_lens, double scale, at::Tensor& out,
                       int64_t window, const float* sinks) {
#define DELTASERVE_RUN(D, DV) \
  return run<T, KT, D, DV>(query, kv_cache, block_table, qsl, seq_lens, scale, out, window, sinks)
  switch (query.size(2)) {
    case 16: DELTASERVE_RUN(16, 16);
    case 32: DELTASERVE_RUN(32, 32);
    case 64: DELTASERVE_RUN(64, 64);
    case 80: DELTASERVE_RUN(80, 80);
    case 96: DELTASERVE_RUN(96, 96);
    case 128: DELTASERVE_RUN(128, 128);
    case 576:     // DeepSeek's MLA latent: kv_lora_rank 512 + rope 64, values the first 512
      if constexpr (std::is_same_v<KT, T>) DELTASERVE_RUN(576, 512);
      TORCH_CHECK(false, "head_dim=576 (the MLA latent) with an fp8 kv_cache: not supported");
    default: TORCH_CHECK(false, "head_dim=", query.size(2),
                         " is not supported: must be 16, 32, 64, 80, 96, 128 or 576");
  }
#undef DELTASERVE_RUN
}

// The query's type T with the cache's: T itself, or an fp8 cache (--kv-cache-dtype).
template <typename T>
void dispatch_cache_dtype(const at::Tensor& query, const at::Tensor& kv_cache,
                          const at::Tensor& block_table, const at::Tensor& qsl,
                          const at::Tensor& seq_lens, double scale, at::Tensor& out,
                          int64_t window, const float* sinks) {
  switch (kv_cache.scalar_type()) {
    case at::kFloat8_e5m2:
      return dispatch_head_dim<T, c10::Float8_e5m2>(query, kv_cache, block_table, qsl, seq_lens,
                                                    scale, out, window, sinks);
    case at::kFloat8_e4m3fn:
      return dispatch_head_dim<T, c10::Float8_e4m3fn>(query, kv_cache, block_table, qsl,
                                                      seq_lens, scale, out, window, sinks);
    default:
      TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type(), "kv_cache's dtype ",
                  kv_cache.scalar_type(), " with query's ", query.scalar_type(),
                  ": must be query's, float8_e5m2 or float8_e4m3fn");
      return dispatch_head_dim<T, T>(query, kv_cache, block_table, qsl, seq_lens, scale, out,
                                     window, sinks);
  }
}

}  // namespace
}  // namespace paged

void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_table, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, double scale, at::Tensor& out, int64_t window,
                     const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window)");
  // the two halves: contiguous one after the other, or one tensor seen twice (stride 0: a
  // model whose values are its keys, DeepSeek's latent cache)
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache[0].is_contiguous() &&
                  (kv_cache.stride(0) == 0 || kv_cache.is_contiguous()),
              "kv_cache must be a [2, num_blocks, block_size, Hkv, D] tensor, contiguous or "
              "with both halves one contiguous tensor");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && out.size(0) == query.size(0) &&
                  out.size(1) == query.size(1),
              "query must be [T, Hq, D] and out [T, Hq, Dv]");
  TORCH_CHECK(kv_cache.size(4) == query.size(2), "kv_cache head_dim differs from query's");
  const int64_t head_dim = query.size(2), v_dim = out.size(2);
  TORCH_CHECK(head_dim == 576 ? v_dim == 512 : v_dim == head_dim, "out's value head dim ", v_dim,
              " with head_dim ", head_dim, ": must be head_dim itself (512 for the 576 latent)");
  TORCH_CHECK(v_dim == head_dim || (window == 0 && !sinks.has_value()),
              "a sliding window or sinks with a value head (", v_dim, ") smaller than the key "
              "head (", head_dim, "): not supported (MLA has neither)");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "Hq must be a multiple of Hkv");
  TORCH_CHECK(query.size(1) / kv_cache.size(3) <= paged::kMaxGroup, "query heads per kv head: ",
              query.size(1) / kv_cache.size(3), ", at most ", paged::kMaxGroup);
  const int64_t block_size = kv_cache.size(2);
  TORCH_CHECK(block_size > 0 && (block_size & (block_size - 1)) == 0,
              "block_size must be a power of two");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "query and out must share a dtype "
              "(kv_cache: the same, or float8_e5m2 / float8_e4m3fn)");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt,
              "block_table, query_start_loc and seq_lens must be int32");
  TORCH_CHECK(block_table.stride(1) == 1 && query_start_loc.is_contiguous() &&
                  seq_lens.is_contiguous(), "index tensors must be contiguous (rows)");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1,
              "query_start_loc must have num_reqs + 1 entries");
  const float* sink_ptr = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat &&
                    sinks->dim() == 1 && sinks->size(0) == query.size(1) && sinks->is_contiguous(),
                "sinks must be a contiguous float32 [Hq] tensor (one logit per query head)");
    sink_ptr = sinks->data_ptr<float>();
  }
  if (query.scalar_type() == at::kFloat) {
    paged::dispatch_cache_dtype<float>(query, kv_cache, block_table, query_start_loc, seq_lens,
                                       scale, out, window, sink_ptr);
  } else if (query.scalar_type() == at::kBFloat16) {
    paged::dispatch_cache_dtype<c10::BFloat16>(query, kv_cache, block_table, query_start_loc,
                                               seq_lens, scale, out, window, sink_ptr);
  } else {
    TORCH_CHECK(false, "dtype ", query.scalar_type(), " is not supported: float32 or bfloat16");
  }
}

}  // namespace deltaserve_cpu
