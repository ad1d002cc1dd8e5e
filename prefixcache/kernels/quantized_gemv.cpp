// Weight-only quantized matmuls of a few activation rows (decode steps), AVX-512 VNNI.
//
// Both kernels quantize the activations first: each row, in blocks of 32 inputs, is rounded
// to integers v (|v| <= kMaxActivation, 15 bits) with the block's scale
// max|x| / kMaxActivation, once per call for all weights. Each v is split into two signed
// bytes, v = 128 * high + low (low in -64..63), because the products are integer dot
// products of 4 inputs at a time (`vpdpbusd`: unsigned 8-bit weights times signed 8-bit
// activations, summed into 32-bit lanes): one sum for the high bytes, one for the low,
// joined exactly in integers and scaled to float once per block of 32 inputs. (Plain int8
// activations, as llama.cpp uses, halve the dot products but move the default model's
// logits by up to 1.5.)
//
// Weight layouts (built once, by quantized_gemv.py): output rows in tiles of 16, one per
// vector lane. For each tile, the 32-input blocks follow one another:
// - int4, 320 bytes per block: 4 chunks of 64 bytes covering 8 inputs each (lane l, byte j:
//   input 8c + j of row l in the low nibble, input 8c + 4 + j in the high nibble); then the
//   block's 16 scales d and 16 minimums m as float16. The weight is d * q + m (GGUF Q4_1).
// - int8, 512 bytes per block: 8 chunks of 64 bytes covering 4 inputs each (lane l, byte j:
//   input 4c + j of row l), stored as q + 128 (0..255). One float32 scale per output row.
//
// Work is split over output tiles with at::parallel_for (OpenMP).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTileRows = 16;
constexpr int64_t kBlock = 32;
constexpr int64_t kInt4BlockBytes = 320;
constexpr int64_t kInt8BlockBytes = 512;
constexpr int64_t kMaxRows = 8;
// |v| <= 127 * 128, so that the high byte of v stays within -127..127.
constexpr float kMaxActivation = 16256.0f;
// Weights are prefetched this many blocks ahead: the hardware prefetcher alone leaves a
// single row waiting on memory.
constexpr int64_t kPrefetchBlocks = 12;
// Enough weights per task that a thread's share outweighs waking it.
constexpr int64_t kMinWeightsPerTask = 64 * 1024;

#define PREFIXCACHE_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

// The activations of a call, rounded per block of 32 inputs.
struct QuantizedRows {
  int64_t num_rows = 0;
  int64_t num_blocks = 0;
  std::vector<int8_t> high;       // [rows, blocks * 32]: (v + 64) >> 7, zero past the inputs
  std::vector<int8_t> low;        // [rows, blocks * 32]: v - 128 * high
  std::vector<float> scales;      // [rows, blocks]: max|x| / kMaxActivation
  std::vector<float> sums;        // [rows, blocks]: scale * sum of the block's v
  std::vector<int32_t> int_sums;  // [rows, blocks]: sum of the block's v
};

template <typename scalar_t>
QuantizedRows quantize_rows(const at::Tensor& x, int64_t num_blocks) {
  QuantizedRows rows;
  rows.num_rows = x.size(0);
  rows.num_blocks = num_blocks;
  const int64_t in_features = x.size(1);
  const int64_t padded = num_blocks * kBlock;
  rows.high.assign(rows.num_rows * padded, 0);
  rows.low.assign(rows.num_rows * padded, 0);
  rows.scales.assign(rows.num_rows * num_blocks, 0.0f);
  rows.sums.assign(rows.num_rows * num_blocks, 0.0f);
  rows.int_sums.assign(rows.num_rows * num_blocks, 0);
  const scalar_t* data = x.data_ptr<scalar_t>();
  float block[kBlock];
  for (int64_t r = 0; r < rows.num_rows; ++r) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t start = b * kBlock;
      const int64_t count = std::min(kBlock, in_features - start);
      float amax = 0.0f;
      for (int64_t i = 0; i < count; ++i) {
        block[i] = static_cast<float>(data[r * in_features + start + i]);
        amax = std::max(amax, std::fabs(block[i]));
      }
      if (amax == 0.0f) continue;  // all zero: integers, scale and sums stay 0
      const float scale = amax / kMaxActivation;
      int32_t sum = 0;
      for (int64_t i = 0; i < count; ++i) {
        // Division (not a reciprocal) and round-half-even, as the tests' reference does.
        const float q = std::nearbyint(block[i] / scale);
        const int32_t value = static_cast<int32_t>(
            std::max(-kMaxActivation, std::min(kMaxActivation, q)));
        const int32_t high = (value + 64) >> 7;  // arithmetic shift: floor
        rows.high[r * padded + start + i] = static_cast<int8_t>(high);
        rows.low[r * padded + start + i] = static_cast<int8_t>(value - 128 * high);
        sum += value;
      }
      rows.scales[r * num_blocks + b] = scale;
      rows.int_sums[r * num_blocks + b] = sum;
      rows.sums[r * num_blocks + b] = scale * static_cast<float>(sum);
    }
  }
  return rows;
}

