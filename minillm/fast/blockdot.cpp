// y = x W^T for a GGUF file's own Q4_1 and Q8_0 blocks, with int8 activations: llama.cpp's recipe.
//
// Per block of 32 inputs the activation row is rounded to int8 with one scale (dx = max|x| / 127), so a
// block's dot product is integer arithmetic: 4 products of a u8 weight and an s8 input summed per 32-bit
// lane by one instruction (AVX-512 VNNI's vpdpbusd; on AVX2, vpmaddubsw + vpmaddwd), then one float multiply
// by the block's scales.
//   Q4_1: weight = d q + m, q in 0..15:  block sum = d dx (q . qx) + m dx sum(qx)
//   Q8_0: weight = d q,     q in -127..127:  block sum = d dx (|q| . (qx signed as q))
//
// The weights are repacked once (minillm/fast/blockdot.py) so that the 16 lanes of a vector are 16 output
// rows: for a group of 16 rows and a block, byte 4 r + t of chunk j holds row r's input 4 j + t (Q8_0,
// int8: 8 chunks of 64 bytes); a Q4_1 chunk holds input 4 j + t in its low nibble and 4 (j + 4) + t in its high
// one (4 chunks). Scales sit beside them as float16: (groups, blocks, 2, 16) d then m for Q4_1,
// (groups, blocks, 1, 16) d for Q8_0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;  // inputs per scale
constexpr int64_t ROWS = 16;   // output rows a group

