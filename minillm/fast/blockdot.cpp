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

// x (K,) -> qx (K,) int8 in -127..127, and per block its scale dx and dx sum(qx): the sum of the rounded x,
// not of x, so that the rounding errors e meet Q4_1's weight d q + m, which is centred, and not d q alone:
// d dx (q . qx) + m dx sum(qx) = w . x + w . e, while m sum(x) in its place would leave d q . e.
template <typename scalar_t>
void quantize_row(const scalar_t* x, int64_t K, int8_t* qx, float* dx, float* xsum) {
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    float v[BLOCK], amax = 0.f;
    for (int64_t t = 0; t < BLOCK; ++t) {
      v[t] = static_cast<float>(x[b * BLOCK + t]);
      amax = std::fmax(amax, std::fabs(v[t]));
    }
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int64_t t = 0; t < BLOCK; ++t) {
      qx[b * BLOCK + t] = static_cast<int8_t>(std::lrintf(v[t] * inv));
      sum += qx[b * BLOCK + t];
    }
    dx[b] = d;
    xsum[b] = d * static_cast<float>(sum);
  }
}

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
inline fvec splat(float v) { return _mm512_set1_ps(v); }
inline fvec to_float(ivec v) { return _mm512_cvtepi32_ps(v); }
inline void store(float* p, fvec v) { _mm512_storeu_ps(p, v); }
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
inline fvec splat(float v) { return _mm256_set1_ps(v); }
inline fvec to_float(ivec v) { return _mm256_cvtepi32_ps(v); }
inline void store(float* p, fvec v) { _mm256_storeu_ps(p, v); }
#endif

constexpr int64_t HALVES = ROWS / LANES;       // vectors a group: 1 (AVX-512) or 2 (AVX2)
constexpr int64_t CHUNK = 4 * ROWS;            // bytes of one chunk: 4 inputs of 16 rows
constexpr int64_t PART = 4 * LANES;            // bytes of a chunk one vector holds

// One group of 16 output rows for one activation row: y[0:16] = the rows' dot products with x.
template <bool Q4>
void group_dot(const uint8_t* w, const at::Half* scales, const int8_t* qx, const float* dx, const float* xsum,
               int64_t blocks, float* y) {
  constexpr int64_t chunks = Q4 ? 4 : 8, per_block = Q4 ? 2 : 1;
  for (int64_t h = 0; h < HALVES; ++h) {
    fvec acc = fzero();
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
      if constexpr (Q4) acc = fma(halfs(s + ROWS), splat(xsum[b]), acc);  // + m dx sum(qx)
    }
    store(y + h * LANES, acc);
  }
}

template <bool Q4, typename scalar_t>
void block_mm_rows(const scalar_t* x, int64_t M, int64_t K, const uint8_t* w, const at::Half* s, int64_t groups,
                   int64_t out_features, scalar_t* y) {
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
        for (int64_t r = 0; r < rows; ++r) y[i * out_features + g * ROWS + r] = static_cast<scalar_t>(out[r]);
      }
    }
  });
}

template <bool Q4>
at::Tensor block_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, int64_t out_features) {
  const int64_t chunks = Q4 ? 4 : 8, per_block = Q4 ? 2 : 1;
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3 && scales.dim() == 4, "block_mm: x (M, K), weight (G, B, bytes), "
              "scales (G, B, ", per_block, ", 16)");
  const int64_t M = x.size(0), K = x.size(1), groups = weight.size(0), blocks = weight.size(1);
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
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, out_features}, x.options());
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const at::Half* s = scales.data_ptr<at::Half>();
  if (x.scalar_type() == at::kFloat) {
    block_mm_rows<Q4>(xc.data_ptr<float>(), M, K, w, s, groups, out_features, y.data_ptr<float>());
  } else {
    block_mm_rows<Q4>(xc.data_ptr<at::BFloat16>(), M, K, w, s, groups, out_features, y.data_ptr<at::BFloat16>());
  }
  return y;
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