// The 4 activation bytes of inputs 4 * word .. 4 * word + 3, in every lane.
PREFIXCACHE_VNNI inline __m512i broadcast_word(const int8_t* row, int64_t word) {
  int32_t value;
  std::memcpy(&value, row + 4 * word, sizeof(value));
  return _mm512_set1_epi32(value);
}

// Asks for the cache lines of `bytes` at `data`; past the end of the weights the hint is
// ignored (prefetches do not fault).
inline void prefetch(const uint8_t* data, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(data + offset), _MM_HINT_T0);
  }
}

// 128 * high_sum + low_sum: the dot products with the whole activations.
PREFIXCACHE_VNNI inline __m512i join(__m512i high_sum, __m512i low_sum) {
  return _mm512_add_epi32(_mm512_slli_epi32(high_sum, 7), low_sum);
}

template <typename out_t>
inline void store_tile(const float* values, out_t* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<out_t>(values[i]);
}

// One tile of 16 output rows for kRows activation rows.
template <int kRows, typename out_t>
PREFIXCACHE_VNNI void int4_tile(const uint8_t* tile, const QuantizedRows& x, out_t* out,
                                int64_t out_stride, int64_t num_valid) {
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  const int64_t padded = x.num_blocks * kBlock;
  __m512 scaled[kRows];
  __m512 offsets[kRows];
  for (int r = 0; r < kRows; ++r) {
    scaled[r] = _mm512_setzero_ps();
    offsets[r] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < x.num_blocks; ++b) {
    const uint8_t* block = tile + b * kInt4BlockBytes;
    prefetch(block + kPrefetchBlocks * kInt4BlockBytes, kInt4BlockBytes);
    __m512i low[4];
    __m512i high[4];
    for (int c = 0; c < 4; ++c) {
      const __m512i packed = _mm512_loadu_si512(block + 64 * c);
      low[c] = _mm512_and_si512(packed, low_mask);
      high[c] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_mask);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(block + 256)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(block + 288)));
    for (int r = 0; r < kRows; ++r) {
      const int8_t* high_row = x.high.data() + r * padded + b * kBlock;
      const int8_t* low_row = x.low.data() + r * padded + b * kBlock;
      __m512i high_sum = _mm512_setzero_si512();
      __m512i low_sum = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        high_sum = _mm512_dpbusd_epi32(high_sum, low[c], broadcast_word(high_row, 2 * c));
        low_sum = _mm512_dpbusd_epi32(low_sum, low[c], broadcast_word(low_row, 2 * c));
        high_sum = _mm512_dpbusd_epi32(high_sum, high[c], broadcast_word(high_row, 2 * c + 1));
        low_sum = _mm512_dpbusd_epi32(low_sum, high[c], broadcast_word(low_row, 2 * c + 1));
      }
      const __m512 dot = _mm512_cvtepi32_ps(join(high_sum, low_sum));
      const int64_t at = r * x.num_blocks + b;
      scaled[r] = _mm512_fmadd_ps(_mm512_mul_ps(dot, d), _mm512_set1_ps(x.scales[at]),
                                  scaled[r]);
      offsets[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sums[at]), offsets[r]);
    }
  }
  alignas(64) float result[kTileRows];
  for (int r = 0; r < kRows; ++r) {
    _mm512_store_ps(result, _mm512_add_ps(scaled[r], offsets[r]));
    store_tile(result, out + r * out_stride, num_valid);
  }
}

