// Attention of a few query tokens per sequence over a paged KV cache, reading keys and
// values where they lie in the cache: no gathered copy of a sequence's keys is made.
//
// Work is split into tasks of (sequence, run of whole blocks of its keys). For each KV head
// a task scores all of the sequence's query rows of that head against the run's keys (each
// key is read once and converted to float once for all rows), takes a softmax local to the
// run, and accumulates the values the same way; the runs of a sequence are then merged by
// their log-sum-exp. Splitting the keys keeps every thread busy when one long sequence is
// decoded, and a task reads its blocks whole (all heads of a block are contiguous).
// All arithmetic is in float32 whatever the cache's dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// One row of kHeadDim cache values as float32.
template <typename scalar_t, int64_t kHeadDim>
inline void row_to_float(const scalar_t* src, float* dst) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(dst, src, kHeadDim * sizeof(float));
  } else if constexpr (std::is_same_v<scalar_t, double>) {
    for (int64_t i = 0; i < kHeadDim; ++i) dst[i] = static_cast<float>(src[i]);
  } else {
    // bfloat16 or half: one vector of them widens into two of float.
    using ReducedVec = at::vec::Vectorized<scalar_t>;
    static_assert(kHeadDim % ReducedVec::size() == 0, "head size must be whole vectors");
    for (int64_t i = 0; i < kHeadDim; i += ReducedVec::size()) {
      auto [low, high] = at::vec::convert_to_float<scalar_t>(ReducedVec::loadu(src + i));
      low.store(dst + i);
      high.store(dst + i + Vec::size());
    }
  }
}

// acc += weight * row
inline void axpy(float weight, const float* row, float* acc, int64_t n) {
  const Vec w(weight);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    at::vec::fmadd(w, Vec::loadu(row + i), Vec::loadu(acc + i)).store(acc + i);
  }
  for (; i < n; ++i) acc[i] += weight * row[i];
}

constexpr int64_t kMinKeysToParallelize = 4096;  // keys times KV heads

struct Task {
  int64_t sequence;
  int64_t key_start;  // first key of the run
  int64_t key_end;    // one past its last key
  int64_t split;      // index of the run within its sequence
};