#if defined(__AVX512VNNI__)
using ivec = __m512i;  // 16 rows a vector
using fvec = __m512;
constexpr int64_t LANES = 16;
inline ivec load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline ivec nibbles_low(ivec v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
inline ivec nibbles_high(ivec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
inline ivec quad(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
inline ivec dot4(ivec acc, ivec u8, ivec s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
inline ivec dot4_signed(ivec acc, ivec w, ivec x) {  // w . x as |w| . (x with w's sign)
  return dot4(acc, _mm512_abs_epi8(w), _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x));
}
inline ivec izero() { return _mm512_setzero_si512(); }
inline ivec add(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
inline fvec halfs(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline fvec fzero() { return _mm512_setzero_ps(); }
inline fvec fma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline fvec mul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
inline fvec add(fvec a, fvec b) { return _mm512_add_ps(a, b); }
inline fvec splat(float v) { return _mm512_set1_ps(v); }
inline fvec to_float(ivec v) { return _mm512_cvtepi32_ps(v); }
inline void store(float* p, fvec v) { _mm512_storeu_ps(p, v); }
inline fvec loadf(const float* p) { return _mm512_loadu_ps(p); }
inline fvec vmax(fvec a, fvec b) { return _mm512_max_ps(a, b); }
inline fvec vabs(fvec v) { return _mm512_abs_ps(v); }
inline float hmax(fvec v) { return _mm512_reduce_max_ps(v); }
inline ivec round_int(fvec v) { return _mm512_cvtps_epi32(v); }  // to nearest, ties to even
inline int32_t hsum(ivec v) { return _mm512_reduce_add_epi32(v); }
inline void store_int8(int8_t* p, ivec v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(v)); }
#else  // AVX2: 8 rows a vector, a group in two halves
using ivec = __m256i;
using fvec = __m256;
constexpr int64_t LANES = 8;
inline ivec load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline ivec nibbles_low(ivec v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline ivec nibbles_high(ivec v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
inline ivec quad(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
inline ivec dot4(ivec acc, ivec u8, ivec s8) {  // pairs summed in int16: exact while u8 <= 127 and |s8| <= 127
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
}
inline ivec dot4_signed(ivec acc, ivec w, ivec x) { return dot4(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }
inline ivec izero() { return _mm256_setzero_si256(); }
inline ivec add(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
inline fvec halfs(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline fvec fzero() { return _mm256_setzero_ps(); }
inline fvec fma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline fvec mul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
inline fvec add(fvec a, fvec b) { return _mm256_add_ps(a, b); }
inline fvec splat(float v) { return _mm256_set1_ps(v); }
inline fvec to_float(ivec v) { return _mm256_cvtepi32_ps(v); }
inline void store(float* p, fvec v) { _mm256_storeu_ps(p, v); }
inline fvec loadf(const float* p) { return _mm256_loadu_ps(p); }
inline fvec vmax(fvec a, fvec b) { return _mm256_max_ps(a, b); }
inline fvec vabs(fvec v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }
inline float hmax(fvec v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline ivec round_int(fvec v) { return _mm256_cvtps_epi32(v); }  // to nearest, ties to even
inline int32_t hsum(ivec v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}
inline void store_int8(int8_t* p, ivec v) {  // 8 int32 in -127..127 -> 8 bytes
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(words, words));
}
#endif

// x (K,) -> qx (K,) int8 in -127..127, and per block its scale dx and dx sum(qx): the sum of the rounded x,
// not of x, so that the rounding errors e meet Q4_1's weight d q + m, which is centred, and not d q alone:
// d dx (q . qx) + m dx sum(qx) = w . x + w . e, while m sum(x) in its place would leave d q . e.
void quantize_row(const float* x, int64_t K, int8_t* qx, float* dx, float* xsum) {
  constexpr int64_t V = BLOCK / LANES;  // vectors a block: 2 (AVX-512) or 4 (AVX2)
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    fvec v[V], amax = fzero();
    for (int64_t i = 0; i < V; ++i) {
      v[i] = loadf(x + b * BLOCK + i * LANES);
      amax = vmax(amax, vabs(v[i]));
    }
    const float d = hmax(amax) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    ivec sum = izero();
    for (int64_t i = 0; i < V; ++i) {
      const ivec q = round_int(mul(v[i], splat(inv)));
      store_int8(qx + b * BLOCK + i * LANES, q);
      sum = add(sum, q);
    }
    dx[b] = d;
    xsum[b] = d * static_cast<float>(hsum(sum));
  }
}

constexpr int64_t HALVES = ROWS / LANES;       // vectors a group: 1 (AVX-512) or 2 (AVX2)
constexpr int64_t CHUNK = 4 * ROWS;            // bytes of one chunk: 4 inputs of 16 rows
constexpr int64_t PART = 4 * LANES;            // bytes of a chunk one vector holds

// One group of 16 output rows for one activation row: y[0:16] = the rows' dot products with x.
template <bool Q4>
void group_dot(const uint8_t* w, const at::Half* scales, const int8_t* qx, const float* dx, const float* xsum,
               int64_t blocks, float* y) {
  constexpr int64_t chunks = Q4 ? 4 : 8, per_block = Q4 ? 2 : 1;
  for (int64_t h = 0; h < HALVES; ++h) {
    fvec acc = fzero(), acc_m = fzero();  // two chains of multiply-adds, so that they overlap
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = w + b * chunks * CHUNK + h * PART;
      const int8_t* xb = qx + b * BLOCK;
      ivec lo = izero(), hi = izero();  // two chains, so the adds overlap
      if constexpr (Q4) {
        for (int64_t j = 0; j < 4; ++j) {
          const ivec v = load(blk + j * CHUNK);
          lo = dot4(lo, nibbles_low(v), quad(xb + 4 * j));
          hi = dot4(hi, nibbles_high(v), quad(xb + 4 * (j + 4)));
        }
      } else {
        for (int64_t j = 0; j < 8; j += 2) {
          lo = dot4_signed(lo, load(blk + j * CHUNK), quad(xb + 4 * j));
          hi = dot4_signed(hi, load(blk + (j + 1) * CHUNK), quad(xb + 4 * (j + 1)));
        }
      }
      const ivec sum = add(lo, hi);
      const at::Half* s = scales + b * per_block * ROWS + h * LANES;
      acc = fma(to_float(sum), mul(halfs(s), splat(dx[b])), acc);  // d dx (q . qx)
      if constexpr (Q4) acc_m = fma(halfs(s + ROWS), splat(xsum[b]), acc_m);  // + m dx sum(qx)
    }
    store(y + h * LANES, add(acc, acc_m));
  }
}

template <bool Q4>
void block_mm_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, const at::Half* s, int64_t groups,
                   int64_t out_features, float* y) {
  const int64_t blocks = K / BLOCK, w_stride = blocks * (Q4 ? 4 : 8) * CHUNK, s_stride = blocks * (Q4 ? 2 : 1) * ROWS;
  std::vector<int8_t> qx(M * K);  // the activations as int8, and per block their scale and sum
  std::vector<float> dx(M * blocks), xsum(M * blocks);
  for (int64_t i = 0; i < M; ++i) {
    quantize_row(x + i * K, K, qx.data() + i * K, dx.data() + i * blocks, xsum.data() + i * blocks);
  }
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    float out[ROWS];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t rows = std::min(ROWS, out_features - g * ROWS);
      for (int64_t i = 0; i < M; ++i) {  // a group's weights stay in cache across the rows of x
        group_dot<Q4>(w + g * w_stride, s + g * s_stride, qx.data() + i * K, dx.data() + i * blocks,
                      xsum.data() + i * blocks, blocks, out);
        std::copy(out, out + rows, y + i * out_features + g * ROWS);
      }
    }
  });
}

// x (..., K) -> y (..., out_features): every row of x times the weight.
template <bool Q4>
at::Tensor block_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, int64_t out_features) {
  const int64_t chunks = Q4 ? 4 : 8, per_block = Q4 ? 2 : 1;
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 3 && scales.dim() == 4, "block_mm: x (..., K), weight (G, B, bytes), "
              "scales (G, B, ", per_block, ", 16)");
  const int64_t K = x.size(-1), M = x.numel() / std::max<int64_t>(K, 1), groups = weight.size(0),
                blocks = weight.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.size(2) == chunks * CHUNK,
              "block_mm: weight must be contiguous uint8 (G, B, ", chunks * CHUNK, ")");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.size(0) == groups &&
              scales.size(1) == blocks && scales.size(2) == per_block && scales.size(3) == ROWS,
              "block_mm: scales must be contiguous float16 (G, B, ", per_block, ", 16)");
  TORCH_CHECK(K == blocks * BLOCK, "block_mm: x has ", K, " inputs, the weight ", blocks * BLOCK);
  TORCH_CHECK(out_features > (groups - 1) * ROWS && out_features <= groups * ROWS, "block_mm: out_features ",
              out_features, " does not fit ", groups, " groups of ", ROWS, " rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "block_mm: x must be float32 or bfloat16, got ", x.scalar_type());
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // bfloat16 in: rounded to int8 from float32 all the same
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out_features;
  at::Tensor y = at::empty(shape, xf.options());
  block_mm_rows<Q4>(xf.data_ptr<float>(), M, K, weight.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), groups,
                    out_features, y.data_ptr<float>());
  return y.to(x.scalar_type());
}

at::Tensor q4_1_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, int64_t out_features) {
  return block_mm<true>(x, weight, scales, out_features);
}

at::Tensor q8_0_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, int64_t out_features) {
  return block_mm<false>(x, weight, scales, out_features);
}

}  // namespace

TORCH_LIBRARY(minillm, m) {
  m.def("q4_1_mm(Tensor x, Tensor weight, Tensor scales, int out_features) -> Tensor");
  m.def("q8_0_mm(Tensor x, Tensor weight, Tensor scales, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(minillm, CPU, m) {
  m.impl("q4_1_mm", &q4_1_mm);
  m.impl("q8_0_mm", &q8_0_mm);
}