template <int kRows, typename out_t>
PREFIXCACHE_VNNI void int8_tile(const uint8_t* tile, const float* row_scales,
                                const QuantizedRows& x, out_t* out, int64_t out_stride,
                                int64_t num_valid) {
  const int64_t padded = x.num_blocks * kBlock;
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.num_blocks; ++b) {
    const uint8_t* block = tile + b * kInt8BlockBytes;
    prefetch(block + kPrefetchBlocks * kInt8BlockBytes, kInt8BlockBytes);
    __m512i w[8];
    for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512(block + 64 * c);
    for (int r = 0; r < kRows; ++r) {
      const int8_t* high_row = x.high.data() + r * padded + b * kBlock;
      const int8_t* low_row = x.low.data() + r * padded + b * kBlock;
      const int64_t at = r * x.num_blocks + b;
      __m512i high_sum = _mm512_setzero_si512();
      // The weights are stored as q + 128: take 128 * (sum of the activations) back out,
      // exactly, in integers.
      __m512i low_sum = _mm512_set1_epi32(-128 * x.int_sums[at]);
      for (int c = 0; c < 8; ++c) {
        high_sum = _mm512_dpbusd_epi32(high_sum, w[c], broadcast_word(high_row, c));
        low_sum = _mm512_dpbusd_epi32(low_sum, w[c], broadcast_word(low_row, c));
      }
      const __m512 dot = _mm512_cvtepi32_ps(join(high_sum, low_sum));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_set1_ps(x.scales[at]), acc[r]);
    }
  }
  const __m512 scales = _mm512_loadu_ps(row_scales);
  alignas(64) float result[kTileRows];
  for (int r = 0; r < kRows; ++r) {
    _mm512_store_ps(result, _mm512_mul_ps(acc[r], scales));
    store_tile(result, out + r * out_stride, num_valid);
  }
}

// Calls `tile_fn(std::integral_constant<int, kRows>)` with the compiled row count for
// 1..kMaxRows activation rows.
template <typename TileFn>
void for_row_groups(int64_t num_rows, TileFn&& tile_fn) {
  switch (num_rows) {
    case 1: tile_fn(std::integral_constant<int, 1>{}); break;
    case 2: tile_fn(std::integral_constant<int, 2>{}); break;
    case 3: tile_fn(std::integral_constant<int, 3>{}); break;
    case 4: tile_fn(std::integral_constant<int, 4>{}); break;
    case 5: tile_fn(std::integral_constant<int, 5>{}); break;
    case 6: tile_fn(std::integral_constant<int, 6>{}); break;
    case 7: tile_fn(std::integral_constant<int, 7>{}); break;
    default: tile_fn(std::integral_constant<int, 8>{}); break;
  }
}

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

void check_common(const at::Tensor& x, const at::Tensor& packed, int64_t block_bytes,
                  int64_t out_features, const char* name) {
  TORCH_CHECK(cpu_has_vnni(), name, " needs a CPU with AVX-512 VNNI");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), name, " runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2, name, ": x must be [rows, in_features], got ", x.dim(), " dims");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              name, ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(0) >= 1, name, ": x needs at least one row");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte &&
                  packed.size(2) == block_bytes && packed.is_contiguous(),
              name, ": packed weights must be a contiguous uint8 [tiles, blocks, ",
              block_bytes, "] tensor");
  TORCH_CHECK(out_features >= 1 && out_features <= packed.size(0) * kTileRows &&
                  out_features > (packed.size(0) - 1) * kTileRows,
              name, ": out_features ", out_features, " does not match ", packed.size(0),
              " tiles of ", kTileRows, " rows");
}

// A view of `rows` holding rows start .. start + count - 1 only.
QuantizedRows row_slice(const QuantizedRows& rows, int64_t start, int64_t count) {
  QuantizedRows slice;
  slice.num_rows = count;
  slice.num_blocks = rows.num_blocks;
  const int64_t padded = rows.num_blocks * kBlock;
  slice.high.assign(rows.high.begin() + start * padded,
                    rows.high.begin() + (start + count) * padded);
  slice.low.assign(rows.low.begin() + start * padded,
                   rows.low.begin() + (start + count) * padded);
  const auto per_row = [&](const auto& v) {
    using T = typename std::decay_t<decltype(v)>::value_type;
    return std::vector<T>(v.begin() + start * rows.num_blocks,
                          v.begin() + (start + count) * rows.num_blocks);
  };
  slice.scales = per_row(rows.scales);
  slice.sums = per_row(rows.sums);
  slice.int_sums = per_row(rows.int_sums);
  return slice;
}