template <typename scalar_t, int64_t kHeadDim>
void attend(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& query_start,
            const at::Tensor& seq_lens, double scale, int64_t max_runs, at::Tensor& out) {
  const int64_t num_sequences = seq_lens.size(0);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  constexpr int64_t kLanes = Vec::size();
  constexpr int64_t kChunks = kHeadDim / kLanes;
  constexpr int64_t kScoreVectors = 4;
  static_assert(kHeadDim % kLanes == 0, "head size must be whole vectors");
  const int64_t group = query.size(2);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float* queries = query.data_ptr<float>();
  const scalar_t* keys = key_cache.data_ptr<scalar_t>();
  const scalar_t* values = value_cache.data_ptr<scalar_t>();
  float* output = out.data_ptr<float>();

  // Runs of whole blocks, about eight per thread.
  int64_t total_keys = 0;
  for (int64_t s = 0; s < num_sequences; ++s) total_keys += lens[s];
  const int64_t target_tasks = 8 * at::get_num_threads();
  int64_t run_len = (total_keys + target_tasks - 1) / target_tasks;
  run_len = std::max<int64_t>(run_len, 4 * block_size);
  run_len = (run_len + block_size - 1) / block_size * block_size;
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_sequences; ++s) {
    const int64_t num_runs = std::min<int64_t>(
        max_runs, std::max<int64_t>(1, (lens[s] + run_len - 1) / run_len));
    const int64_t per_run = ((lens[s] + num_runs - 1) / num_runs + block_size - 1)
                            / block_size * block_size;
    for (int64_t r = 0; r < num_runs; ++r) {
      const int64_t begin = r * per_run;
      const int64_t end = std::min(lens[s], begin + per_run);
      if (begin < end) tasks.push_back({s, begin, end, r});
    }
  }
  int64_t num_splits = 1;
  for (const Task& task : tasks) num_splits = std::max(num_splits, task.split + 1);

  // Per (run, query row, head, group member): the run's max score, its sum of
  // exponentials and its unnormalized output.
  const int64_t num_rows = query.size(0);
  const int64_t row_stride = num_kv_heads * group;
  // A row that no run of some split index covers keeps a zero sum there and is skipped.
  std::vector<float> partial_max(num_splits * num_rows * row_stride);
  std::vector<float> partial_sum(num_splits * num_rows * row_stride, 0.0f);
  std::vector<float> partial_out(num_splits * num_rows * row_stride * kHeadDim);
  const float scale_f = static_cast<float>(scale);

  // Waking the other threads costs more than a few thousand keys take: below that, the
  // calling thread does every task.
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t grain = total_keys * num_kv_heads < kMinKeysToParallelize ? num_tasks : 1;
  at::parallel_for(0, num_tasks, grain, [&](int64_t begin, int64_t end) {
    // A tile is kLanes keys: converted to float row by row, then transposed so that one
    // vector holds one coordinate of all its keys, and a query's scores for the whole
    // tile are kHeadDim multiply-adds with no horizontal sums.
    alignas(64) float key_tile[kLanes * kHeadDim];
    alignas(64) float key_tile_t[kHeadDim * kLanes];
    std::vector<float> scaled_query, scores, run_values, maxima, sums, accumulated;
    std::vector<int64_t> row_offsets;
    // A task takes every head of its run of keys: a block's keys of all heads are one
    // contiguous stretch of memory, read whole by one thread.
    for (int64_t index = begin; index < end; ++index) {
      const Task& task = tasks[index];
      for (int64_t head = 0; head < num_kv_heads; ++head) {
        const int64_t first_row = starts[task.sequence];
        const int64_t num_query_rows = starts[task.sequence + 1] - first_row;
        const int64_t seq_len = lens[task.sequence];
        const int64_t run = task.key_end - task.key_start;
        const int64_t num_vectors = num_query_rows * group;
        const int64_t* table = tables + task.sequence * max_blocks;
        // Where each key of the run lies in the cache, walked block by block (a division
        // per key would cost more than the key's arithmetic).
        row_offsets.resize(run);
        for (int64_t t = task.key_start; t < task.key_end;) {
          const int64_t block = table[t / block_size];
          const int64_t offset = t % block_size;
          const int64_t block_end = std::min(task.key_end, t + block_size - offset);
          for (int64_t slot = block * block_size + offset; t < block_end; ++t, ++slot) {
            row_offsets[t - task.key_start] = (slot * num_kv_heads + head) * kHeadDim;
          }
        }
        // Query row i of the sequence sits at position seq_len - num_query_rows + i and
        // sees the keys before and at it: the first `count(i)` keys of this run.
        auto count = [&](int64_t i) {
          return std::min(task.key_end, seq_len - num_query_rows + i + 1) - task.key_start;
        };
        // Padded to whole blocks of kScoreVectors with zeros (their scores are dropped).
        const int64_t padded_vectors =
            (num_vectors + kScoreVectors - 1) / kScoreVectors * kScoreVectors;
        scaled_query.assign(padded_vectors * kHeadDim, 0.0f);
        for (int64_t i = 0; i < num_query_rows; ++i) {
          for (int64_t g = 0; g < group; ++g) {
            const float* q =
                queries + (((first_row + i) * num_kv_heads + head) * group + g) * kHeadDim;
            float* dst = scaled_query.data() + (i * group + g) * kHeadDim;
            for (int64_t d = 0; d < kHeadDim; ++d) dst[d] = q[d] * scale_f;
          }
        }

        scores.resize(num_vectors * run);
        for (int64_t tile_start = task.key_start; tile_start < task.key_end; tile_start += kLanes) {
          const int64_t tile_keys = std::min<int64_t>(kLanes, task.key_end - tile_start);
          for (int64_t k = 0; k < tile_keys; ++k) {
            row_to_float<scalar_t, kHeadDim>(keys + row_offsets[tile_start + k - task.key_start],
                                             key_tile + k * kHeadDim);
          }
          at::vec::transpose_mxn<float>(key_tile, kHeadDim, key_tile_t, kLanes,
                                        static_cast<int>(tile_keys), static_cast<int>(kHeadDim));
          // Four query vectors at a time, each with two partial sums: eight independent
          // chains of multiply-adds sharing each load of the tile (one chain would wait
          // on its own latency at every step).
          for (int64_t v0 = 0; v0 < num_vectors; v0 += kScoreVectors) {
            const float* q = scaled_query.data() + v0 * kHeadDim;
            Vec even[kScoreVectors], odd[kScoreVectors];
            for (int64_t u = 0; u < kScoreVectors; ++u) even[u] = odd[u] = Vec(0.0f);
            for (int64_t d = 0; d < kHeadDim; d += 2) {
              const Vec coordinate = Vec::loadu(key_tile_t + d * kLanes);
              const Vec next = Vec::loadu(key_tile_t + (d + 1) * kLanes);
              for (int64_t u = 0; u < kScoreVectors; ++u) {
                even[u] = at::vec::fmadd(Vec(q[u * kHeadDim + d]), coordinate, even[u]);
                odd[u] = at::vec::fmadd(Vec(q[u * kHeadDim + d + 1]), next, odd[u]);
              }
            }
            const int64_t num_here = std::min<int64_t>(kScoreVectors, num_vectors - v0);
            for (int64_t u = 0; u < num_here; ++u) {
              (even[u] + odd[u]).store(scores.data() + (v0 + u) * run + tile_start - task.key_start,
                                       static_cast<int>(tile_keys));
            }
          }
        }

        maxima.assign(num_vectors, -std::numeric_limits<float>::infinity());
        sums.assign(num_vectors, 0.0f);
        for (int64_t i = 0; i < num_query_rows; ++i) {
          const int64_t visible = count(i);
          if (visible <= 0) continue;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t v = i * group + g;
            float* row_scores = scores.data() + v * run;
            const float maximum = at::vec::reduce_all<float>(
                [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, row_scores, visible);
            at::vec::map([maximum](Vec x) { return (x - Vec(maximum)).exp_u20(); },
                         row_scores, row_scores, visible);
            maxima[v] = maximum;
            sums[v] = at::vec::reduce_all<float>(
                [](Vec& x, Vec& y) { return x + y; }, row_scores, visible);
          }
        }

        run_values.resize(run * kHeadDim);
        for (int64_t t = 0; t < run; ++t) {
          row_to_float<scalar_t, kHeadDim>(values + row_offsets[t],
                                           run_values.data() + t * kHeadDim);
        }
        accumulated.assign(num_vectors * kHeadDim, 0.0f);
        // Per query row (its vectors see the same keys), up to kScoreVectors of its group's
        // vectors at a time share each row of values. A short last pass repeats a vector
        // rather than branching in the loop, and stores only the real ones.
        for (int64_t i = 0; i < num_query_rows; ++i) {
          const int64_t visible = count(i);
          for (int64_t g0 = 0; g0 < group; g0 += kScoreVectors) {
            const int64_t num_here = std::min<int64_t>(kScoreVectors, group - g0);
            const float* weights[kScoreVectors];
            for (int64_t u = 0; u < kScoreVectors; ++u) {
              weights[u] = scores.data() + (i * group + g0 + std::min(u, num_here - 1)) * run;
            }
            // One vector-width of the output at a time, so the accumulators (one per query
            // vector and parity of key) stay in registers.
            for (int64_t c = 0; c < kChunks; ++c) {
              Vec even[kScoreVectors], odd[kScoreVectors];
              for (int64_t u = 0; u < kScoreVectors; ++u) even[u] = odd[u] = Vec(0.0f);
              const float* column = run_values.data() + c * kLanes;
              int64_t t = 0;
              for (; t + 1 < visible; t += 2) {
                const Vec value = Vec::loadu(column + t * kHeadDim);
                const Vec next = Vec::loadu(column + (t + 1) * kHeadDim);
                for (int64_t u = 0; u < kScoreVectors; ++u) {
                  even[u] = at::vec::fmadd(Vec(weights[u][t]), value, even[u]);
                  odd[u] = at::vec::fmadd(Vec(weights[u][t + 1]), next, odd[u]);
                }
              }
              if (t < visible) {
                const Vec value = Vec::loadu(column + t * kHeadDim);
                for (int64_t u = 0; u < kScoreVectors; ++u) {
                  even[u] = at::vec::fmadd(Vec(weights[u][t]), value, even[u]);
                }
              }
              for (int64_t u = 0; u < num_here; ++u) {
                (even[u] + odd[u]).store(
                    accumulated.data() + (i * group + g0 + u) * kHeadDim + c * kLanes);
              }
            }
          }
        }

        const int64_t partial_base = task.split * num_rows * row_stride;
        for (int64_t i = 0; i < num_query_rows; ++i) {
          for (int64_t g = 0; g < group; ++g) {
            const int64_t v = i * group + g;
            const int64_t at = partial_base + ((first_row + i) * num_kv_heads + head) * group + g;
            partial_max[at] = maxima[v];
            partial_sum[at] = sums[v];
            std::memcpy(partial_out.data() + at * kHeadDim, accumulated.data() + v * kHeadDim,
                        kHeadDim * sizeof(float));
          }
        }
      }
    }
  });

  // Merge each output vector's runs: weights exp(run max - overall max).
  at::parallel_for(0, num_rows * row_stride, 256, [&](int64_t begin, int64_t end) {
    for (int64_t at = begin; at < end; ++at) {
      float maximum = -std::numeric_limits<float>::infinity();
      for (int64_t r = 0; r < num_splits; ++r) {
        const int64_t index = r * num_rows * row_stride + at;
        if (partial_sum[index] != 0.0f) maximum = std::max(maximum, partial_max[index]);
      }
      float* dst = output + at * kHeadDim;
      std::fill(dst, dst + kHeadDim, 0.0f);
      float total = 0.0f;
      for (int64_t r = 0; r < num_splits; ++r) {
        const int64_t index = r * num_rows * row_stride + at;
        if (partial_sum[index] == 0.0f) continue;  // a run this row does not see
        const float weight = std::exp(partial_max[index] - maximum);
        total += weight * partial_sum[index];
        axpy(weight, partial_out.data() + index * kHeadDim, dst, kHeadDim);
      }
      const float inverse = 1.0f / total;
      for (int64_t d = 0; d < kHeadDim; ++d) dst[d] *= inverse;
    }
  });
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& query_start, const at::Tensor& seq_lens,
                           double scale) {
  TORCH_CHECK(query.dim() == 4 && query.scalar_type() == at::kFloat && query.is_contiguous(),
              "query must be a contiguous float32 [rows, kv_heads, group, head_dim] tensor");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "key and value caches must be contiguous [blocks, block_size, kv_heads, "
              "head_dim] tensors of one shape and dtype");
  TORCH_CHECK(query.size(1) == key_cache.size(2) && query.size(3) == key_cache.size(3),
              "query heads and head size must match the cache's");
  TORCH_CHECK(key_cache.size(3) == 64 || key_cache.size(3) == 128,
              "head size must be 64 or 128, got ", key_cache.size(3));
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong &&
                  block_tables.is_contiguous(),
              "block_tables must be a contiguous int64 [sequences, max_blocks] tensor");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.size(0) == block_tables.size(0) && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int64 tensor with one length per block table");
  TORCH_CHECK(query_start.dim() == 1 && query_start.scalar_type() == at::kLong &&
                  query_start.size(0) == seq_lens.size(0) + 1 && query_start.is_contiguous(),
              "query_start must be a contiguous int64 tensor of sequences + 1 offsets");
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t block_size = key_cache.size(1);
  for (int64_t s = 0; s < seq_lens.size(0); ++s) {
    const int64_t num_query_rows = starts[s + 1] - starts[s];
    TORCH_CHECK(num_query_rows >= 1 && lens[s] >= num_query_rows &&
                    lens[s] <= block_tables.size(1) * block_size,
                "sequence ", s, " has ", num_query_rows, " query rows and ", lens[s],
                " keys: every sequence needs a query row, at least as many keys as query "
                "rows, and blocks for all of its keys");
  }
  TORCH_CHECK(starts[0] == 0 && starts[seq_lens.size(0)] == query.size(0),
              "query_start must run from 0 to the number of query rows");
  // Every block id a task will read must be inside the cache.
  const int64_t num_blocks = key_cache.size(0);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t s = 0; s < seq_lens.size(0); ++s) {
    const int64_t needed = (lens[s] + block_size - 1) / block_size;
    for (int64_t b = 0; b < needed; ++b) {
      const int64_t block = tables[s * block_tables.size(1) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " is outside the cache");
    }
  }
  auto out = at::empty(query.sizes(), query.options());
  const int64_t max_runs = 4 * at::get_num_threads();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_cache.scalar_type(),
                                  "paged_attention", [&] {
    if (key_cache.size(3) == 64) {
      attend<scalar_t, 64>(query, key_cache, value_cache, block_tables, query_start,
                           seq_lens, scale, max_runs, out);
    } else {
      attend<scalar_t, 128>(query, key_cache, value_cache, block_tables, query_start,
                            seq_lens, scale, max_runs, out);
    }
  });
  return out;
}

// Registered with PyTorch's dispatcher, so that compiled graphs call it without going
// through Python.
TORCH_LIBRARY(prefixcache, m) {
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor query_start, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