// Splits the activation rows into groups of at most kMaxRows (each group reads the
// weights once) and calls `tile_call(rows_constant, group, tile_out, tile_index,
// num_valid_rows)` for every tile.
template <typename out_t, typename TileCall>
void over_groups_and_tiles(const QuantizedRows& rows, out_t* out, int64_t out_features,
                           int64_t num_tiles, int64_t grain, TileCall&& tile_call) {
  for (int64_t start = 0; start < rows.num_rows; start += kMaxRows) {
    const int64_t count = std::min(kMaxRows, rows.num_rows - start);
    // Steps of up to kMaxRows rows (every decode step) use `rows` as it is, uncopied.
    QuantizedRows slice;
    if (count != rows.num_rows) slice = row_slice(rows, start, count);
    const QuantizedRows& group = count == rows.num_rows ? rows : slice;
    out_t* group_out = out + start * out_features;
    for_row_groups(count, [&](auto rows_constant) {
      at::parallel_for(0, num_tiles, grain, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t num_valid = std::min(kTileRows, out_features - t * kTileRows);
          tile_call(rows_constant, group, group_out + t * kTileRows, t, num_valid);
        }
      });
    });
  }
}

// Rounds x's rows, then computes every tile of the output with
// `tile_call(rows_constant, group, tile_out, tile_index, num_valid_rows)`.
template <typename TileCall>
at::Tensor run(const at::Tensor& x_in, const at::Tensor& packed, int64_t out_features,
               TileCall&& tile_call) {
  const at::Tensor x = x_in.contiguous();
  const int64_t num_tiles = packed.size(0);
  const int64_t num_blocks = packed.size(1);
  auto out = at::empty({x.size(0), out_features}, x.options());
  const int64_t weights_per_tile = kTileRows * num_blocks * kBlock;
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask / weights_per_tile);
  const auto compute = [&](auto* dtype_tag) {
    using scalar_t = std::remove_pointer_t<decltype(dtype_tag)>;
    const QuantizedRows rows = quantize_rows<scalar_t>(x, num_blocks);
    over_groups_and_tiles(rows, out.data_ptr<scalar_t>(), out_features, num_tiles, grain,
                          tile_call);
  };
  if (x.scalar_type() == at::kFloat) {
    compute(static_cast<float*>(nullptr));
  } else {
    compute(static_cast<at::BFloat16*>(nullptr));
  }
  return out;
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  check_common(x, packed, kInt4BlockBytes, out_features, "int4_gemv");
  TORCH_CHECK(x.size(1) == packed.size(1) * kBlock, "int4_gemv: x has ", x.size(1),
              " inputs, the weights ", packed.size(1) * kBlock);
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  const int64_t tile_bytes = packed.size(1) * kInt4BlockBytes;
  return run(x, packed, out_features,
             [&](auto rows_constant, const QuantizedRows& group, auto* tile_out, int64_t t,
                 int64_t num_valid) {
               int4_tile<decltype(rows_constant)::value>(weights + t * tile_bytes, group,
                                                         tile_out, out_features, num_valid);
             });
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& packed,
                     const at::Tensor& row_scales, int64_t out_features) {
  check_common(x, packed, kInt8BlockBytes, out_features, "int8_gemv");
  TORCH_CHECK(x.size(1) >= 1 && x.size(1) <= packed.size(1) * kBlock &&
                  x.size(1) > (packed.size(1) - 1) * kBlock,
              "int8_gemv: x has ", x.size(1), " inputs, the weights ",
              packed.size(1) * kBlock, " (padded to blocks of ", kBlock, ")");
  TORCH_CHECK(row_scales.dim() == 1 && row_scales.scalar_type() == at::kFloat &&
                  row_scales.is_contiguous() && row_scales.size(0) == packed.size(0) * kTileRows,
              "int8_gemv: row_scales must be a contiguous float32 tensor of ",
              packed.size(0) * kTileRows, " scales");
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  const float* scales = row_scales.data_ptr<float>();
  const int64_t tile_bytes = packed.size(1) * kInt8BlockBytes;
  return run(x, packed, out_features,
             [&](auto rows_constant, const QuantizedRows& group, auto* tile_out, int64_t t,
                 int64_t num_valid) {
               int8_tile<decltype(rows_constant)::value>(weights + t * tile_bytes,
                                                         scales + t * kTileRows, group,
                                                         tile_out, out_features, num_valid);
             });
}

}  // namespace

// A fragment: the `prefixcache` library itself is declared by paged_attention.cpp.
TORCH_LIBRARY_FRAGMENT(prefixcache, m) {
  m.def("int4_gemv(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("int8_gemv(Tensor x, Tensor packed, Tensor row_scales, int out_features) -> Tensor");
  m.def("quantized_gemv_supported() -> bool", &cpu_has_vnni);
}

TORCH_LIBRARY_IMPL(prefixcache, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int8_gemv", &int8_gemv);
}
