// Block-quantized weight kernels for ONNX Runtime's CPU provider, as a custom-op library
// (ONNX Runtime "Custom operators": a library exporting RegisterCustomOps). Domain
// "lade_export", version 1; the Python side (layout, packing) is lade_export/export/quantize.py's
// pack_block_lanes, the build side lade_export/kernels/__init__.py.
//
//   MatMulBlockQ(X float[..., K], Q uint8[N/16, K/32, 64·bits], D float16[N/16, K/32, 16],
//                M float16[N/16, K/32, 16]) -> Y float[..., N]            attribute N
//   GatherBlockQ(Q, D, M, ids int64[...]) -> float[..., K]                attribute N
//       rows of the same table: a tied token embedding read from the LM head's tensors.
//   AttentionRows(Q, PK, K, PV, V, masked) -> float                       attributes scale, past_layout
//       attention with every query row computed alone (int8-compute graphs; see below).
//   AttentionRowsHalfCache(Q, PK, K, PV, V, masked) -> float            attributes scale, past_layout = 1
//       the same over a float16 cache (PK, PV float16, read in place), widened exactly.
//   RotaryAttentionRows(QKV, cos, sin, PK, PV, masked) -> float, float16, float16   attributes scale, heads, kv_heads
//       a layer's attention from its fused projection on: the rotary embedding, this step's keys and
//       values as the float16 present outputs, then AttentionRowsHalfCache (one node for ~30).
//   ArgMaxRows(X float[..., V]) -> int64[...]
//       each row's first index of its largest value (ONNX ArgMax over the last axis, keepdims = 0).
//
// Weights come in blocks of 32 along K with bits ∈ {4, 8} per weight: w = D·code + M (GGML's
// Q4_1; Q8_0 as code = q + 128, M = −128·D).
//
// MatMulBlockQ's arithmetic: float32 (compute = 0) or int8 activations (compute = 1, below).
// The sequence of operations that makes Y[r, n] depends only on X[r, :]
// and column n — never on how many rows X has, on which other rows are present, or on how the
// columns are split between threads — so a token is computed bit for bit the same in a
// one-token step and inside a many-token step, which keeps lookahead decoding exact. (The
// AVX-512 and the portable paths order their sums differently; a machine always takes the same
// one.)

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define LADE_X86 1
#endif

namespace {

constexpr int64_t kBlock = 32;

float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) { man <<= 1; --exp; }
      bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// float → float16 bits, rounded to nearest, ties to even (IEEE 754 convertFormat, what a Cast to float16
// gives): overflow to ±inf, float16 subnormals kept, NaN stays a (quiet) NaN. Scalar on every path.
uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // ≥ 65520 (or inf): ±inf
  if (a >= 0x38800000u) {  // a float16 normal (≥ 2^-14): 10 of the 23 fraction bits, rounded
    uint32_t h = ((((a >> 23) - 127 + 15) << 10) | ((a & 0x7fffffu) >> 13));
    const uint32_t rest = a & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent exactly
    return static_cast<uint16_t>(sign | h);
  }
  if (a < 0x33000000u) return static_cast<uint16_t>(sign);  // ≤ 2^-25 rounds to ±0
  const uint32_t exp = a >> 23, man = (a & 0x7fffffu) | 0x800000u, shift = 126 - exp;  // 14 … 24
  uint32_t h = man >> shift;
  const uint32_t rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (h & 1u))) ++h;  // may become the smallest normal, 0x400: exact
  return static_cast<uint16_t>(sign | h);
}

// Packed layout ("column lanes"): columns in tiles of 16, one per 32-bit lane of a 512-bit
// vector. For tile t and block b there are G = bits vectors of 64 bytes; lane i of vector g
// holds, in bits [bits·e, bits·e + bits), the unsigned code of column 16t + i, block element
// j = (32 / bits)·g + e. Scales D and offsets M are float16 [N/16, K/32, 16]; the weight is
// D·code + M (Q4_1: M is the block minimum; Q8_0's signed q is stored as code = q + 128 with
// M = −128·D). So a code is masked out of its lane in place — (v & (mask << bits·e)) is code·2^(bits·e),
// exact in float32 — and multiplied by x_j·2^(−bits·e), which is exact too: the product equals
// code·x_j bit for bit, without a shift or a shuffle per weight.
// A packed weight: Q, D, M (inputs 1-3 of MatMulBlockQ, 0-2 of GatherBlockQ), N output
// columns, and the bits implied by Q's last dimension.
struct Packed {
  int bits;
  int64_t tiles, blocks, n;
  const uint8_t* q;    // [N/16, K/32, bits·64]
  const uint16_t* d;   // float16 [N/16, K/32, 16]
  const uint16_t* m;   // float16 [N/16, K/32, 16]
};

// One matrix product: the packed weight and the rows of X it multiplies.
struct Job : Packed {
  const float* xs;     // [rows, K]: x_j · 2^(−bits·e(j))
  const float* sums;   // [rows, K/32]: Σ_j x_j per block
  int64_t rows, k;
  float* y;            // [rows, N]
  int64_t chunk;       // tiles per parallel task
};

// Y[r, column] = Σ_b D_b · (Σ_j code_j · x_j) + M_b · Σ_j x_j, the inner sum split into two
// partial sums (even and odd e) added at the end of the block, then Σ over blocks in order.

// ---- portable path -----------------------------------------------------------------------
void tiles_portable(const Job& job, int64_t t0, int64_t t1) {
  const int per = 32 / job.bits, groups = job.bits;
  const uint32_t mask = (1u << job.bits) - 1;
  const int64_t blocks = job.k / kBlock;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t r = 0; r < job.rows; ++r)
      for (int lane = 0; lane < 16; ++lane) {
        const int64_t col = t * 16 + lane;
        if (col >= job.n) break;
        float y = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t at = t * blocks + b;
          const uint32_t* v = reinterpret_cast<const uint32_t*>(job.q + at * groups * 64);
          float acc[2] = {0.0f, 0.0f};
          for (int g = 0; g < groups; ++g)
            for (int e = 0; e < per; ++e) {
              const float code = static_cast<float>(v[g * 16 + lane] & (mask << (job.bits * e)));
              acc[e & 1] += code * job.xs[r * job.k + b * kBlock + per * g + e];
            }
          y += half_to_float(job.d[at * 16 + lane]) * (acc[0] + acc[1]);
          y += half_to_float(job.m[at * 16 + lane]) * job.sums[r * blocks + b];
        }
        job.y[r * job.n + col] = y;
      }
}

// ---- AVX-512 path ------------------------------------------------------------------------
#ifdef LADE_X86
#define LADE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

// T column tiles and R rows at a time: 2·T·R accumulators in flight (the per-(row, column)
// sequence of operations is the same for every T and R).
template <int BITS, int R, int T>
LADE_AVX512 void tile_avx512(const Job& job, int64_t tile, int64_t row) {
  constexpr int PER = 32 / BITS, G = BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1;
  const int64_t blocks = job.k / kBlock;
  __m512 y[T][R];
  for (int c = 0; c < T; ++c)
    for (int r = 0; r < R; ++r) y[c][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 acc[T][R][2];
    for (int c = 0; c < T; ++c)
      for (int r = 0; r < R; ++r) acc[c][r][0] = acc[c][r][1] = _mm512_setzero_ps();
    for (int g = 0; g < G; ++g) {
      __m512i v[T];
      for (int c = 0; c < T; ++c)
        v[c] = _mm512_loadu_si512(job.q + (((tile + c) * blocks + b) * G + g) * 64);
      for (int e = 0; e < PER; ++e) {
        const __m512i mask = _mm512_set1_epi32(static_cast<int>(MASK << (BITS * e)));
        for (int c = 0; c < T; ++c) {
          const __m512 code = _mm512_cvtepu32_ps(_mm512_and_si512(v[c], mask));
          for (int r = 0; r < R; ++r)
            acc[c][r][e & 1] = _mm512_fmadd_ps(
                code, _mm512_set1_ps(job.xs[(row + r) * job.k + b * kBlock + PER * g + e]), acc[c][r][e & 1]);
        }
      }
    }
    for (int c = 0; c < T; ++c) {
      const int64_t at = ((tile + c) * blocks + b) * 16;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(job.d + at)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(job.m + at)));
      for (int r = 0; r < R; ++r) {
        y[c][r] = _mm512_fmadd_ps(d, _mm512_add_ps(acc[c][r][0], acc[c][r][1]), y[c][r]);
        y[c][r] = _mm512_fmadd_ps(m, _mm512_set1_ps(job.sums[(row + r) * blocks + b]), y[c][r]);
      }
    }
  }
  for (int c = 0; c < T; ++c) {
    const int64_t col = (tile + c) * 16;
    const int64_t valid = std::min<int64_t>(16, job.n - col);
    const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(job.y + (row + r) * job.n + col, keep, y[c][r]);
  }
}

// Rows [row, row + R) over tiles [t0, t1): T tiles at a time, then the rest one by one.
template <int BITS, int R, int T>
LADE_AVX512 void sweep_avx512(const Job& job, int64_t t0, int64_t t1, int64_t row) {
  int64_t t = t0;
  for (; t + T <= t1; t += T) tile_avx512<BITS, R, T>(job, t, row);
  for (; t < t1; ++t) tile_avx512<BITS, R, 1>(job, t, row);
}

// Rows in groups of 4 (fewer for the last group); one row takes 4 tiles at a time, 2-3 rows
// 2 tiles (enough independent FMA chains without spilling registers).
template <int BITS>
LADE_AVX512 void tiles_avx512(const Job& job, int64_t t0, int64_t t1) {
  for (int64_t row = 0; row < job.rows;) {
    switch (std::min<int64_t>(job.rows - row, 4)) {
      case 1: sweep_avx512<BITS, 1, 4>(job, t0, t1, row); row += 1; break;
      case 2: sweep_avx512<BITS, 2, 2>(job, t0, t1, row); row += 2; break;
      case 3: sweep_avx512<BITS, 3, 2>(job, t0, t1, row); row += 3; break;
      default: sweep_avx512<BITS, 4, 1>(job, t0, t1, row); row += 4; break;
    }
  }
}

#endif

// ---- exact integer path (attribute compute = 1) --------------------------------------------
// Activations: each row, each block of 32 along K, quantized alone (GGML's Q8_0 activation
// blocks: d = max|x| / 127, q = round(x / d) ∈ [−127, 127], here as round-half-even of x · 127/max|x|),
// with s = d · Σq. Then Y[r, n] = Σ_b D·(d_b · Σ_j code_j·q_j) + M·s_b: the inner sums are int32
// (exact on every path, in any order), and every path applies the scales in one order:
//   u = float(isum) · d_b;  y = fma(D, u, y);  y = fma(M, s_b, y)      for b = 0, 1, …
// so the integer paths (AMX, AVX512-VNNI, AVX-VNNI, AVX2, portable) give bit-identical outputs.
// A row's q holds each block's 32 values in the order the packed lanes pair them with codes:
// 8 bits: j; 4 bits: per group of 8 (one 32-bit lane word), the low nibbles j = 0, 2, 4, 6 then
// the high ones j = 1, 3, 5, 7.

struct IJob : Packed {
  const int8_t* qa;     // [rows, K] quantized activations, kernel order within each block
  const float* dx;      // [rows, K/32] activation scales d
  const float* sx;      // [rows, K/32] d · Σq
  const int32_t* qsum;  // [rows, K/32] Σq
  int64_t rows, k;
  float* y;             // [rows, N]
  int64_t chunk;        // tiles per parallel task
  int path;
};

inline int kernel_position(int bits, int j) {  // where element j of a block sits in the row's q
  if (bits == 8) return j;
  const int g = j / 8, e = j % 8;
  return 8 * g + (e & 1 ? 4 : 0) + e / 2;
}

// One row of activations: the same scalar code on every path (float32, no contraction).
void quantize_row(const float* x, int64_t k, int bits, int8_t* q, float* dx, float* sx, int32_t* qsum) {
  const float round_magic = 12582912.0f;  // 1.5·2^23: (t + magic) − magic rounds |t| < 2^22 half to even
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* v = x + b * kBlock;
    float amax = 0.0f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < kBlock; ++j) {
      float t = v[j] * inv;
      t = (t + round_magic) - round_magic;
      int qi = static_cast<int>(t);
      qi = qi > 127 ? 127 : qi < -127 ? -127 : qi;
      q[b * kBlock + kernel_position(bits, j)] = static_cast<int8_t>(qi);
      sum += qi;
    }
    dx[b] = d;
    sx[b] = d * static_cast<float>(sum);
    qsum[b] = sum;
  }
}

#ifdef LADE_X86
// quantize_row with 16 lanes at a time (the AVX512-VNNI and AMX paths): the same operations on every
// element — |x|, the block's largest |x| (a running per-lane maximum that passes over NaN as
// std::max does, then the maximum over the lanes: the same value), x·inv, the round-to-even by the
// magic constant, truncation, the clamp — and the same scalar d, inv, Σq and d·Σq, so the same bits;
// 4-bit kernels' order by a permutation within each group of 8.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void quantize_row_avx512(
    const float* x, int64_t k, int bits, int8_t* q, float* dx, float* sx, int32_t* qsum) {
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
  const __m512i order = bits == 8 ? _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                                  : _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + b * kBlock), x1 = _mm512_loadu_ps(x + b * kBlock + 16);
    __m512 most = _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps());  // NaN in the first operand: the second
    most = _mm512_max_ps(_mm512_abs_ps(x1), most);
    const float amax = _mm512_reduce_max_ps(most);
    const float d = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m512i sum = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const __m512 t = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(h ? x1 : x0, _mm512_set1_ps(inv)), magic), magic);
      const __m512i qi = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvttps_epi32(t), low), high);
      sum = _mm512_add_epi32(sum, qi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16 * h),
                       _mm512_cvtepi32_epi8(_mm512_permutexvar_epi32(order, qi)));
    }
    const int32_t total = _mm512_reduce_add_epi32(sum);
    dx[b] = d;
    sx[b] = d * static_cast<float>(total);
    qsum[b] = total;
  }
}

// The same 8 lanes at a time (the AVX-VNNI and AVX2 paths).
__attribute__((target("avx2,fma"))) void quantize_row_avx2(const float* x, int64_t k, int bits, int8_t* q, float* dx,
                                                           float* sx, int32_t* qsum) {
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i low = _mm256_set1_epi32(-127), high = _mm256_set1_epi32(127);
  const __m256i order = bits == 8 ? _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7) : _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256i bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                         0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m256 v[4];
    __m256 most = _mm256_setzero_ps();
    for (int h = 0; h < 4; ++h) {
      v[h] = _mm256_loadu_ps(x + b * kBlock + 8 * h);
      most = _mm256_max_ps(_mm256_andnot_ps(sign, v[h]), most);  // NaN in the first operand: the second
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, most);
    float amax = lanes[0];
    for (int l = 1; l < 8; ++l) amax = std::max(amax, lanes[l]);
    const float d = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m256i sum = _mm256_setzero_si256();
    for (int h = 0; h < 4; ++h) {
      const __m256 t = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v[h], _mm256_set1_ps(inv)), magic), magic);
      const __m256i qi = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvttps_epi32(t), low), high);
      sum = _mm256_add_epi32(sum, qi);
      const __m256i packed = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(qi, order), bytes);
      const int32_t first = _mm256_extract_epi32(packed, 0), second = _mm256_extract_epi32(packed, 4);
      std::memcpy(q + b * kBlock + 8 * h, &first, 4);
      std::memcpy(q + b * kBlock + 8 * h + 4, &second, 4);
    }
    alignas(32) int32_t parts[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(parts), sum);
    int32_t total = 0;
    for (int l = 0; l < 8; ++l) total += parts[l];
    dx[b] = d;
    sx[b] = d * static_cast<float>(total);
    qsum[b] = total;
  }
}
#endif

inline float epilogue(float y, float dcol, float mcol, int32_t isum, float d, float s) {
  const float u = static_cast<float>(isum) * d;
  y = std::fma(dcol, u, y);
  return std::fma(mcol, s, y);
}

void itiles_portable(const IJob& job, int64_t t0, int64_t t1) {
  const int per = 32 / job.bits, groups = job.bits;
  const uint32_t mask = (1u << job.bits) - 1;
  const int64_t blocks = job.k / kBlock;
  int pos[kBlock];
  for (int j = 0; j < kBlock; ++j) pos[j] = kernel_position(job.bits, j);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t r = 0; r < job.rows; ++r)
      for (int lane = 0; lane < 16; ++lane) {
        const int64_t col = t * 16 + lane;
        if (col >= job.n) break;
        float y = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t at = t * blocks + b;
          const uint32_t* v = reinterpret_cast<const uint32_t*>(job.q + at * groups * 64);
          const int8_t* qa = job.qa + r * job.k + b * kBlock;
          int32_t isum = 0;
          for (int g = 0; g < groups; ++g)
            for (int e = 0; e < per; ++e) {
              const int32_t code = static_cast<int32_t>((v[g * 16 + lane] >> (job.bits * e)) & mask);
              isum += code * qa[pos[per * g + e]];
            }
          y = epilogue(y, half_to_float(job.d[at * 16 + lane]), half_to_float(job.m[at * 16 + lane]), isum,
                       job.dx[r * blocks + b], job.sx[r * blocks + b]);
        }
        job.y[r * job.n + col] = y;
      }
}

#ifdef LADE_X86
inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// -- AVX512-VNNI: VPDPBUSD (unsigned codes × signed activations, 4 per 32-bit lane) ------------
#define LADE_VNNI512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))

LADE_VNNI512 inline __m512 epilogue512(__m512 y, __m512 d, __m512 m, __m512i isum, float dx, float sx) {
  const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(dx));
  y = _mm512_fmadd_ps(d, u, y);
  return _mm512_fmadd_ps(m, _mm512_set1_ps(sx), y);
}

template <int BITS, int R, int T>
LADE_VNNI512 void itile_vnni512(const IJob& job, int64_t tile, int64_t row) {
  constexpr int G = BITS;
  const int64_t blocks = job.k / kBlock;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  __m512 y[T][R];
  for (int c = 0; c < T; ++c)
    for (int r = 0; r < R; ++r) y[c][r] = _mm512_setzero_ps();
  // The first group of rows streams the weights from memory while it computes on them, and the
  // hardware's prefetchers fall behind: it asks for the next sweep's tiles (T tiles ahead, the same
  // block) while this block is computed, into level 2. Data movement only. Measured
  // (bench/results/kernel-floor.md, step-costs.md): asked into level 1, 4-16 rows ran 10-25% faster
  // when the weights came from memory and 1-2 rows no faster; into level 2 (2026-12-06, a Zen 4 VM,
  // whole steps against level 1 from 4 rows), 1-2 rows 0.84-0.85×, 4 rows 0.85-0.97×, 8 rows
  // 0.97-1.01×, 16 rows 0.94-0.96×.
  const bool stream = row == 0 && tile + 2 * T <= job.tiles;
  for (int64_t b = 0; b < blocks; ++b) {
    if (stream) {
      for (int c = 0; c < T; ++c) {
        const int64_t ahead = (tile + T + c) * blocks + b;
        for (int g = 0; g < G; ++g) _mm_prefetch(reinterpret_cast<const char*>(job.q + (ahead * G + g) * 64), _MM_HINT_T1);
        if ((b & 1) == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(job.d + ahead * 16), _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(job.m + ahead * 16), _MM_HINT_T1);
        }
      }
    }
    __m512i acc[T][R];
    for (int c = 0; c < T; ++c)
      for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_si512();
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < T; ++c) {
        const __m512i v = _mm512_loadu_si512(job.q + (((tile + c) * blocks + b) * G + g) * 64);
        if (BITS == 4) {
          const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), low4);
          for (int r = 0; r < R; ++r) {
            const int8_t* a = job.qa + (row + r) * job.k + b * kBlock + 8 * g;
            acc[c][r] = _mm512_dpbusd_epi32(acc[c][r], lo, _mm512_set1_epi32(load4(a)));
            acc[c][r] = _mm512_dpbusd_epi32(acc[c][r], hi, _mm512_set1_epi32(load4(a + 4)));
          }
        } else {
          for (int r = 0; r < R; ++r)
            acc[c][r] = _mm512_dpbusd_epi32(acc[c][r], v,
                                            _mm512_set1_epi32(load4(job.qa + (row + r) * job.k + b * kBlock + 4 * g)));
        }
      }
    }
    for (int c = 0; c < T; ++c) {
      const int64_t at = ((tile + c) * blocks + b) * 16;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(job.d + at)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(job.m + at)));
      for (int r = 0; r < R; ++r)
        y[c][r] = epilogue512(y[c][r], d, m, acc[c][r], job.dx[(row + r) * blocks + b], job.sx[(row + r) * blocks + b]);
    }
  }
  for (int c = 0; c < T; ++c) {
    const int64_t col = (tile + c) * 16;
    const int64_t valid = std::min<int64_t>(16, job.n - col);
    const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(job.y + (row + r) * job.n + col, keep, y[c][r]);
  }
}

template <int BITS, int R, int T>
LADE_VNNI512 void isweep_vnni512(const IJob& job, int64_t t0, int64_t t1, int64_t row) {
  int64_t t = t0;
  for (; t + T <= t1; t += T) itile_vnni512<BITS, R, T>(job, t, row);
  for (; t < t1; ++t) itile_vnni512<BITS, R, 1>(job, t, row);
}

// Rows in groups of up to 8: each group reads the task's weights once (from cache after the first).
// Groups of 5-7 rows run on two tiles at a time: on one tile a group of R rows has only R chains of
// sums in flight and waits on VPDPBUSD's latency (whole steps of 5-7 tokens 4-9% faster on two tiles;
// 3, 4, 8 and more rows measured no faster with other shapes: bench/results/kernel-floor.md).
template <int BITS>
LADE_VNNI512 void itiles_vnni512(const IJob& job, int64_t t0, int64_t t1) {
  for (int64_t row = 0; row < job.rows;) {
    switch (std::min<int64_t>(job.rows - row, 8)) {
      case 1: isweep_vnni512<BITS, 1, 4>(job, t0, t1, row); row += 1; break;
      case 2: isweep_vnni512<BITS, 2, 4>(job, t0, t1, row); row += 2; break;
      case 3: isweep_vnni512<BITS, 3, 2>(job, t0, t1, row); row += 3; break;
      case 4: isweep_vnni512<BITS, 4, 2>(job, t0, t1, row); row += 4; break;
      case 5: isweep_vnni512<BITS, 5, 2>(job, t0, t1, row); row += 5; break;
      case 6: isweep_vnni512<BITS, 6, 2>(job, t0, t1, row); row += 6; break;
      case 7: isweep_vnni512<BITS, 7, 2>(job, t0, t1, row); row += 7; break;
      default: isweep_vnni512<BITS, 8, 1>(job, t0, t1, row); row += 8; break;
    }
  }
}

// -- AMX: TDPBSUD (signed activations × unsigned codes) on 16-row tiles -------------------------
// A = R rows × one block (32 bytes), B = the block's codes as 8 rows × 16 columns × 4 bytes — the
// packed layout itself for 8 bits, its nibbles spread to bytes for 4 — C = R × 16 int32, then the
// same float epilogue as the VNNI path on each row of C.
#define LADE_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,amx-tile,amx-int8")))

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

LADE_AMX void amx_configure(int rows) {
  TileConfig cfg;
  for (int t : {0, 1}) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 32;  // tmm0, tmm1: activations
  for (int t : {2, 3}) cfg.rows[t] = 8, cfg.colsb[t] = 64;                          // tmm2, tmm3: codes
  for (int t : {4, 5}) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;  // tmm4, tmm5: int32 sums
  __asm__ volatile("" : : "r"(&cfg) : "memory");  // the intrinsic's asm names only cfg's first 8 bytes
  _tile_loadconfig(&cfg);
}

// One column tile, rows [row, row + rows): every block's int32 sums into `sums` ([blocks][rows][16])
// first — two blocks in flight on separate tiles — then the float epilogue block by block.
template <int BITS>
LADE_AMX void itile_amx(const IJob& job, int64_t tile, int64_t row, int rows, int32_t* sums, uint8_t* codes) {
  const int64_t blocks = job.k / kBlock;
  const int8_t* a = job.qa + row * job.k;
  const uint8_t* q = job.q + tile * blocks * BITS * 64;
  if (BITS == 4) {  // nibbles to bytes: block b's B rows 2g, 2g+1 = low, high nibbles of vector g
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int64_t i = 0; i < blocks * 4; ++i) {
      const __m512i v = _mm512_loadu_si512(q + i * 64);
      _mm512_store_si512(codes + (2 * i) * 64, _mm512_and_si512(v, low4));
      _mm512_store_si512(codes + (2 * i + 1) * 64, _mm512_and_si512(_mm512_srli_epi32(v, 4), low4));
    }
    __asm__ volatile("" ::: "memory");  // the tile loads below read what was just stored
    q = codes;
  }
  const int64_t stride = static_cast<int64_t>(rows) * 16;
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    _tile_loadd(0, a + b * kBlock, job.k);
    _tile_loadd(2, q + b * 512, 64);
    _tile_loadd(1, a + (b + 1) * kBlock, job.k);
    _tile_loadd(3, q + (b + 1) * 512, 64);
    _tile_zero(4);
    _tile_zero(5);
    _tile_dpbsud(4, 0, 2);
    _tile_dpbsud(5, 1, 3);
    _tile_stored(4, sums + b * stride, 64);
    _tile_stored(5, sums + (b + 1) * stride, 64);
  }
  if (b < blocks) {
    _tile_loadd(0, a + b * kBlock, job.k);
    _tile_loadd(2, q + b * 512, 64);
    _tile_zero(4);
    _tile_dpbsud(4, 0, 2);
    _tile_stored(4, sums + b * stride, 64);
  }
  __m512 y[16];
  for (int r = 0; r < 16; ++r) y[r] = _mm512_setzero_ps();
  for (b = 0; b < blocks; ++b) {
    const int64_t at = (tile * blocks + b) * 16;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(job.d + at)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(job.m + at)));
    for (int r = 0; r < rows; ++r)
      y[r] = epilogue512(y[r], d, m, _mm512_load_si512(sums + b * stride + r * 16), job.dx[(row + r) * blocks + b],
                         job.sx[(row + r) * blocks + b]);
  }
  const int64_t col = tile * 16;
  const int64_t valid = std::min<int64_t>(16, job.n - col);
  const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
  for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(job.y + (row + r) * job.n + col, keep, y[r]);
}

// Rows below kAmxRows take the AVX512-VNNI kernels (one AMX product costs the same for 1 row as
// for 16): the integer sums, and so the outputs, are the same bits either way.
constexpr int64_t kAmxRows = 4;

template <int BITS>
LADE_AMX void itiles_amx(const IJob& job, int64_t t0, int64_t t1) {
  const int64_t blocks = job.k / kBlock;
  if (job.rows < kAmxRows) return itiles_vnni512<BITS>(job, t0, t1);
  thread_local std::vector<int32_t> sums;
  thread_local std::vector<uint8_t> codes;
  sums.resize(static_cast<size_t>(blocks * 16 * 16) + 16);
  codes.resize(static_cast<size_t>(blocks * 8 * 64) + 64);
  int32_t* s = reinterpret_cast<int32_t*>((reinterpret_cast<uintptr_t>(sums.data()) + 63) & ~uintptr_t{63});
  uint8_t* c = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(codes.data()) + 63) & ~uintptr_t{63});
  for (int64_t row = 0; row < job.rows; row += 16) {
    const int rows = static_cast<int>(std::min<int64_t>(16, job.rows - row));
    amx_configure(rows);
    for (int64_t t = t0; t < t1; ++t) itile_amx<BITS>(job, t, row, rows, s, c);
  }
  _tile_release();
}

// -- AVX2 (and AVX-VNNI): the 16 columns of a tile as two halves of 8 ---------------------------
#define LADE_AVX2 __attribute__((target("avx2,fma,f16c")))
#define LADE_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

// Σ code·q over 4 bytes per 32-bit lane, added to acc. VNNI: VPDPBUSD. AVX2: VPMADDUBSW (u8 × s8,
// pairs summed in int16) then VPMADDWD by 1: no saturation for 4-bit codes (2·15·127); 8-bit codes
// are taken as code − 128 (|·| ≤ 128, 2·128·127 < 2^15) and 128·Σq is added back per block.
template <bool SHIFTED>
LADE_AVX2 inline __m256i dot4_avx2(__m256i acc, __m256i codes, __m256i act) {
  __m256i p;
  if (SHIFTED) {
    const __m256i s = _mm256_xor_si256(codes, _mm256_set1_epi8(static_cast<char>(0x80)));  // code − 128, signed
    p = _mm256_maddubs_epi16(_mm256_sign_epi8(s, s), _mm256_sign_epi8(act, s));
  } else {
    p = _mm256_maddubs_epi16(codes, act);
  }
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

#define LADE_HALVES_BODY(DOT, ATTR)                                                                          \
  constexpr int G = BITS;                                                                                  \
  const int64_t blocks = job.k / kBlock;                                                                   \
  const __m256i low4 = _mm256_set1_epi8(0x0f);                                                             \
  __m256 y[2][R];                                                                                          \
  for (int h = 0; h < 2; ++h)                                                                              \
    for (int r = 0; r < R; ++r) y[h][r] = _mm256_setzero_ps();                                             \
  /* as itile_vnni512, into level 2 for 1-3 rows (AVX2 forced on a Zen 4 VM: 1 row 0.87-1.01×, four runs) */ \
  /* and level 1 from 4 rows (level 2 read 1.03-1.07× at 4 rows, 1.02× at 8) */                           \
  const bool stream = row == 0 && tile + 2 <= job.tiles;                                                   \
  constexpr auto hint = R >= 4 ? _MM_HINT_T0 : _MM_HINT_T1;                                               \
  for (int64_t b = 0; b < blocks; ++b) {                                                                   \
    if (stream) {                                                                                          \
      const int64_t ahead = (tile + 1) * blocks + b;                                                       \
      for (int g = 0; g < G; ++g) _mm_prefetch(reinterpret_cast<const char*>(job.q + (ahead * G + g) * 64), hint); \
      if ((b & 1) == 0) {                                                                                  \
        _mm_prefetch(reinterpret_cast<const char*>(job.d + ahead * 16), hint);                             \
        _mm_prefetch(reinterpret_cast<const char*>(job.m + ahead * 16), hint);                             \
      }                                                                                                    \
    }                                                                                                      \
    __m256i acc[2][R];                                                                                     \
    for (int h = 0; h < 2; ++h)                                                                            \
      for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_si256();                                      \
    for (int g = 0; g < G; ++g)                                                                            \
      for (int h = 0; h < 2; ++h) {                                                                        \
        const __m256i v = _mm256_loadu_si256(                                                             \
            reinterpret_cast<const __m256i*>(job.q + ((tile * blocks + b) * G + g) * 64 + 32 * h));        \
        if (BITS == 4) {                                                                                   \
          const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi32(v, 4), low4); \
          for (int r = 0; r < R; ++r) {                                                                    \
            const int8_t* a = job.qa + (row + r) * job.k + b * kBlock + 8 * g;                             \
            acc[h][r] = DOT(acc[h][r], lo, _mm256_set1_epi32(load4(a)));                                   \
            acc[h][r] = DOT(acc[h][r], hi, _mm256_set1_epi32(load4(a + 4)));                               \
          }                                                                                                \
        } else {                                                                                           \
          for (int r = 0; r < R; ++r)                                                                      \
            acc[h][r] = DOT(acc[h][r], v, _mm256_set1_epi32(load4(job.qa + (row + r) * job.k + b * kBlock + 4 * g))); \
        }                                                                                                  \
      }                                                                                                    \
    const int64_t at = (tile * blocks + b) * 16;                                                           \
    for (int h = 0; h < 2; ++h) {                                                                          \
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(job.d + at + 8 * h))); \
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(job.m + at + 8 * h))); \
      for (int r = 0; r < R; ++r) {                                                                        \
        __m256i isum = acc[h][r];                                                                          \
        if (SHIFT_BACK) isum = _mm256_add_epi32(isum, _mm256_set1_epi32(128 * job.qsum[(row + r) * blocks + b])); \
        const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(job.dx[(row + r) * blocks + b])); \
        y[h][r] = _mm256_fmadd_ps(d, u, y[h][r]);                                                          \
        y[h][r] = _mm256_fmadd_ps(m, _mm256_set1_ps(job.sx[(row + r) * blocks + b]), y[h][r]);              \
      }                                                                                                    \
    }                                                                                                      \
  }                                                                                                        \
  float out[16];                                                                                           \
  const int64_t col = tile * 16;                                                                           \
  const int64_t valid = std::min<int64_t>(16, job.n - col);                                                \
  for (int r = 0; r < R; ++r) {                                                                            \
    _mm256_storeu_ps(out, y[0][r]);                                                                        \
    _mm256_storeu_ps(out + 8, y[1][r]);                                                                    \
    std::memcpy(job.y + (row + r) * job.n + col, out, sizeof(float) * valid);                              \
  }

template <int BITS, int R>
LADE_AVXVNNI void itile_avxvnni(const IJob& job, int64_t tile, int64_t row) {
  constexpr bool SHIFT_BACK = false;
#define LADE_DOT_VNNI(acc, c, a) _mm256_dpbusd_avx_epi32(acc, c, a)
  LADE_HALVES_BODY(LADE_DOT_VNNI, LADE_AVXVNNI)
#undef LADE_DOT_VNNI
}

template <int BITS, int R>
LADE_AVX2 void itile_avx2(const IJob& job, int64_t tile, int64_t row) {
  constexpr bool SHIFT_BACK = BITS == 8;
#define LADE_DOT_AVX2(acc, c, a) dot4_avx2<BITS == 8>(acc, c, a)
  LADE_HALVES_BODY(LADE_DOT_AVX2, LADE_AVX2)
#undef LADE_DOT_AVX2
}
#undef LADE_HALVES_BODY

#define LADE_ROWS_256(NAME, TILE, ATTR)                                                       \
  template <int BITS>                                                                      \
  ATTR void NAME(const IJob& job, int64_t t0, int64_t t1) {                                \
    for (int64_t row = 0; row < job.rows;) {                                               \
      const int64_t left = std::min<int64_t>(job.rows - row, 4);                           \
      for (int64_t t = t0; t < t1; ++t) {                                                  \
        switch (left) {                                                                    \
          case 1: TILE<BITS, 1>(job, t, row); break;                                       \
          case 2: TILE<BITS, 2>(job, t, row); break;                                       \
          case 3: TILE<BITS, 3>(job, t, row); break;                                       \
          default: TILE<BITS, 4>(job, t, row); break;                                      \
        }                                                                                  \
      }                                                                                    \
      row += left;                                                                         \
    }                                                                                      \
  }
LADE_ROWS_256(itiles_avxvnni, itile_avxvnni, LADE_AVXVNNI)
LADE_ROWS_256(itiles_avx2, itile_avx2, LADE_AVX2)
#undef LADE_ROWS_256
#endif  // LADE_X86

// ---- dispatch: chosen once per process -----------------------------------------------------
// Integer family, in the order taken: avx512vnni, amx (slower than avx512vnni on a Sapphire
// Rapids-class Xeon as written: one tile product per block of 32 and its sums stored for the float
// epilogue), avxvnni, avx2, portable. Float32 compute: avx512, portable. LADE_KERNELS_PATH forces one (an integer name also picks the float32 path it implies:
// amx and avx512vnni → avx512, the others → portable); LADE_KERNELS_PORTABLE=1 is
// LADE_KERNELS_PATH=portable. A forced path the CPU lacks, or an unknown name, is an error that
// every kernel reports when the session is created.
enum IntPath { kPortable = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3, kAmx = 4 };
const char* const kIntNames[] = {"portable", "avx2", "avxvnni", "avx512vnni", "amx"};

struct Dispatch {
  int int_path = kPortable;
  bool float_avx512 = false;
  bool float_avx2 = false;  // attention, row prologues and activation rounding in 8 lanes (AVX2, FMA, F16C)
                           // where float_avx512 is off: the same bits as the scalar code
  bool supported[5] = {true, false, false, false, false};
  bool cpu_avx512 = false;
  std::string error;  // non-empty: LADE_KERNELS_PATH cannot be honoured
  std::string int_name, float_name;
};

#ifdef LADE_X86
bool cpuid_bit(unsigned leaf, unsigned sub, int reg, int bit) {
  unsigned r[4] = {0, 0, 0, 0};
  if (!__get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3])) return false;
  return (r[reg] >> bit) & 1u;
}

bool amx_permitted() {  // Linux hands out the AMX tile state only on request (ARCH_REQ_XCOMP_PERM)
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}
#endif

Dispatch choose_paths() {
  Dispatch d;
#ifdef LADE_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  d.cpu_avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  d.supported[kAvx2] = avx2;
  d.supported[kAvxVnni] = avx2 && cpuid_bit(7, 1, 0, 4);                        // CPUID.(7,1):EAX[4]
  d.supported[kAvx512Vnni] = d.cpu_avx512 && cpuid_bit(7, 0, 2, 11);            // CPUID.(7,0):ECX[11]
  d.supported[kAmx] = d.supported[kAvx512Vnni] && cpuid_bit(7, 0, 3, 24) && cpuid_bit(7, 0, 3, 25);  // EDX[24,25]
#endif
  const char* forced = std::getenv("LADE_KERNELS_PATH");
  if (forced != nullptr && *forced == '\0') forced = nullptr;
  const char* portable = std::getenv("LADE_KERNELS_PORTABLE");
  if (forced == nullptr && portable != nullptr && std::strcmp(portable, "1") == 0) forced = "portable";
  int want = -1;
  if (forced != nullptr) {
    if (std::strcmp(forced, "avx512") == 0) {
      want = 5;
    } else {
      for (int i = 0; i < 5; ++i)
        if (std::strcmp(forced, kIntNames[i]) == 0) want = i;
    }
    if (want < 0) {
      d.error = std::string("LADE_KERNELS_PATH=") + forced +
                " is none of amx, avx512vnni, avxvnni, avx2, avx512 (float32 compute), portable";
      return d;
    }
  }
#ifdef LADE_X86
  if (d.supported[kAmx]) d.supported[kAmx] = amx_permitted();
#endif
  if (want == 5) {
    if (!d.cpu_avx512) d.error = "LADE_KERNELS_PATH=avx512: this CPU lacks AVX-512";
    d.float_avx512 = d.cpu_avx512;
    want = -1;  // the integer path stays the best one
  } else if (want >= 0 && !d.supported[want]) {
    d.error = std::string("LADE_KERNELS_PATH=") + forced + ": this CPU (or its OS) lacks it";
    return d;
  } else {
    d.float_avx512 = d.cpu_avx512 && (want == -1 || want == kAmx || want == kAvx512Vnni);
  }
  if (want >= 0) {
    d.int_path = want;
  } else {  // AMX after AVX512-VNNI: with a float epilogue per block of 32 its tiles measured slower (step costs)
    for (int i : {kAvx512Vnni, kAmx, kAvxVnni, kAvx2, kPortable})
      if (d.supported[i]) { d.int_path = i; break; }
  }
  d.int_name = kIntNames[d.int_path];
  d.float_name = d.float_avx512 ? "avx512" : "portable";
  d.float_avx2 = !d.float_avx512 && d.supported[kAvx2] && d.int_path != kPortable;
  return d;
}

const Dispatch& dispatch() {
  static const Dispatch d = choose_paths();
  return d;
}

void run_task(void* data, size_t task) {
  const Job& job = *static_cast<const Job*>(data);
  const int64_t t0 = static_cast<int64_t>(task) * job.chunk;
  const int64_t t1 = std::min(job.tiles, t0 + job.chunk);
#ifdef LADE_X86
  if (dispatch().float_avx512) return job.bits == 4 ? tiles_avx512<4>(job, t0, t1) : tiles_avx512<8>(job, t0, t1);
#endif
  tiles_portable(job, t0, t1);
}

void run_itask(void* data, size_t task) {
  const IJob& job = *static_cast<const IJob*>(data);
  const int64_t t0 = static_cast<int64_t>(task) * job.chunk;
  const int64_t t1 = std::min(job.tiles, t0 + job.chunk);
  const bool four = job.bits == 4;
  switch (job.path) {
#ifdef LADE_X86
    case kAmx: return four ? itiles_amx<4>(job, t0, t1) : itiles_amx<8>(job, t0, t1);
    case kAvx512Vnni: return four ? itiles_vnni512<4>(job, t0, t1) : itiles_vnni512<8>(job, t0, t1);
    case kAvxVnni: return four ? itiles_avxvnni<4>(job, t0, t1) : itiles_avxvnni<8>(job, t0, t1);
    case kAvx2: return four ? itiles_avx2<4>(job, t0, t1) : itiles_avx2<8>(job, t0, t1);
#endif
    default: return itiles_portable(job, t0, t1);
  }
}

// exp(x) for x ≤ 0 by the same operations on every path (so AVX-512 and scalar agree bit for bit):
// n = round(x·log2 e), r = x − n·ln 2 (two parts), a degree-6 Taylor polynomial in r by FMAs, × 2^n;
// x is clamped at −87 (2^n stays a normal float; what it gives there is ~1e-38, not 0).
constexpr float kLog2e = 1.44269504f, kLn2Hi = 0.693145752f, kLn2Lo = 1.42860677e-6f, kRound = 12582912.0f;
constexpr float kExpC[7] = {1.0f, 1.0f, 0.5f, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720};

inline float exp_scalar(float x) {
  x = std::max(x, -87.0f);
  const float n = std::fma(x, kLog2e, kRound) - kRound;
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = kExpC[6];
  for (int i = 5; i >= 0; --i) p = std::fma(p, r, kExpC[i]);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#ifdef LADE_X86
__attribute__((target("avx512f,fma"))) inline __m512 exp_avx512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(kRound)),
                                 _mm512_set1_ps(kRound));
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpC[6]);
  for (int i = 5; i >= 0; --i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC[i]));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// exp_avx512's operations 8 lanes at a time.
__attribute__((target("avx2,fma"))) inline __m256 exp_avx2(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(kRound)),
                                 _mm256_set1_ps(kRound));
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpC[6]);
  for (int i = 5; i >= 0; --i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

// ---- row prologues and the residual epilogue of MatMulBlockQ (int8 graphs' layer fusion) ----------
// What each row of X becomes before the product (attribute prologue), computed for that row alone by
// the same operations on every path (the AVX-512 code lane for lane as the scalar one, no contraction):
//   1, RMS norm (LLaMA's RMSNorm; Zhang & Sennrich 2019, arXiv 1910.07467; input 5 = γ [K], attribute
//      epsilon): r = 1 / sqrt(Σ_j x_j·x_j / K + ε), y_j = γ_j · (x_j · r), the sum as 16 partial sums
//      (lane l: the j ≡ l mod 16 in order), then halves added (lanes l + 8, l + 4, l + 2, l + 1);
//   2, SwiGLU (Shazeer 2020, arXiv 2002.05202; X [..., 2K] = [gate | up]): y_j = (g_j · σ(g_j)) · u_j,
//      σ(g) = 1 / (1 + e) for g ≥ 0 and e / (1 + e) below, e = exp(−|g|) (exp_scalar / exp_avx512).
// Input 4, when present, is added to each output after the product: Y = R + X·W (a residual stream).
constexpr int64_t kPrologueNone = 0, kPrologueRmsNorm = 1, kPrologueSwiGlu = 2;

float tree16(float* p) {  // Σ of 16 partial sums: halves added, l + 8, l + 4, l + 2, l + 1
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) p[l] = p[l] + p[l + w];
  return p[0];
}

inline float sigmoid_scalar(float g) {
  const float e = exp_scalar(-std::fabs(g));
  return g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

void rms_norm_row(const float* x, const float* gamma, int64_t k, float eps, float* y) {
  float part[16] = {};
  for (int64_t j = 0; j < k; j += 16)
    for (int l = 0; l < 16; ++l) {
      const float sq = x[j + l] * x[j + l];
      part[l] = part[l] + sq;
    }
  const float r = 1.0f / std::sqrt(tree16(part) / static_cast<float>(k) + eps);
  for (int64_t j = 0; j < k; ++j) y[j] = gamma[j] * (x[j] * r);
}

void swiglu_row(const float* x, int64_t k, float* y) {
  for (int64_t j = 0; j < k; ++j) {
    const float g = x[j], s = sigmoid_scalar(g);
    y[j] = (g * s) * x[k + j];
  }
}

#ifdef LADE_X86
__attribute__((target("avx512f,fma"))) void rms_norm_row_avx512(const float* x, const float* gamma, int64_t k,
                                                                 float eps, float* y) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < k; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  alignas(64) float part[16];
  _mm512_store_ps(part, acc);
  const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(tree16(part) / static_cast<float>(k) + eps));
  for (int64_t j = 0; j < k; j += 16)
    _mm512_storeu_ps(y + j, _mm512_mul_ps(_mm512_loadu_ps(gamma + j), _mm512_mul_ps(_mm512_loadu_ps(x + j), r)));
}

__attribute__((target("avx512f,avx512dq,fma"))) void swiglu_row_avx512(const float* x, int64_t k, float* y) {
  const __m512 one = _mm512_set1_ps(1.0f);
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    const __m512 g = _mm512_loadu_ps(x + j);
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __mmask16 up = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
    const __m512 s = _mm512_div_ps(_mm512_mask_blend_ps(up, e, one), _mm512_add_ps(one, e));
    _mm512_storeu_ps(y + j, _mm512_mul_ps(_mm512_mul_ps(g, s), _mm512_loadu_ps(x + k + j)));
  }
  for (; j < k; ++j) y[j] = (x[j] * sigmoid_scalar(x[j])) * x[k + j];
}

// The same two 8 lanes at a time: lane l of the 16 partial sums is lane l of the first half or l − 8 of the second.
__attribute__((target("avx2,fma"))) void rms_norm_row_avx2(const float* x, const float* gamma, int64_t k, float eps,
                                                           float* y) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; j += 16) {
    const __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + 8);
    lo = _mm256_add_ps(lo, _mm256_mul_ps(a, a));
    hi = _mm256_add_ps(hi, _mm256_mul_ps(b, b));
  }
  alignas(32) float part[16];
  _mm256_store_ps(part, lo);
  _mm256_store_ps(part + 8, hi);
  const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(tree16(part) / static_cast<float>(k) + eps));
  for (int64_t j = 0; j < k; j += 8)
    _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_loadu_ps(gamma + j), _mm256_mul_ps(_mm256_loadu_ps(x + j), r)));
}

__attribute__((target("avx2,fma"))) void swiglu_row_avx2(const float* x, int64_t k, float* y) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  int64_t j = 0;
  for (; j + 8 <= k; j += 8) {
    const __m256 g = _mm256_loadu_ps(x + j);
    const __m256 e = exp_avx2(_mm256_sub_ps(zero, _mm256_andnot_ps(sign, g)));
    const __m256 up = _mm256_cmp_ps(g, zero, _CMP_GE_OQ);
    const __m256 s = _mm256_div_ps(_mm256_blendv_ps(e, one, up), _mm256_add_ps(one, e));
    _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_mul_ps(g, s), _mm256_loadu_ps(x + k + j)));
  }
  for (; j < k; ++j) y[j] = (x[j] * sigmoid_scalar(x[j])) * x[k + j];
}
#endif

constexpr int64_t kPrologueRows = 8;  // rows per parallel task (a long prompt's chunk)

// The prologue of rows [r0, r1): X rows of `width` values → Y rows of k.
struct PrologueJob {
  const float* x;
  const float* gamma;
  float* y;
  int64_t rows, width, k, kind;
  float eps;
};

void prologue_rows(const PrologueJob& job, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = job.x + r * job.width;
    float* y = job.y + r * job.k;
#ifdef LADE_X86
    if (dispatch().float_avx512 && job.k % 16 == 0) {
      if (job.kind == kPrologueRmsNorm) rms_norm_row_avx512(x, job.gamma, job.k, job.eps, y);
      else swiglu_row_avx512(x, job.k, y);
      continue;
    }
    if (dispatch().float_avx2 && job.k % 16 == 0) {
      if (job.kind == kPrologueRmsNorm) rms_norm_row_avx2(x, job.gamma, job.k, job.eps, y);
      else swiglu_row_avx2(x, job.k, y);
      continue;
    }
#endif
    if (job.kind == kPrologueRmsNorm) rms_norm_row(x, job.gamma, job.k, job.eps, y);
    else swiglu_row(x, job.k, y);
  }
}

void run_prologue(void* data, size_t task) {
  const PrologueJob& job = *static_cast<const PrologueJob*>(data);
  const int64_t r0 = static_cast<int64_t>(task) * kPrologueRows;
  prologue_rows(job, r0, std::min(r0 + kPrologueRows, job.rows));
}

// ---- ONNX Runtime glue -------------------------------------------------------------------
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::vector<int64_t> shape_of(const Ort::ConstValue& v) { return v.GetTensorTypeAndShapeInfo().GetShape(); }

std::string dims(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

Packed read_packed(Ort::KernelContext& ctx, size_t first, int64_t n) {
  auto q = ctx.GetInput(first), d = ctx.GetInput(first + 1), m = ctx.GetInput(first + 2);
  const auto qs = shape_of(q), ds = shape_of(d), ms = shape_of(m);
  if (qs.size() != 3 || (qs[2] != 4 * 64 && qs[2] != 8 * 64))
    throw Error("packed weights " + dims(qs) + " are not [N/16, K/32, 256 or 512]");
  if (ds != std::vector<int64_t>{qs[0], qs[1], 16} || ms != ds)
    throw Error("scales " + dims(ds) + " and offsets " + dims(ms) + " are not [" + std::to_string(qs[0]) + ", " +
                std::to_string(qs[1]) + ", 16]");
  if (n <= 0 || n > qs[0] * 16 || n <= (qs[0] - 1) * 16)
    throw Error("attribute N = " + std::to_string(n) + " does not fit " + std::to_string(qs[0]) + " tiles of 16 columns");
  return {static_cast<int>(qs[2] / 64), qs[0], qs[1], n, static_cast<const uint8_t*>(q.GetTensorRawData()),
          static_cast<const uint16_t*>(d.GetTensorRawData()), static_cast<const uint16_t*>(m.GetTensorRawData())};
}

int64_t attribute_n(const OrtKernelInfo* info) {
  return Ort::ConstKernelInfo(info).GetAttribute<int64_t>("N");
}

int64_t attribute_compute(const OrtKernelInfo* info) {  // absent (older graphs): 0, float32
  int64_t value = 0;
  OrtStatus* status = Ort::GetApi().KernelInfoGetAttribute_int64(info, "compute", &value);
  if (status != nullptr) {
    Ort::GetApi().ReleaseStatus(status);
    return 0;
  }
  if (value != 0 && value != 1) throw Error("attribute compute = " + std::to_string(value) + " is not 0 (float32) or 1 (int8)");
  return value;
}

// Rounding the rows of X to int8 blocks (quantize_row), kQuantizeRows rows per parallel task.
constexpr int64_t kQuantizeRows = 4;
struct QuantizeJob {
  void (*quantize)(const float*, int64_t, int, int8_t*, float*, float*, int32_t*);
  const float* x;
  int64_t k;
  int bits;
  int64_t blocks, rows;
  int8_t* qa;
  float *dx, *sx;
  int32_t* qsum;
};

void quantize_rows(const QuantizeJob& j, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r)
    j.quantize(j.x + r * j.k, j.k, j.bits, j.qa + r * j.k, j.dx + r * j.blocks, j.sx + r * j.blocks,
               j.qsum + r * j.blocks);
}

void run_quantize(void* data, size_t task) {
  const QuantizeJob& j = *static_cast<const QuantizeJob*>(data);
  const int64_t r0 = static_cast<int64_t>(task) * kQuantizeRows;
  quantize_rows(j, r0, std::min(r0 + kQuantizeRows, j.rows));
}

// The float32-compute path's view of the rows of X (Job::xs, Job::sums): each element scaled by
// 2^(−bits·e), e its place in its lane word, and each block's plain sum Σ_j x_j in order j = 0 … 31,
// every row alone. The scaling is a product with a power of two, exact (correctly rounded where it
// lands among the subnormals, as ldexp is): the same bits as ldexp per element, which ran on the
// calling thread while the other waited (whole steps 0.84-0.94× of that, 1-16 tokens: step-costs.md).
struct ScaleJob {
  const float* x;
  int64_t k;
  int bits;
  int64_t blocks, rows;
  float* xs;    // [rows, K]
  float* sums;  // [rows, K/32]
};

constexpr int64_t kScaleRows = 8;  // rows per parallel task (a long prompt's chunk)

void scale_rows(const ScaleJob& j, int64_t r0, int64_t r1) {
  const int per = 32 / j.bits;
  float power[kBlock];  // 2^(−bits·(i mod per)), exact
  for (int i = 0; i < kBlock; ++i) power[i] = std::ldexp(1.0f, -j.bits * (i % per));
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < j.blocks; ++b) {
      const float* x = j.x + r * j.k + b * kBlock;
      float* xs = j.xs + r * j.k + b * kBlock;
      float s = 0.0f;
      for (int i = 0; i < kBlock; ++i) s += x[i];
      for (int i = 0; i < kBlock; ++i) xs[i] = x[i] * power[i];
      j.sums[r * j.blocks + b] = s;
    }
}

void run_scale(void* data, size_t task) {
  const ScaleJob& j = *static_cast<const ScaleJob*>(data);
  const int64_t r0 = static_cast<int64_t>(task) * kScaleRows;
  scale_rows(j, r0, std::min(r0 + kScaleRows, j.rows));
}

struct MatMulKernel {
  int64_t n;
  int64_t compute;  // 0: float32, 1: int8 activations (the exact integer path)
  int64_t prologue = kPrologueNone;  // what a row of X becomes first (row prologues, above)
  float epsilon = 0.0f;              // the RMS norm's ε
  OrtStatusPtr ComputeV2(OrtKernelContext* raw) {
    try {
      Ort::KernelContext ctx(raw);
      auto x = ctx.GetInput(0);
      const auto xs = shape_of(x);
      const Packed p = read_packed(ctx, 1, n);
      const int64_t k = p.blocks * kBlock, width = prologue == kPrologueSwiGlu ? 2 * k : k;
      if (xs.empty() || xs.back() != width)
        throw Error("X " + dims(xs) + " does not end in " + (prologue == kPrologueSwiGlu ? "2·K = " : "K = ") +
                    std::to_string(width));
      int64_t rows = 1;
      for (size_t i = 0; i + 1 < xs.size(); ++i) rows *= xs[i];
      std::vector<int64_t> ys(xs.begin(), xs.end() - 1);
      ys.push_back(p.n);
      const size_t inputs = ctx.GetInputCount();
      const bool residual = inputs > 4 && ctx.GetInput(4) != nullptr;
      const float* gamma = nullptr;
      if (prologue == kPrologueRmsNorm) {
        auto g = inputs > 5 ? ctx.GetInput(5) : Ort::ConstValue{nullptr};
        if (g == nullptr || shape_of(g) != std::vector<int64_t>{k})
          throw Error("the RMS norm prologue needs its weight γ [" + std::to_string(k) + "] as input 5");
        gamma = g.GetTensorData<float>();
      }
      if (residual && shape_of(ctx.GetInput(4)) != ys)
        throw Error("the residual R " + dims(shape_of(ctx.GetInput(4))) + " is not Y's shape " + dims(ys));
      auto y = ctx.GetOutput(0, ys);
      float* yd = y.GetTensorMutableData<float>();
      if (rows == 0) return nullptr;
      const float* xd = x.GetTensorData<float>();
      thread_local std::vector<float> rowsbuf;  // X's rows after the prologue
      if (prologue != kPrologueNone) {
        rowsbuf.resize(static_cast<size_t>(rows * k));
        PrologueJob job{xd, gamma, rowsbuf.data(), rows, width, k, prologue, epsilon};
        if (rows <= kPrologueRows) prologue_rows(job, 0, rows);
        else ctx.ParallelFor(run_prologue, static_cast<size_t>((rows + kPrologueRows - 1) / kPrologueRows), 0, &job);
        xd = rowsbuf.data();
      }
      OrtStatusPtr status = compute == 1 ? integer(ctx, p, xd, rows, k, yd) : floating(ctx, p, xd, rows, k, yd);
      if (status == nullptr && residual) {  // Y = R + X·W, element by element
        const float* r = ctx.GetInput(4).GetTensorData<float>();
        for (int64_t i = 0, total = rows * p.n; i < total; ++i) yd[i] = r[i] + yd[i];
      }
      return status;
    } catch (const std::exception& e) {
      return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, (std::string("MatMulBlockQ: ") + e.what()).c_str());
    }
  }

  OrtStatusPtr floating(Ort::KernelContext& ctx, const Packed& p, const float* xd, int64_t rows, int64_t k, float* yd) {
    Job job{};
    static_cast<Packed&>(job) = p;
    job.k = k;
    job.rows = rows;
    job.y = yd;
    // per calling thread, kept for the next call (ParallelFor's workers only read them while it waits)
    thread_local std::vector<float> scaled, sums;
    scaled.resize(static_cast<size_t>(rows * k));
    sums.resize(static_cast<size_t>(rows * p.blocks));
    ScaleJob scaling{xd, k, p.bits, p.blocks, rows, scaled.data(), sums.data()};
    if (rows <= kScaleRows) scale_rows(scaling, 0, rows);  // each row alone: any split, the same bits
    else ctx.ParallelFor(run_scale, static_cast<size_t>((rows + kScaleRows - 1) / kScaleRows), 0, &scaling);
    job.xs = scaled.data();
    job.sums = sums.data();
    job.chunk = 4;  // tiles (64 columns) per parallel task
    const size_t tasks = static_cast<size_t>((job.tiles + job.chunk - 1) / job.chunk);
    ctx.ParallelFor(run_task, tasks, 0, &job);
    return nullptr;
  }

  OrtStatusPtr integer(Ort::KernelContext& ctx, const Packed& p, const float* xd, int64_t rows, int64_t k, float* yd) {
    IJob job{};
    static_cast<Packed&>(job) = p;
    job.k = k;
    job.rows = rows;
    job.y = yd;
    job.path = dispatch().int_path;
    // per calling thread, kept for the next call (ParallelFor's workers only read them while it waits)
    thread_local std::vector<int8_t> qa;
    thread_local std::vector<float> dx, sx;
    thread_local std::vector<int32_t> qsum;
    qa.resize(static_cast<size_t>(rows * k));
    dx.resize(static_cast<size_t>(rows * p.blocks));
    sx.resize(dx.size());
    qsum.resize(dx.size());
    auto quantize = quantize_row;
#ifdef LADE_X86
    if (job.path == kAvx512Vnni || job.path == kAmx) quantize = quantize_row_avx512;
    else if (dispatch().float_avx2) quantize = quantize_row_avx2;
#endif
    QuantizeJob rounding{quantize, xd, k, p.bits, p.blocks, rows, qa.data(), dx.data(), sx.data(), qsum.data()};
    if (rows <= kQuantizeRows) quantize_rows(rounding, 0, rows);  // each row alone: any split, the same bits
    else ctx.ParallelFor(run_quantize, static_cast<size_t>((rows + kQuantizeRows - 1) / kQuantizeRows), 0, &rounding);
    job.qa = qa.data();
    job.dx = dx.data();
    job.sx = sx.data();
    job.qsum = qsum.data();
    job.chunk = 4;
    const size_t tasks = static_cast<size_t>((job.tiles + job.chunk - 1) / job.chunk);
    ctx.ParallelFor(run_itask, tasks, 0, &job);
    return nullptr;
  }
};

// Rows of the packed table (column v of a [H, V] weight is token v's embedding), dequantized.
struct GatherKernel {
  int64_t n;
  OrtStatusPtr ComputeV2(OrtKernelContext* raw) {
    try {
      Ort::KernelContext ctx(raw);
      const Packed p = read_packed(ctx, 0, n);
      auto ids = ctx.GetInput(3);
      std::vector<int64_t> os = shape_of(ids);
      const int64_t hidden = p.blocks * kBlock;
      os.push_back(hidden);
      auto out = ctx.GetOutput(0, os);
      float* o = out.GetTensorMutableData<float>();
      const int64_t* id = ids.GetTensorData<int64_t>();
      const size_t count = ids.GetTensorTypeAndShapeInfo().GetElementCount();
      const int per = 32 / p.bits;
      const uint32_t mask = (1u << p.bits) - 1;
      for (size_t t = 0; t < count; ++t) {
        const int64_t v = id[t];
        if (v < 0 || v >= p.n)
          throw Error("token id " + std::to_string(v) + " is outside the table's " + std::to_string(p.n) + " rows");
        const int64_t tile = v / 16, lane = v % 16;
        for (int64_t b = 0; b < p.blocks; ++b) {
          const int64_t at = tile * p.blocks + b;
          const uint32_t* words = reinterpret_cast<const uint32_t*>(p.q + at * p.bits * 64);
          const float d = half_to_float(p.d[at * 16 + lane]), m = half_to_float(p.m[at * 16 + lane]);
          for (int j = 0; j < kBlock; ++j) {
            const uint32_t code = (words[(j / per) * 16 + lane] >> (p.bits * (j % per))) & mask;
            o[t * hidden + b * kBlock + j] = static_cast<float>(code) * d + m;
          }
        }
      }
      return nullptr;
    } catch (const std::exception& e) {
      return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, (std::string("GatherBlockQ: ") + e.what()).c_str());
    }
  }
};

// Attention whose every query row is computed the same whatever else the step holds (int8-compute
// graphs; lade_export.export.quantize swaps it in for the onnx-ops attention subgraph):
//   AttentionRows(Q float[B, KV, G·S, D], PK, K float[B, KV, D, S], PV, V float[B, KV, S, D],
//                 masked bool[B, 1, 1, S, P+S]) -> [B, KV, G·S, D]
//   attributes scale, past_layout (absent or 0: PK [B, KV, D, P] and PV [B, KV, P, D], the graph's
//   Transposes of the cache; 1: PK and PV are the cache itself, sequence-major [B, P, KV, D], read in
//   place). Row r is step row t = r mod S; key j < P is the cache's, j ≥ P this step's.
// For each row: score_j = (Σ_d q_d·k_jd, FMAs in d order)·scale over the keys it sees, softmax with
// one sum in key order, out = Σ_j p_j·v_j in key order. A token's keys are its history in position
// order whether that history sits in the cache or in this step, and masked keys add nothing (not
// even zeros), so a row's bits do not depend on the step's width or on where the cache ends.
// Keys are taken in blocks of 16 columns (of the cache, then of the step); a block whose 16 mask
// bits are all masked for a row is skipped for that row (no score, no exp). Every key's score and
// exp are the same operations in a vector lane or alone, so skipping changes no visible score: a
// row's cost is the blocks it sees, and its bits do not depend on which other columns a packed pass
// holds (other requests' columns, unused room).
struct AttnJob {
  const float *q, *pk, *k, *pv, *v;
  const bool* masked;
  int64_t b, kv, rows, d, p, s;
  float scale;
  float* out;
  bool in_place;  // past_layout 1: PK, PV sequence-major [B, P, KV, D]
  const uint16_t *pk16, *pv16;  // AttentionRowsHalfCache: PK, PV float16 bits, sequence-major (pk, pv null)
  const uint8_t* seen;  // [B·S, nb_p + nb_s]: 1 where step row t sees some key of the 16-column block
  int64_t nb_p, nb_s;
  float* tiles;  // in_place: [B, KV, n_tiles, D, 16], the cache's keys of the blocks some row sees
  const int32_t* slot;  // in_place: [B, nb_p], the tile of a block some row of batch b sees, else −1
  int64_t n_tiles;  // in_place: most blocks seen in one batch entry
  const struct AttnGroup* groups;  // AVX-512: rows computed together (attention_group), else null
  const int32_t* group_rows;       // the groups' rows: indices into a head's G·S rows
  bool direct;                     // groups read the cache's keys in place, transposed in registers (no tiles)
  float* vtiles = nullptr;  // AVX-512 groups over tiles, float16 cache: [B, KV, n_tiles, 16, D], the values of
                            // the blocks some row sees, widened to float32 once for all the groups that read them
};

// Rows of one batch entry and KV head that see the same key blocks — the G query heads of a step
// row, and the step rows whose seen blocks agree — computed in one sweep (attention_group).
struct AttnGroup {
  int64_t bi, h;
  int32_t first, count;  // group_rows[first, first + count)
};
constexpr int kGroupRows = 8;  // most rows per group (fewer for wider heads: AttentionKernel)

constexpr int64_t kKeys = 16;  // key columns per block

// Element e of the cache's keys or values at flat index i (sequence-major), whatever the cache's type.
inline float cache_at(const float* f, const uint16_t* h, int64_t i) { return h ? half_to_float(h[i]) : f[i]; }

// Whether some of the n ≤ 16 mask bytes at m are 0 (a key the row sees).
inline bool block_seen(const bool* m, int64_t n) {
  if (n == kKeys) {
    uint64_t a, b;
    std::memcpy(&a, m, 8);
    std::memcpy(&b, m + 8, 8);
    return (a & b) != 0x0101010101010101ull;
  }
  for (int64_t j = 0; j < n; ++j)
    if (!m[j]) return true;
  return false;
}

// Whether all of the n ≤ 16 mask bytes at m are 0 (the row sees every key there).
inline bool every_key_seen(const bool* m, int64_t n) {
  if (n == kKeys) {
    uint64_t a, b;
    std::memcpy(&a, m, 8);
    std::memcpy(&b, m + 8, 8);
    return (a | b) == 0;
  }
  for (int64_t j = 0; j < n; ++j)
    if (m[j]) return false;
  return true;
}

#ifdef LADE_X86
// The vector pieces of softmax_row, attention_row and tiles_of (MODE 1: AVX-512, 2: AVX2 with FMA and
// F16C), each doing lane for lane what the scalar code beside its call does, so every mode gives the
// same bits. They are functions of their own so that the scalar code around them is compiled for any
// x86-64 CPU: a target attribute on the whole function let the compiler put AVX-512 instructions into
// the portable path too (a CPU without AVX-512 stopped on them).

// exp(x − top) for the 16 scores at x.
__attribute__((target("avx512f,fma"))) void exp16_avx512(float* x, float top) {
  _mm512_storeu_ps(x, exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x), _mm512_set1_ps(top))));
}
__attribute__((target("avx2,fma"))) void exp16_avx2(float* x, float top) {
  const __m256 t = _mm256_set1_ps(top);
  _mm256_storeu_ps(x, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x), t)));
  _mm256_storeu_ps(x + 8, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + 8), t)));
}

// dst[c] = (Σ_e fma(q[e], col[e·stride + c], ·) in e order) · scale for the block's keys c < width.
__attribute__((target("avx512f,fma"))) void scores16_avx512(const float* q, const float* col, int64_t stride,
                                                            int64_t d, int64_t width, float scale, float* dst) {
  const __mmask16 lanes = static_cast<__mmask16>(width == kKeys ? 0xffff : (1u << width) - 1);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t e = 0; e < d; ++e)
    acc = _mm512_fmadd_ps(_mm512_set1_ps(q[e]), _mm512_maskz_loadu_ps(lanes, col + e * stride), acc);
  _mm512_mask_storeu_ps(dst, lanes, _mm512_mul_ps(acc, _mm512_set1_ps(scale)));
}
// The same for NB ≤ 2 full blocks (16 keys each; cols[b], dst[b], one stride), each as two 8-lane
// halves: 2·NB independent FMA chains.
template <int NB>
__attribute__((target("avx2,fma"))) void scores16_avx2(const float* q, const float* const* cols, int64_t stride,
                                                       int64_t d, float scale, float* const* dst) {
  __m256 acc[NB][2];
  for (int b = 0; b < NB; ++b) acc[b][0] = acc[b][1] = _mm256_setzero_ps();
  for (int64_t e = 0; e < d; ++e) {
    const __m256 qe = _mm256_set1_ps(q[e]);
    for (int b = 0; b < NB; ++b) {
      const float* k = cols[b] + e * stride;
      acc[b][0] = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k), acc[b][0]);
      acc[b][1] = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k + 8), acc[b][1]);
    }
  }
  const __m256 sc = _mm256_set1_ps(scale);
  for (int b = 0; b < NB; ++b) {
    _mm256_storeu_ps(dst[b], _mm256_mul_ps(acc[b][0], sc));
    _mm256_storeu_ps(dst[b] + 8, _mm256_mul_ps(acc[b][1], sc));
  }
}

// out[e] = fma(weight, value[e], out[e]) for the first elements of d (returns how many: the rest is scalar).
__attribute__((target("avx512f,fma"))) int64_t values_avx512(float weight, const float* value, float* out, int64_t d) {
  int64_t e = 0;
  for (; e + 16 <= d; e += 16)
    _mm512_storeu_ps(out + e, _mm512_fmadd_ps(_mm512_set1_ps(weight), _mm512_loadu_ps(value + e), _mm512_loadu_ps(out + e)));
  return e;
}

// 8 values from float32, or from float16 widened exactly (F16C).
__attribute__((target("avx2,f16c"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,f16c"))) inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <typename T>
__attribute__((target("avx2,fma,f16c"))) int64_t values_avx2(float weight, const T* value, float* out, int64_t d) {
  int64_t e = 0;
  for (; e + 8 <= d; e += 8)
    _mm256_storeu_ps(out + e, _mm256_fmadd_ps(_mm256_set1_ps(weight), load8(value + e), _mm256_loadu_ps(out + e)));
  return e;
}
#endif

// The softmax of one row over the blocks it sees, in place in scores[0, P+S): the largest visible
// score, exp(score − top) for every key of a seen block, and the sum of the visible ones in key order
// (returned). The same operations for a row computed alone or in a group.
template <int MODE>
float softmax_row(const AttnJob& job, const bool* masked, const uint8_t* seen, float* scores) {
  const int64_t p = job.p, s = job.s;
  float top = -INFINITY;
  for (int part = 0; part < 2; ++part) {
    const int64_t n = part ? s : p, at = part ? p : 0, blocks = part ? job.nb_s : job.nb_p;
    for (int64_t i = 0; i < blocks; ++i) {
      if (!seen[(part ? job.nb_p : 0) + i]) continue;
      for (int64_t j = at + i * kKeys, end = at + std::min(n, (i + 1) * kKeys); j < end; ++j)
        if (!masked[j]) top = std::max(top, scores[j]);
    }
  }
  for (int part = 0; part < 2; ++part) {  // exp(score − top) for every key of a seen block
    const int64_t n = part ? s : p, at = part ? p : 0, blocks = part ? job.nb_s : job.nb_p;
    for (int64_t i = 0; i < blocks; ++i) {
      if (!seen[(part ? job.nb_p : 0) + i]) continue;
      int64_t j = at + i * kKeys;
      const int64_t end = at + std::min(n, (i + 1) * kKeys);
#ifdef LADE_X86
      if (MODE && end - j == kKeys) {
        if (MODE == 1) exp16_avx512(scores + j, top);
        else exp16_avx2(scores + j, top);
        continue;
      }
#endif
      for (; j < end; ++j) scores[j] = exp_scalar(scores[j] - top);
    }
  }
  float sum = 0.0f;
  for (int part = 0; part < 2; ++part) {
    const int64_t n = part ? s : p, at = part ? p : 0, blocks = part ? job.nb_s : job.nb_p;
    for (int64_t i = 0; i < blocks; ++i) {
      if (!seen[(part ? job.nb_p : 0) + i]) continue;
      for (int64_t j = at + i * kKeys, end = at + std::min(n, (i + 1) * kKeys); j < end; ++j)
        if (!masked[j]) sum += scores[j];
    }
  }
  return sum;
}

// MODE 0: portable; 1: AVX-512; 2: AVX2 (FMA, F16C).
template <int MODE>
void attention_row(const AttnJob& job, int64_t index, std::vector<float>& scores) {
  const int64_t rows = job.rows, d = job.d, p = job.p, s = job.s, total = p + s, kv = job.kv;
  const int64_t bi = index / (kv * rows), h = (index / rows) % kv, r = index % rows, t = r % s;
  const float* q = job.q + index * d;
  const bool* masked = job.masked + (bi * s + t) * total;
  const uint8_t* seen = job.seen + (bi * s + t) * (job.nb_p + job.nb_s);
  scores.resize(static_cast<size_t>(total));
  for (int part = 0; part < 2; ++part) {  // the cache's keys, then this step's
    const int64_t n = part ? s : p, at = part ? p : 0, blocks = part ? job.nb_s : job.nb_p;
    // keys of block i, element e, column c: cols[(i·D + e)·stride + c] (tiles: stride 16) or, head-major, keys[e·n + 16i + c]
    const bool tiled = !part && job.in_place;
    const float* keys = tiled ? job.tiles + (bi * kv + h) * job.n_tiles * d * kKeys
                              : (part ? job.k : job.pk) + (bi * kv + h) * d * n;
    const float* pending = nullptr;  // AVX2: a full block waiting for a second one (two blocks per sweep)
    float* pending_dst = nullptr;
    for (int64_t i = 0; i < blocks; ++i) {
      if (!seen[(part ? job.nb_p : 0) + i]) continue;
      const int64_t j0 = i * kKeys, width = std::min(kKeys, n - j0);
      const float* col = tiled ? keys + job.slot[bi * job.nb_p + i] * d * kKeys : keys + j0;
      const int64_t stride = tiled ? kKeys : n;
#ifdef LADE_X86
      if (MODE == 1) {
        scores16_avx512(q, col, stride, d, width, job.scale, scores.data() + at + j0);
        continue;
      }
      if (MODE == 2 && width == kKeys) {
        if (pending == nullptr) {
          pending = col;
          pending_dst = scores.data() + at + j0;
          continue;
        }
        const float* cols[2] = {pending, col};
        float* const dst[2] = {pending_dst, scores.data() + at + j0};
        scores16_avx2<2>(q, cols, stride, d, job.scale, dst);
        pending = nullptr;
        continue;
      }
#endif
      for (int64_t c = 0; c < width; ++c) {
        float acc = 0.0f;
        for (int64_t e = 0; e < d; ++e) acc = std::fma(q[e], col[e * stride + c], acc);
        scores[at + j0 + c] = acc * job.scale;
      }
    }
#ifdef LADE_X86
    if (MODE == 2 && pending != nullptr) scores16_avx2<1>(q, &pending, tiled ? kKeys : n, d, job.scale, &pending_dst);
#endif
  }
  const float sum = softmax_row<MODE>(job, masked, seen, scores.data());
  float* out = job.out + index * d;
  for (int64_t e = 0; e < d; ++e) out[e] = 0.0f;
  for (int part = 0; part < 2; ++part) {
    const int64_t n = part ? s : p, at = part ? p : 0, blocks = part ? job.nb_s : job.nb_p;
    for (int64_t i = 0; i < blocks; ++i) {
      if (!seen[(part ? job.nb_p : 0) + i]) continue;
      for (int64_t j = at + i * kKeys, end = at + std::min(n, (i + 1) * kKeys); j < end; ++j) {
        if (masked[j]) continue;
        const float weight = scores[j] / sum;
        if (!part && job.pv16) {  // the float16 cache, sequence-major
          const uint16_t* value = job.pv16 + ((bi * p + j) * kv + h) * d;
          int64_t e = 0;
#ifdef LADE_X86
          if (MODE == 2) e = values_avx2(weight, value, out, d);
#endif
          for (; e < d; ++e) out[e] = std::fma(weight, half_to_float(value[e]), out[e]);
          continue;
        }
        const float* value = !part ? (job.in_place ? job.pv + ((bi * p + j) * kv + h) * d
                                                   : job.pv + ((bi * kv + h) * p + j) * d)
                                   : job.v + ((bi * kv + h) * s + j - p) * d;
        int64_t e = 0;
#ifdef LADE_X86
        if (MODE == 1) e = values_avx512(weight, value, out, d);
        if (MODE == 2) e = values_avx2(weight, value, out, d);
#endif
        for (; e < d; ++e) out[e] = std::fma(weight, value[e], out[e]);
      }
    }
  }
}

void run_attention(void* data, size_t task) {
  const AttnJob& job = *static_cast<const AttnJob*>(data);
  thread_local std::vector<float> scores;
  if (dispatch().float_avx512) return attention_row<1>(job, static_cast<int64_t>(task), scores);
  if (dispatch().float_avx2) return attention_row<2>(job, static_cast<int64_t>(task), scores);
  attention_row<0>(job, static_cast<int64_t>(task), scores);
}

#ifdef LADE_X86
// A group of rows (AttnGroup) in one sweep over the blocks they all see: each key block (and each
// value row) is loaded once for the group and feeds the group's independent FMA chains, where
// attention_row reloads it per row and runs one chain. Every row's arithmetic is attention_row's
// on the AVX-512 path, operation for operation in the same order — its 16-lane score FMAs over
// the elements, × scale; softmax_row; weight = exp / sum (a vector division, IEEE like the scalar
// one); out = Σ fma(weight, value, out) over its visible keys in key order from 0, a masked key
// leaving the lanes untouched (mask3 FMA) instead of skipped — so a row's bits are those it has
// alone, in any group, step or thread split.
#define LADE_ATTN512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

// t[k] = element k of keys c = 0…15 (lane c; the row of key c at keys + c·stride, zeros for c ≥ width):
// a 16 × 16 transpose in registers, data movement only.
LADE_ATTN512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
LADE_ATTN512 inline __m512 load16(const uint16_t* p) {  // 16 float16 → float (exact)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
LADE_ATTN512 inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
LADE_ATTN512 inline __m512 load16(const uint16_t* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }

template <typename T>
LADE_ATTN512 __attribute__((always_inline)) inline void transpose16(const T* keys, int64_t stride, int64_t width,
                                                                   __m512* t) {
  __m512 r[16];
  for (int64_t c = 0; c < kKeys; ++c) r[c] = c < width ? load16(keys + c * stride) : _mm512_setzero_ps();
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: a0 b0 a1 b1 | a2 b2 a3 b3
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // lane L of r[4i + k]: element 4L + k of keys 4i … 4i + 3
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {  // gather lane L of r[k], r[4 + k], r[8 + k], r[12 + k]: element 4L + k
    const __m512 s0 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88), s1 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xDD),
                 s2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88), s3 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xDD);
    t[k] = _mm512_shuffle_f32x4(s0, s2, 0x88);
    t[k + 8] = _mm512_shuffle_f32x4(s0, s2, 0xDD);
    t[k + 4] = _mm512_shuffle_f32x4(s1, s3, 0x88);
    t[k + 12] = _mm512_shuffle_f32x4(s1, s3, 0xDD);
  }
}

// Asks for the n rows of `bytes` bytes at base, base + stride, … (elements) to be brought into the
// level-2 cache ahead of use, every 64-byte line a row touches (three for a 128-byte row that does not
// start on a line): data movement only (a prefetch neither faults nor changes any value).
// The sweeps below ask for the cache block kAheadBlocks ahead. A one-token step of SmolLM2's int4 build
// on two threads of a Zen 4 VM, a cache on 64-byte lines, against asking for the next block into level 1
// (bench/results/step-costs.md): 0.94× at 256 cached tokens, 0.88× at 512, 0.79× at 1024; asking into
// level 1 two blocks ahead gained nothing.
constexpr int64_t kAheadBlocks = 2;
template <typename T>
LADE_ATTN512 inline void prefetch_rows(const T* base, int64_t stride, int64_t n, int64_t bytes) {
  for (int64_t c = 0; c < n; ++c) {
    const uintptr_t row = reinterpret_cast<uintptr_t>(base + c * stride);
    for (uintptr_t line = row & ~uintptr_t(63); line < row + static_cast<uintptr_t>(bytes); line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
  }
}

// The rows of head h, batch entry bi, of the sequence-major cache blocks kAheadBlocks on from
// blocks[at] (at the first block, of every block up to there): keys (half = pk16, full = pk) or
// values (pv16, pv), whichever of the float16 or float32 cache the job has.
LADE_ATTN512 inline void prefetch_ahead(const AttnJob& job, const int64_t* blocks, int64_t at, int64_t nblocks,
                                        int64_t bi, int64_t h, const uint16_t* half, const float* full) {
  const int64_t p = job.p, kv = job.kv, d = job.d;
  for (int64_t ahead = at == 0 ? 1 : kAheadBlocks; ahead <= kAheadBlocks; ++ahead)
    if (at + ahead < nblocks && blocks[at + ahead] < job.nb_p) {
      const int64_t j = blocks[at + ahead] * kKeys, first = ((bi * p + j) * kv + h) * d, n = std::min(kKeys, p - j);
      if (half) prefetch_rows(half + first, kv * d, n, 2 * d);
      else prefetch_rows(full + first, kv * d, n, 4 * d);
    }
}

// Scores of N rows over one cache block read from the sequence-major cache itself (keys: the block's
// first key, stride KV·D; D a multiple of 16), 16 elements at a time transposed in registers: the
// FMAs of group_scores over a [D, 16] tile, in the same order, without the tile.
template <int N, typename T>
LADE_ATTN512 void group_scores_direct(const float* const* q, const T* keys, int64_t stride, int64_t width,
                                      int64_t d, float scale, float* const* dst) {
  const __mmask16 lanes = static_cast<__mmask16>(width == kKeys ? 0xffff : (1u << width) - 1);
  __m512 acc[N];
  for (int r = 0; r < N; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t e0 = 0; e0 < d; e0 += 16) {
    __m512 t[16];
    transpose16(keys + e0, stride, width, t);
    for (int k = 0; k < 16; ++k)
      for (int r = 0; r < N; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][e0 + k]), t[k], acc[r]);
  }
  for (int r = 0; r < N; ++r) _mm512_mask_storeu_ps(dst[r], lanes, _mm512_mul_ps(acc[r], _mm512_set1_ps(scale)));
}

// Scores of N rows over NB seen blocks (cols[b], stride[b], lanes[b]; dst[b][r]: where row r's go).
template <int N, int NB>
LADE_ATTN512 void group_scores(const float* const* q, const float* const* cols, const int64_t* stride,
                               const __mmask16* lanes, int64_t d, float scale, float* const (*dst)[kGroupRows]) {
  __m512 acc[NB][N];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < N; ++r) acc[b][r] = _mm512_setzero_ps();
  for (int64_t e = 0; e < d; ++e)
    for (int b = 0; b < NB; ++b) {
      const __m512 key = _mm512_maskz_loadu_ps(lanes[b], cols[b] + e * stride[b]);
      for (int r = 0; r < N; ++r) acc[b][r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][e]), key, acc[b][r]);
    }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < N; ++r)
      _mm512_mask_storeu_ps(dst[b][r], lanes[b], _mm512_mul_ps(acc[b][r], _mm512_set1_ps(scale)));
}

// Key j's value row v added to the N rows' accumulators: fma(w[r][j], v, acc) where row r sees key j.
// ALL: every row sees key j (the caller checked), so the FMAs need no mask — the same operations,
// without a mask register set per row and key.
template <int DV, int N, bool ALL>
LADE_ATTN512 __attribute__((always_inline)) inline void value_step(__m512 (&acc)[N][DV], const __m512 (&v)[DV],
                                                                   const bool* const* masked, const float* const* w,
                                                                   int64_t j) {
#pragma GCC unroll 8
  for (int r = 0; r < N; ++r) {
    const __m512 weight = _mm512_set1_ps(w[r][j]);
    if constexpr (ALL) {
#pragma GCC unroll 8
      for (int x = 0; x < DV; ++x) acc[r][x] = _mm512_fmadd_ps(weight, v[x], acc[r][x]);
    } else {
      const __mmask16 sees = masked[r][j] ? 0 : 0xffff;
#pragma GCC unroll 8
      for (int x = 0; x < DV; ++x) acc[r][x] = _mm512_mask3_fmadd_ps(weight, v[x], acc[r][x], sees);
    }
  }
}

// Keys [j0, j1) whose value rows start at `value`, `stride` elements apart, added to acc in key order. The
// accumulators are copied into locals that nothing outside this loop sees, so that they live in registers
// (the compiler kept the caller's array on the stack, storing it at every key).
template <int DV, int N, bool ALL, typename T>
LADE_ATTN512 __attribute__((always_inline)) inline void value_run(__m512 (&acc)[N][DV], const T* value, int64_t stride,
                                                                  int64_t j0, int64_t j1, const bool* const* masked,
                                                                  const float* const* w, const __mmask16* vmask) {
  __m512 a[N][DV];
#pragma GCC unroll 8
  for (int r = 0; r < N; ++r)
#pragma GCC unroll 8
    for (int x = 0; x < DV; ++x) a[r][x] = acc[r][x];
  __mmask16 lanes[DV];
#pragma GCC unroll 8
  for (int x = 0; x < DV; ++x) lanes[x] = vmask[x];
  for (int64_t j = j0; j < j1; ++j, value += stride) {
    __m512 v[DV];
#pragma GCC unroll 8
    for (int x = 0; x < DV; ++x) v[x] = load16(value + 16 * x, lanes[x]);
    value_step<DV, N, ALL>(a, v, masked, w, j);
  }
#pragma GCC unroll 8
  for (int r = 0; r < N; ++r)
#pragma GCC unroll 8
    for (int x = 0; x < DV; ++x) acc[r][x] = a[r][x];
}

// out[r] = Σ_j fma(w[r][j], value_j, ·) over the keys of the seen blocks, in order, for N rows whose
// D elements fill DV vectors (vmask: the lanes of each).
template <int DV, int N>
LADE_ATTN512 void group_values(const AttnJob& job, int64_t bi, int64_t h, const int64_t* blocks, int64_t nblocks,
                               const bool* const* masked, const float* const* w, float* const* out,
                               const __mmask16* vmask) {
  const int64_t d = job.d, p = job.p, s = job.s, kv = job.kv;
  __m512 acc[N][DV];
  for (int r = 0; r < N; ++r)
    for (int x = 0; x < DV; ++x) acc[r][x] = _mm512_setzero_ps();
  for (int64_t at = 0; at < nblocks; ++at) {
    const int64_t gi = blocks[at], part = gi >= job.nb_p, i = part ? gi - job.nb_p : gi;
    const int64_t base = part ? p : 0, j0 = base + i * kKeys, end = base + std::min((part ? s : p), (i + 1) * kKeys);
    if (!part && job.vtiles) {  // the block's values widened once (tiles_of), contiguous
      const float* value = job.vtiles + ((bi * kv + h) * job.n_tiles + job.slot[bi * job.nb_p + i]) * kKeys * d;
      bool all = true;  // every row sees every key of the block: FMAs without masks
      for (int r = 0; r < N && all; ++r) all = every_key_seen(masked[r] + j0, end - j0);
      if (all) value_run<DV, N, true>(acc, value, d, j0, end, masked, w, vmask);
      else value_run<DV, N, false>(acc, value, d, j0, end, masked, w, vmask);
      continue;
    }
    if (job.in_place) prefetch_ahead(job, blocks, at, nblocks, bi, h, job.pv16, job.pv);
    // One loop per kind of value row, every (row, element) loop unrolled, so that the accumulators stay in
    // registers (as one loop with the kind tested per key, they were stored to the stack at every key).
    if (!part && job.pv16) {  // the float16 cache, sequence-major
      const uint16_t* value = job.pv16 + ((bi * p + j0) * kv + h) * d;
      value_run<DV, N, false>(acc, value, kv * d, j0, end, masked, w, vmask);
    } else {
      const int64_t stride = !part && job.in_place ? kv * d : d;
      const float* value = !part ? (job.in_place ? job.pv + ((bi * p + j0) * kv + h) * d
                                                 : job.pv + ((bi * kv + h) * p + j0) * d)
                                 : job.v + ((bi * kv + h) * s + j0 - p) * d;
      value_run<DV, N, false>(acc, value, stride, j0, end, masked, w, vmask);
    }
  }
  for (int r = 0; r < N; ++r)
    for (int x = 0; x < DV; ++x) _mm512_mask_storeu_ps(out[r] + 16 * x, vmask[x], acc[r][x]);
}

// Rows [0, n) of a group in chunks of R (their accumulators fit the 32 vector registers).
template <int DV>
LADE_ATTN512 void group_values_chunks(const AttnJob& job, int64_t bi, int64_t h, const int64_t* blocks,
                                      int64_t nblocks, const bool* const* masked, const float* const* w,
                                      float* const* out, const __mmask16* vmask, int n) {
  constexpr int R = DV >= 8 ? 3 : DV >= 4 ? 6 : 8;
  for (int c = 0; c < n; c += R) {
    const int m = std::min(R, n - c);
#define LADE_VALUES(M)                                                                                          \
  case M:                                                                                                     \
    if constexpr (M <= R) group_values<DV, M>(job, bi, h, blocks, nblocks, masked + c, w + c, out + c, vmask); \
    break;
    switch (m) { LADE_VALUES(1) LADE_VALUES(2) LADE_VALUES(3) LADE_VALUES(4) LADE_VALUES(5) LADE_VALUES(6)
                 LADE_VALUES(7) LADE_VALUES(8) }
#undef LADE_VALUES
  }
}

// Block gi of the seen list (cache blocks, then the step's): its first column j0 in [0, P+S), and its key lanes.
LADE_ATTN512 inline void seen_block(const AttnJob& job, int64_t gi, int64_t& j0, __mmask16& lanes) {
  const int64_t part = gi >= job.nb_p, i = part ? gi - job.nb_p : gi;
  const int64_t width = std::min(kKeys, (part ? job.s : job.p) - i * kKeys);
  j0 = (part ? job.p : 0) + i * kKeys;
  lanes = static_cast<__mmask16>(width == kKeys ? 0xffff : (1u << width) - 1);
}

// The lanes of `lanes` whose mask byte at m is 0 (keys the row sees).
LADE_ATTN512 inline __mmask16 visible_keys(const bool* m, __mmask16 lanes) {
  return _mm_mask_cmpeq_epi8_mask(lanes, _mm_maskz_loadu_epi8(lanes, m), _mm_setzero_si128());
}

// sums[r] = Σ scores[r][j] over the keys of the seen blocks, in key order, one chain per row (the rows'
// chains side by side, their pointers and sums in registers).
template <int N>
LADE_ATTN512 void group_sums(const AttnJob& job, const int64_t* blocks, int64_t nblocks, float* const* scores,
                             float* sums) {
  float acc[N];
  const float* row[N];
  for (int r = 0; r < N; ++r) acc[r] = 0.0f, row[r] = scores[r];
  for (int64_t at = 0; at < nblocks; ++at) {
    int64_t j0;
    __mmask16 lanes;
    seen_block(job, blocks[at], j0, lanes);
    const int64_t end = j0 + __builtin_popcount(lanes);
    for (int64_t j = j0; j < end; ++j)
#pragma GCC unroll 8
      for (int r = 0; r < N; ++r) acc[r] += row[r][j];
  }
  for (int r = 0; r < N; ++r) sums[r] = acc[r];
}

// softmax_row for the n rows of a group, with its results: top = the largest visible score (here a
// running maximum per lane, then over the lanes: the maximum of the same non-NaN values, NaN scores
// ignored as std::max ignores them; only the sign of a zero top can differ, and exp(score − top)
// does not see it, exp(±0) being 1 on every path); exp(score − top) for every visible key of a seen
// block (the same calls), +0 stored for the others; the sum of the visible ones in key order, each row
// its own chain, adding every key of the seen blocks (a masked key's +0 leaves a sum of exps — never
// −0 — unchanged, so the sum is softmax_row's). sums[r]: row r's sum.
LADE_ATTN512 void group_softmax(const AttnJob& job, const int64_t* blocks, int64_t nblocks, const bool* const* masked,
                                float* const* scores, int n, float* sums) {
  const int64_t p = job.p, s = job.s;
  for (int r = 0; r < n; ++r) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t at = 0; at < nblocks; ++at) {
      int64_t j0;
      __mmask16 lanes;
      seen_block(job, blocks[at], j0, lanes);
      const __mmask16 sees = visible_keys(masked[r] + j0, lanes);
      top = _mm512_mask_max_ps(top, sees, _mm512_maskz_loadu_ps(lanes, scores[r] + j0), top);
    }
    const float most = _mm512_reduce_max_ps(top);
    for (int64_t at = 0; at < nblocks; ++at) {  // a key the row does not see keeps +0 (what the sum adds for it)
      int64_t j0;
      __mmask16 lanes;
      seen_block(job, blocks[at], j0, lanes);
      if (lanes == 0xffff) {
        const __mmask16 sees = visible_keys(masked[r] + j0, lanes);
        _mm512_storeu_ps(scores[r] + j0, _mm512_maskz_mov_ps(sees, exp_avx512(_mm512_sub_ps(
                                                                      _mm512_loadu_ps(scores[r] + j0), _mm512_set1_ps(most)))));
      } else {
        for (int64_t j = j0; j < j0 + __builtin_popcount(lanes); ++j)
          scores[r][j] = masked[r][j] ? 0.0f : exp_scalar(scores[r][j] - most);
      }
    }
  }
  switch (n) {  // each row's sum in key order (+0 for the keys it does not see): n chains side by side
#define LADE_SUMS(N) \
  case N:          \
    return group_sums<N>(job, blocks, nblocks, scores, sums);
    LADE_SUMS(1) LADE_SUMS(2) LADE_SUMS(3) LADE_SUMS(4) LADE_SUMS(5) LADE_SUMS(6) LADE_SUMS(7) LADE_SUMS(8)
#undef LADE_SUMS
  }
}

LADE_ATTN512 void attention_group(const AttnJob& job, const AttnGroup& group, std::vector<float>& buffer,
                                  std::vector<int64_t>& blocks) {
  const int64_t d = job.d, p = job.p, s = job.s, total = p + s, kv = job.kv, bi = group.bi, h = group.h;
  const int n = group.count;
  buffer.resize(static_cast<size_t>(n * total));
  const float* q[kGroupRows];
  float* scores[kGroupRows];
  float* out[kGroupRows];
  const bool* masked[kGroupRows];
  for (int r = 0; r < n; ++r) {
    const int64_t row = job.group_rows[group.first + r], index = (bi * kv + h) * job.rows + row;
    q[r] = job.q + index * d;
    out[r] = job.out + index * d;
    masked[r] = job.masked + (bi * s + row % s) * total;
    scores[r] = buffer.data() + r * total;
  }
  const uint8_t* seen = job.seen + (bi * s + job.group_rows[group.first] % s) * (job.nb_p + job.nb_s);
  blocks.clear();
  for (int64_t gi = 0; gi < job.nb_p + job.nb_s; ++gi)
    if (seen[gi]) blocks.push_back(gi);
  const int64_t nblocks = static_cast<int64_t>(blocks.size());
  const float* keys_tiles = job.in_place ? job.tiles + (bi * kv + h) * job.n_tiles * d * kKeys : nullptr;
  int64_t at = 0;
  if (job.direct)  // the cache's blocks straight from the sequence-major cache (no tiles were made)
    for (; at < nblocks && blocks[at] < job.nb_p; ++at) {
      const int64_t j0 = blocks[at] * kKeys, width = std::min(kKeys, p - j0), first = ((bi * p + j0) * kv + h) * d;
      prefetch_ahead(job, blocks.data(), at, nblocks, bi, h, job.pk16, job.pk);  // while this block is computed
      float* dst[kGroupRows];
      for (int r = 0; r < n; ++r) dst[r] = scores[r] + j0;
#define LADE_DIRECT(M)                                                                       \
  case M:                                                                                    \
    if (job.pk16) group_scores_direct<M>(q, job.pk16 + first, kv * d, width, d, job.scale, dst); \
    else group_scores_direct<M>(q, job.pk + first, kv * d, width, d, job.scale, dst);          \
    break;
      switch (n) { LADE_DIRECT(1) LADE_DIRECT(2) LADE_DIRECT(3) LADE_DIRECT(4) LADE_DIRECT(5) LADE_DIRECT(6)
                   LADE_DIRECT(7) LADE_DIRECT(8) }
#undef LADE_DIRECT
    }
  // scores: two blocks at a time (2·n independent FMA chains: one block's n chains wait on their latency)
  const int pair = 2;
  for (; at < nblocks; at += pair) {
    const int nb = static_cast<int>(std::min<int64_t>(pair, nblocks - at));
    const float* cols[2];
    int64_t stride[2];
    __mmask16 lanes[2];
    float* dst[2][kGroupRows];
    for (int b = 0; b < nb; ++b) {
      const int64_t gi = blocks[at + b], part = gi >= job.nb_p, i = part ? gi - job.nb_p : gi;
      const int64_t keys = part ? s : p, j0 = i * kKeys, width = std::min(kKeys, keys - j0);
      const bool tiled = !part && job.in_place;
      cols[b] = tiled ? keys_tiles + job.slot[bi * job.nb_p + i] * d * kKeys
                      : (part ? job.k : job.pk) + (bi * kv + h) * d * keys + j0;
      stride[b] = tiled ? kKeys : keys;
      lanes[b] = static_cast<__mmask16>(width == kKeys ? 0xffff : (1u << width) - 1);
      for (int r = 0; r < n; ++r) dst[b][r] = scores[r] + (part ? p : 0) + j0;
    }
#define LADE_SCORES(M)                                                                       \
  case M:                                                                                  \
    if (nb == 2) group_scores<M, 2>(q, cols, stride, lanes, d, job.scale, dst);            \
    else group_scores<M, 1>(q, cols, stride, lanes, d, job.scale, dst);                    \
    break;
    switch (n) { LADE_SCORES(1) LADE_SCORES(2) LADE_SCORES(3) LADE_SCORES(4) LADE_SCORES(5) LADE_SCORES(6)
                 LADE_SCORES(7) LADE_SCORES(8) }
#undef LADE_SCORES
  }
  float sums[kGroupRows];
  group_softmax(job, blocks.data(), nblocks, masked, scores, n, sums);
  for (int r = 0; r < n; ++r) {  // weight = exp / sum over the seen blocks' keys
    const __m512 sum = _mm512_set1_ps(sums[r]);
    for (int64_t at = 0; at < nblocks; ++at) {
      const int64_t gi = blocks[at], part = gi >= job.nb_p, i = part ? gi - job.nb_p : gi;
      const int64_t keys = part ? s : p, j0 = (part ? p : 0) + i * kKeys, width = std::min(kKeys, keys - i * kKeys);
      const __mmask16 lanes = static_cast<__mmask16>(width == kKeys ? 0xffff : (1u << width) - 1);
      _mm512_mask_storeu_ps(scores[r] + j0, lanes, _mm512_div_ps(_mm512_maskz_loadu_ps(lanes, scores[r] + j0), sum));
    }
  }
  __mmask16 vmask[8];
  for (int x = 0; x < 8; ++x) {
    const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, d - 16 * x));
    vmask[x] = static_cast<__mmask16>(left == 16 ? 0xffff : (1u << left) - 1);
  }
  const float* const* w = scores;
  if (d <= 16) return group_values_chunks<1>(job, bi, h, blocks.data(), nblocks, masked, w, out, vmask, n);
  if (d <= 32) return group_values_chunks<2>(job, bi, h, blocks.data(), nblocks, masked, w, out, vmask, n);
  if (d <= 64) return group_values_chunks<4>(job, bi, h, blocks.data(), nblocks, masked, w, out, vmask, n);
  group_values_chunks<8>(job, bi, h, blocks.data(), nblocks, masked, w, out, vmask, n);
}

void run_attention_groups(void* data, size_t task) {
  const AttnJob& job = *static_cast<const AttnJob*>(data);
  thread_local std::vector<float> buffer;
  thread_local std::vector<int64_t> blocks;
  attention_group(job, job.groups[task], buffer, blocks);
}
#endif

// In-place cache (past_layout 1): the keys of the blocks some row of batch b sees, laid out as
// [D, 16] tiles (what the graph's Transpose gave, for those blocks only; a copy, no arithmetic).
// Task = (b, kv head, kTileTasks consecutive blocks).
constexpr int64_t kTileTasks = 8;

#ifdef LADE_X86
// A block's [D, 16] tile from its keys (key c, element e at keys[c·stride + e]; zeros for c ≥ width):
// data movement only, and float16 keys widened exactly. AVX-512: 16 × 16 transposes in registers
// (D a multiple of 16) or gathers (float32 keys).
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) bool tile16_avx512(const T* keys, int64_t stride, int64_t d,
                                                                           int64_t width, float* tile) {
  if (d % 16 == 0) {
    for (int64_t e0 = 0; e0 < d; e0 += 16) {
      __m512 t[16];
      transpose16(keys + e0, stride, width, t);
      for (int k = 0; k < 16; ++k) _mm512_storeu_ps(tile + (e0 + k) * kKeys, t[k]);
    }
    return true;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (stride * kKeys < (int64_t{1} << 31)) {
      const __mmask16 lanes = static_cast<__mmask16>(width == kKeys ? 0xffff : (1u << width) - 1);
      const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int>(stride)));
      for (int64_t e = 0; e < d; ++e)
        _mm512_storeu_ps(tile + e * kKeys, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, at, keys + e, 4));
      return true;
    }
  }
  return false;
}


// The width ≤ 16 value rows of a block (key c, element e at values[c·stride + e], D a multiple of 16) as float32
// rows of D: data movement and exact widening only.
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void widen_values_avx512(const uint16_t* values, int64_t stride,
                                                                                 int64_t d, int64_t width, float* out) {
  for (int64_t c = 0; c < width; ++c)
    for (int64_t e0 = 0; e0 < d; e0 += 16)
      _mm512_storeu_ps(out + c * d + e0, load16(values + c * stride + e0));
}

// AVX2: a full block (width 16) with D a multiple of 8, in 8 × 8 transposes.
template <typename T>
__attribute__((target("avx2,f16c"))) bool tile16_avx2(const T* keys, int64_t stride, int64_t d, int64_t width,
                                                      float* tile) {
  if (width != kKeys || d % 8 != 0) return false;
  for (int64_t c0 = 0; c0 < kKeys; c0 += 8)
    for (int64_t e0 = 0; e0 < d; e0 += 8) {
      __m256 r[8], t[8];
      for (int c = 0; c < 8; ++c) r[c] = load8(keys + (c0 + c) * stride + e0);
      for (int i = 0; i < 4; ++i) {  // t[2i], t[2i+1]: rows 2i and 2i+1 interleaved
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
      }
      for (int i = 0; i < 2; ++i) {  // within each 128-bit half: element k of rows 4i … 4i + 3
        r[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
      }
      for (int k = 0; k < 4; ++k) {  // element k (low halves) and k + 4 (high halves) of rows 0 … 7
        _mm256_storeu_ps(tile + (e0 + k) * kKeys + c0, _mm256_permute2f128_ps(r[k], r[4 + k], 0x20));
        _mm256_storeu_ps(tile + (e0 + k + 4) * kKeys + c0, _mm256_permute2f128_ps(r[k], r[4 + k], 0x31));
      }
    }
  return true;
}
#endif

// In-place cache (past_layout 1) tiles of task `task` (MODE as attention_row's).
template <int MODE>
void tiles_of(const AttnJob& job, int64_t task) {
  const int64_t chunks = (job.nb_p + kTileTasks - 1) / kTileTasks, d = job.d, kv = job.kv;
  const int64_t bi = task / (kv * chunks), h = (task / chunks) % kv, first = (task % chunks) * kTileTasks;
  float* tiles = job.tiles + (bi * kv + h) * job.n_tiles * d * kKeys;
  for (int64_t i = first; i < std::min(job.nb_p, first + kTileTasks); ++i) {
    const int32_t at = job.slot[bi * job.nb_p + i];
    if (at < 0) continue;
    float* tile = tiles + at * d * kKeys;
    const int64_t j0 = i * kKeys, width = std::min(kKeys, job.p - j0);
    const int64_t at0 = ((bi * job.p + j0) * kv + h) * d;  // key j0 + c, element e: at0 + c·KV·D + e
    const float* keys = job.pk16 ? nullptr : job.pk + at0;
    const uint16_t* keys16 = job.pk16 ? job.pk16 + at0 : nullptr;
#ifdef LADE_X86
    if (MODE == 1 && job.vtiles)  // the block's values, key after key, widened from float16 (exact)
      widen_values_avx512(job.pv16 + at0, kv * d, d, width, job.vtiles + ((bi * kv + h) * job.n_tiles + at) * kKeys * d);
    if (MODE == 1 && (keys16 ? tile16_avx512(keys16, kv * d, d, width, tile) : tile16_avx512(keys, kv * d, d, width, tile)))
      continue;
    if (MODE == 2 && (keys16 ? tile16_avx2(keys16, kv * d, d, width, tile) : tile16_avx2(keys, kv * d, d, width, tile)))
      continue;
#endif
    for (int64_t c = 0; c < kKeys; ++c)
      for (int64_t e = 0; e < d; ++e) tile[e * kKeys + c] = c < width ? cache_at(keys, keys16, c * kv * d + e) : 0.0f;
  }
}

void run_tiles(void* data, size_t task) {
  const AttnJob& job = *static_cast<const AttnJob*>(data);
  if (dispatch().float_avx512) return tiles_of<1>(job, static_cast<int64_t>(task));
  if (dispatch().float_avx2) return tiles_of<2>(job, static_cast<int64_t>(task));
  tiles_of<0>(job, static_cast<int64_t>(task));
}

// One AttentionRows pass over shapes already checked: Q [B, KV, rows, D], this step's K [B, KV, D, S] and
// V [B, KV, S, D], the cache (pk/pv float32, or pk16/pv16 float16 bits; in place: sequence-major [B, P, KV, D],
// else PK [B, KV, D, P] and PV [B, KV, P, D]), masked [B, 1, 1, S, P+S] → out [B, KV, rows, D].
void attention_rows(Ort::KernelContext& ctx, const float* q, const float* pk, const float* k, const float* pv,
                    const float* v, const bool* m, const uint16_t* pk16, const uint16_t* pv16, float* out, int64_t b,
                    int64_t kv, int64_t rows, int64_t d, int64_t p, int64_t s, float scale, bool in_place) {
  const int64_t nb_p = (p + kKeys - 1) / kKeys, nb_s = (s + kKeys - 1) / kKeys, total = p + s;
  // per step row: which blocks of 16 columns it sees (shared by every head and query group)
  thread_local std::vector<uint8_t> seen;
  thread_local std::vector<int32_t> slot;
  thread_local std::vector<float> tiles;
  seen.assign(static_cast<size_t>(b * s * (nb_p + nb_s)), 0);
  slot.assign(static_cast<size_t>(b * nb_p), -1);
  for (int64_t bt = 0; bt < b * s; ++bt) {
    const bool* row = m + bt * total;
    uint8_t* flags = seen.data() + bt * (nb_p + nb_s);
    for (int64_t i = 0; i < nb_p; ++i)
      if ((flags[i] = block_seen(row + i * kKeys, std::min(kKeys, p - i * kKeys)))) slot[(bt / s) * nb_p + i] = 0;
    for (int64_t i = 0; i < nb_s; ++i)
      flags[nb_p + i] = block_seen(row + p + i * kKeys, std::min(kKeys, s - i * kKeys));
  }
  int64_t n_tiles = 0;  // tiles only for the blocks seen: memory follows the pass's requests, not the pool
  for (int64_t bi = 0; bi < b; ++bi) {
    int32_t count = 0;
    for (int64_t i = 0; i < nb_p; ++i)
      if (slot[bi * nb_p + i] == 0) slot[bi * nb_p + i] = count++;
    n_tiles = std::max<int64_t>(n_tiles, count);
  }
  AttnJob job{q, pk, k, pv, v, m, b, kv, rows, d, p, s, scale, out,
              in_place, pk16, pv16, seen.data(), nb_p, nb_s, nullptr, slot.data(), n_tiles,
              nullptr, nullptr, false};
#ifdef LADE_X86
  if (dispatch().float_avx512 && d <= 128 && b * kv * rows) {  // rows that see the same blocks, in groups
    thread_local std::vector<AttnGroup> groups;
    thread_local std::vector<int32_t> group_rows;
    thread_local std::vector<int32_t> readers;  // [B, nb_p]: groups per head that see the cache block
    groups.clear();
    group_rows.clear();
    readers.assign(static_cast<size_t>(b * nb_p), 0);
    const int64_t heads = rows / s, width = nb_p + nb_s;
    // rows per group: as many as the value sweep holds in registers (group_values_chunks), so that
    // each group reads the values once
    const int64_t most = d <= 32 ? kGroupRows : d <= 64 ? 6 : 3;
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t t0 = 0, t1; t0 < s; t0 = t1) {  // step rows [t0, t1) see the same blocks
        const uint8_t* flags = seen.data() + (bi * s + t0) * width;
        for (t1 = t0 + 1; t1 < s && std::memcmp(seen.data() + (bi * s + t1) * width, flags, width) == 0;) ++t1;
        const int64_t first = static_cast<int64_t>(group_rows.size()), count = (t1 - t0) * heads;
        for (int64_t t = t0; t < t1; ++t)  // the query heads of a step row side by side
          for (int64_t g = 0; g < heads; ++g) group_rows.push_back(static_cast<int32_t>(g * s + t));
        const int64_t parts = (count + most - 1) / most, size = (count + parts - 1) / parts;
        for (int64_t h = 0; h < kv; ++h)
          for (int64_t at = 0; at < count; at += size)
            groups.push_back({bi, h, static_cast<int32_t>(first + at),
                              static_cast<int32_t>(std::min(size, count - at))});
        for (int64_t i = 0; i < nb_p; ++i) readers[bi * nb_p + i] += flags[i] ? static_cast<int32_t>(parts) : 0;
      }
    // A cache block read by up to four groups is transposed in registers by each; by more, copied once
    // into a tile that they all load. The copy costs about what two in-register transposes cost, but it
    // is a parallel section of its own before the groups': in whole steps on two threads (2026-12-04,
    // bench/results/step-costs.md) 5-8 rows (3-4 groups per KV head at head width 64) ran 3-9% faster
    // without tiles, 12-16 rows 3-10% slower.
    job.direct = in_place && d % 16 == 0 &&
                 (readers.empty() || *std::max_element(readers.begin(), readers.end()) <= 4);
    if (in_place && !job.direct) {
      tiles.resize(static_cast<size_t>(b * kv * n_tiles * d * kKeys));
      job.tiles = tiles.data();
      if (pv16 && d % 16 == 0) {  // values too: each group would widen every value row again
        thread_local std::vector<float> vtiles;
        vtiles.resize(static_cast<size_t>(b * kv * n_tiles * kKeys * d));
        job.vtiles = vtiles.data();
      }
      if (b * kv * n_tiles)
        ctx.ParallelFor(run_tiles, static_cast<size_t>(b * kv * ((nb_p + kTileTasks - 1) / kTileTasks)), 0, &job);
    }
    job.groups = groups.data();
    job.group_rows = group_rows.data();
    ctx.ParallelFor(run_attention_groups, groups.size(), 0, &job);
    return;
  }
#endif
  if (in_place) {
    tiles.resize(static_cast<size_t>(b * kv * n_tiles * d * kKeys));
    job.tiles = tiles.data();
    if (b * kv * n_tiles)
      ctx.ParallelFor(run_tiles, static_cast<size_t>(b * kv * ((nb_p + kTileTasks - 1) / kTileTasks)), 0, &job);
  }
  if (b * kv * rows) ctx.ParallelFor(run_attention, static_cast<size_t>(b * kv * rows), 0, &job);
}

struct AttentionKernel {
  float scale;
  int64_t past_layout;
  bool half_cache = false;  // AttentionRowsHalfCache: PK, PV float16, read in place (past_layout 1)
  OrtStatusPtr ComputeV2(OrtKernelContext* raw) {
    try {
      Ort::KernelContext ctx(raw);
      auto q = ctx.GetInput(0), pk = ctx.GetInput(1), k = ctx.GetInput(2), pv = ctx.GetInput(3), v = ctx.GetInput(4),
           masked = ctx.GetInput(5);
      const auto qs = shape_of(q), pks = shape_of(pk), ks = shape_of(k), pvs = shape_of(pv), vs = shape_of(v),
                 ms = shape_of(masked);
      const bool in_place = past_layout == 1;
      if (half_cache && !in_place) throw Error("a float16 cache is read in place only (past_layout 1)");
      if (qs.size() != 4 || pks.size() != 4 || ks.size() != 4 || pvs.size() != 4 || vs.size() != 4 || ms.size() != 5)
        throw Error(in_place ? "inputs are not Q [B, KV, G·S, D], PK [B, P, KV, D], K [B, KV, D, S], PV [B, P, KV, D], "
                               "V [B, KV, S, D], masked [B, 1, 1, S, P+S]"
                             : "inputs are not Q [B, KV, G·S, D], PK [B, KV, D, P], K [B, KV, D, S], PV [B, KV, P, D], "
                               "V [B, KV, S, D], masked [B, 1, 1, S, P+S]");
      const int64_t b = qs[0], kv = qs[1], rows = qs[2], d = qs[3], p = in_place ? pks[1] : pks[3], s = ks[3];
      const std::vector<int64_t> want_pk = in_place ? std::vector<int64_t>{b, p, kv, d} : std::vector<int64_t>{b, kv, d, p},
                                 want_pv = in_place ? std::vector<int64_t>{b, p, kv, d} : std::vector<int64_t>{b, kv, p, d};
      if (pks != want_pk || ks != std::vector<int64_t>{b, kv, d, s} || pvs != want_pv ||
          vs != std::vector<int64_t>{b, kv, s, d} || ms != std::vector<int64_t>{b, 1, 1, s, p + s} || s == 0 ||
          rows % s)
        throw Error("Q " + dims(qs) + ", PK " + dims(pks) + ", K " + dims(ks) + ", PV " + dims(pvs) + ", V " +
                    dims(vs) + " and masked " + dims(ms) + " do not fit together");
      auto out = ctx.GetOutput(0, qs);
      attention_rows(ctx, q.GetTensorData<float>(), half_cache ? nullptr : pk.GetTensorData<float>(),
                     k.GetTensorData<float>(), half_cache ? nullptr : pv.GetTensorData<float>(), v.GetTensorData<float>(),
                     masked.GetTensorData<bool>(),
                     half_cache ? static_cast<const uint16_t*>(pk.GetTensorRawData()) : nullptr,
                     half_cache ? static_cast<const uint16_t*>(pv.GetTensorRawData()) : nullptr,
                     out.GetTensorMutableData<float>(), b, kv, rows, d, p, s, scale, in_place);
      return nullptr;
    } catch (const std::exception& e) {
      return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, (std::string("AttentionRows: ") + e.what()).c_str());
    }
  }
};

// RotaryAttentionRows: a decoder layer's attention from its fused query/key/value projection to the
// input of its output projection, in one node (int8-compute graphs whose KV cache is float16; the
// rewrite lade_export.export.attention_rows.fuse_rotary_attention swaps it in):
//   RotaryAttentionRows(QKV float[B, S, (H + 2·KV)·D], cos float[B, S, 1, D], sin float[B, S, 1, D],
//                       PK float16[B, P, KV, D], PV float16[B, P, KV, D], masked bool[B, 1, 1, S, P+S])
//     -> out float[B, S, H·D], present key float16[B, S, KV, D], present value float16[B, S, KV, D]
//   attributes scale, heads (H), kv_heads (KV).
// The same operations, in the same order, as the subgraph it replaces: the rotary embedding of the
// query and key heads (Su et al. 2021, arXiv 2104.09864, in the rotate-half form of LLaMA:
// y = x·cos + rotate_half(x)·sin, rotate_half(x) = (−x[D/2:], x[:D/2]); a product, a product, a sum,
// each rounded, no FMA), this step's keys and values rounded to float16 (the present outputs) and
// widened back, then AttentionRowsHalfCache's arithmetic on them with query head h in KV group
// h / (H/KV) — so its outputs are that subgraph's bits, and a row's bits still depend on its own
// row, its keys and its mask alone. It saves the ~30 small nodes per layer that ONNX Runtime would
// dispatch one by one (reshapes, transposes, casts, the rotary embedding's slices and products).
// One step row of RotaryAttentionRows before its attention: the rotary embedding of its query heads
// into Q [B, KV, G·S, D], of its key heads, rounded to float16, into the present key and (widened) into
// K [B, KV, D, S], its values rounded alike into the present value and V [B, KV, S, D].
struct RotaryJob {
  const float *x, *cos, *sin;
  uint16_t *hk, *hv;
  float *q, *k, *v;
  int64_t b, s, h, kv, d, width;
};

inline void rotate_scalar(const float* x, const float* c, const float* sn, int64_t d, float* y) {
  const int64_t half = d / 2;
  for (int64_t e = 0; e < d; ++e) {
    const float turned = e < half ? -x[e + half] : x[e - half];
    const float a = x[e] * c[e], b = turned * sn[e];
    y[e] = a + b;
  }
}

void rotary_row_scalar(const RotaryJob& j, int64_t at) {
  const int64_t bi = at / j.s, t = at % j.s, g = j.h / j.kv, rows = g * j.s, d = j.d;
  const float *row = j.x + at * j.width, *c = j.cos + at * d, *sn = j.sin + at * d;
  for (int64_t head = 0; head < j.h; ++head)
    rotate_scalar(row + head * d, c, sn, d, j.q + ((bi * j.kv + head / g) * rows + (head % g) * j.s + t) * d);
  float turned[512];
  for (int64_t i = 0; i < j.kv; ++i) {
    rotate_scalar(row + (j.h + i) * d, c, sn, d, turned);
    const float* value = row + (j.h + j.kv + i) * d;
    uint16_t *key16 = j.hk + (at * j.kv + i) * d, *value16 = j.hv + (at * j.kv + i) * d;
    for (int64_t e = 0; e < d; ++e) {
      key16[e] = float_to_half(turned[e]);
      value16[e] = float_to_half(value[e]);
      j.k[((bi * j.kv + i) * d + e) * j.s + t] = half_to_float(key16[e]);
      j.v[((bi * j.kv + i) * j.s + t) * d + e] = half_to_float(value16[e]);
    }
  }
}

#ifdef LADE_X86
// The same operations 16 lanes at a time (D a multiple of 32): the products and the sum each rounded,
// the negation exact, float16 conversions rounded to nearest even (F16C) as float_to_half does.
__attribute__((target("avx512f,avx512dq,f16c"))) inline void rotate512(const float* x, const float* c, const float* sn,
                                                               int64_t d, float* y) {
  const int64_t half = d / 2;
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0x80000000u)));
  for (int64_t e = 0; e < d; e += 16) {
    const __m512 turned = e < half ? _mm512_xor_ps(_mm512_loadu_ps(x + e + half), sign) : _mm512_loadu_ps(x + e - half);
    const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(x + e), _mm512_loadu_ps(c + e));
    const __m512 b = _mm512_mul_ps(turned, _mm512_loadu_ps(sn + e));
    _mm512_storeu_ps(y + e, _mm512_add_ps(a, b));
  }
}

__attribute__((target("avx512f,avx512dq,f16c"))) void rotary_row_avx512(const RotaryJob& j, int64_t at) {
  const int64_t bi = at / j.s, t = at % j.s, g = j.h / j.kv, rows = g * j.s, d = j.d;
  const float *row = j.x + at * j.width, *c = j.cos + at * d, *sn = j.sin + at * d;
  for (int64_t head = 0; head < j.h; ++head)
    rotate512(row + head * d, c, sn, d, j.q + ((bi * j.kv + head / g) * rows + (head % g) * j.s + t) * d);
  alignas(64) float turned[512];
  for (int64_t i = 0; i < j.kv; ++i) {
    rotate512(row + (j.h + i) * d, c, sn, d, turned);
    const float* value = row + (j.h + j.kv + i) * d;
    uint16_t *key16 = j.hk + (at * j.kv + i) * d, *value16 = j.hv + (at * j.kv + i) * d;
    float* vrow = j.v + ((bi * j.kv + i) * j.s + t) * d;
    alignas(64) float wide[512];
    for (int64_t e = 0; e < d; e += 16) {
      const __m256i kh = _mm512_cvtps_ph(_mm512_loadu_ps(turned + e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i vh = _mm512_cvtps_ph(_mm512_loadu_ps(value + e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(key16 + e), kh);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(value16 + e), vh);
      _mm512_storeu_ps(wide + e, _mm512_cvtph_ps(kh));
      _mm512_storeu_ps(vrow + e, _mm512_cvtph_ps(vh));
    }
    for (int64_t e = 0; e < d; ++e) j.k[((bi * j.kv + i) * d + e) * j.s + t] = wide[e];
  }
}
#endif

constexpr int64_t kRotaryRows = 4;  // step rows per parallel task (a prompt chunk)

void rotary_rows(const RotaryJob& j, int64_t r0, int64_t r1) {
  for (int64_t at = r0; at < r1; ++at) {
#ifdef LADE_X86
    if (dispatch().float_avx512 && j.d % 32 == 0 && j.d <= 512) {
      rotary_row_avx512(j, at);
      continue;
    }
#endif
    rotary_row_scalar(j, at);
  }
}

void run_rotary(void* data, size_t task) {
  const RotaryJob& j = *static_cast<const RotaryJob*>(data);
  const int64_t r0 = static_cast<int64_t>(task) * kRotaryRows;
  rotary_rows(j, r0, std::min(r0 + kRotaryRows, j.b * j.s));
}

struct RotaryAttentionKernel {
  float scale;
  int64_t heads, kv_heads;

  OrtStatusPtr ComputeV2(OrtKernelContext* raw) {
    try {
      Ort::KernelContext ctx(raw);
      auto qkv = ctx.GetInput(0), cos = ctx.GetInput(1), sin = ctx.GetInput(2), pk = ctx.GetInput(3),
           pv = ctx.GetInput(4), masked = ctx.GetInput(5);
      const auto xs = shape_of(qkv), cs = shape_of(cos), ss = shape_of(sin), pks = shape_of(pk), pvs = shape_of(pv),
                 ms = shape_of(masked);
      if (xs.size() != 3 || cs.size() != 4 || pks.size() != 4 || ms.size() != 5)
        throw Error("inputs are not QKV [B, S, (H+2·KV)·D], cos and sin [B, S, 1, D], PK and PV [B, P, KV, D], "
                    "masked [B, 1, 1, S, P+S]");
      const int64_t b = xs[0], s = xs[1], h = heads, kv = kv_heads, width = xs[2];
      const int64_t d = (h + 2 * kv) > 0 ? width / (h + 2 * kv) : 0, p = pks[1], g = kv ? h / kv : 0;
      if (d == 0 || d % 2 || d > 512 || d * (h + 2 * kv) != width || cs != std::vector<int64_t>{b, s, 1, d} ||
          ss != cs || pks != std::vector<int64_t>{b, p, kv, d} || pvs != pks ||
          ms != std::vector<int64_t>{b, 1, 1, s, p + s} || s == 0)
        throw Error("QKV " + dims(xs) + ", cos " + dims(cs) + ", sin " + dims(ss) + ", PK " + dims(pks) + ", PV " +
                    dims(pvs) + " and masked " + dims(ms) + " do not fit heads = " + std::to_string(h) +
                    ", kv_heads = " + std::to_string(kv));
      auto out = ctx.GetOutput(0, {b, s, h * d});
      auto present_k = ctx.GetOutput(1, {b, s, kv, d}), present_v = ctx.GetOutput(2, {b, s, kv, d});
      const int64_t rows = g * s;  // rows of a KV group: query head g' of step row t at g'·S + t
      thread_local std::vector<float> qb, kb, vb, ob;
      qb.resize(static_cast<size_t>(b * kv * rows * d));
      kb.resize(static_cast<size_t>(b * kv * d * s));
      vb.resize(static_cast<size_t>(b * kv * s * d));
      ob.resize(static_cast<size_t>(b * kv * rows * d));
      RotaryJob job{qkv.GetTensorData<float>(), cos.GetTensorData<float>(), sin.GetTensorData<float>(),
                    static_cast<uint16_t*>(present_k.GetTensorMutableRawData()),
                    static_cast<uint16_t*>(present_v.GetTensorMutableRawData()), qb.data(), kb.data(), vb.data(),
                    b, s, h, kv, d, width};
      if (b * s <= kRotaryRows) rotary_rows(job, 0, b * s);  // every row alone: any split, the same bits
      else ctx.ParallelFor(run_rotary, static_cast<size_t>((b * s + kRotaryRows - 1) / kRotaryRows), 0, &job);
      attention_rows(ctx, qb.data(), nullptr, kb.data(), nullptr, vb.data(), masked.GetTensorData<bool>(),
                     static_cast<const uint16_t*>(pk.GetTensorRawData()),
                     static_cast<const uint16_t*>(pv.GetTensorRawData()), ob.data(), b, kv, rows, d, p, s, scale, true);
      float* y = out.GetTensorMutableData<float>();
      for (int64_t bi = 0; bi < b; ++bi)  // out [B, S, H·D]
        for (int64_t t = 0; t < s; ++t)
          for (int64_t head = 0; head < h; ++head)
            std::memcpy(y + ((bi * s + t) * h + head) * d, ob.data() + ((bi * kv + head / g) * rows + (head % g) * s + t) * d,
                        static_cast<size_t>(d) * sizeof(float));
      return nullptr;
    } catch (const std::exception& e) {
      return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, (std::string("RotaryAttentionRows: ") + e.what()).c_str());
    }
  }
};

int64_t attribute_past_layout(const OrtKernelInfo* info) {  // absent (graphs before it): 0, transposed past
  int64_t value = 0;
  OrtStatus* status = Ort::GetApi().KernelInfoGetAttribute_int64(info, "past_layout", &value);
  if (status != nullptr) {
    Ort::GetApi().ReleaseStatus(status);
    return 0;
  }
  if (value != 0 && value != 1)
    throw Error("attribute past_layout = " + std::to_string(value) + " is not 0 (transposed) or 1 (sequence-major, in place)");
  return value;
}

// ArgMaxRows(X float[..., V]) -> int64[...]: for every row of X (its last axis) the index of its largest
// value, the first of several equal ones (ONNX ArgMax with axis = −1, keepdims = 0, select_last_index = 0;
// −0 and +0 are equal); a NaN counts as larger than every number, so a row holding one gives its first NaN
// (numpy.argmax). Comparisons only, no arithmetic: every path (AVX-512, AVX2, scalar) gives the same index,
// and a row's index depends on that row alone. The step graph's tokens (next_token_ids) from its logits:
// ONNX Runtime's ArgMax spent ~60-80 µs on each of SmolLM2's 49,152-wide rows, the AVX-512 code here ~15.
constexpr int64_t kArgMaxRows = 4;  // rows per parallel task

// From position `from` on, with `best` the first position of the largest value before it (the vector
// paths' tail; the whole row from 0).
int64_t argmax_row_scalar(const float* x, int64_t v, int64_t from = 0, int64_t best = 0) {
  for (int64_t i = from; i < v; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

#ifdef LADE_X86
// The same index in one sweep: each lane keeps its largest value and where it first saw it (a strict
// comparison keeps the earlier of equal ones), then the smallest position among the lanes holding the
// row's largest value; the tail past the last full vector is scalar (its positions are later). A NaN
// anywhere hands the row to the scalar code, which stops at the first one.
__attribute__((target("avx512f"))) int64_t argmax_row_avx512(const float* x, int64_t v) {
  if (v < 16) return argmax_row_scalar(x, v);
  __m512 best = _mm512_loadu_ps(x);
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), pos = at;
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
  int64_t i = 16;
  for (; i + 16 <= v; i += 16) {
    const __m512 a = _mm512_loadu_ps(x + i);
    pos = _mm512_add_epi32(pos, step);
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(a, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, a);
    at = _mm512_mask_mov_epi32(at, gt, pos);
  }
  if (nan) return argmax_row_scalar(x, v);
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 holds = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  return argmax_row_scalar(x, v, i, _mm512_mask_reduce_min_epi32(holds, at));
}

__attribute__((target("avx2"))) int64_t argmax_row_avx2(const float* x, int64_t v) {
  if (v < 8) return argmax_row_scalar(x, v);
  __m256 best = _mm256_loadu_ps(x);
  __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), pos = at;
  const __m256i step = _mm256_set1_epi32(8);
  __m256 nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
  int64_t i = 8;
  for (; i + 8 <= v; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i);
    pos = _mm256_add_epi32(pos, step);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    const __m256 gt = _mm256_cmp_ps(a, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, a, gt);
    at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(pos), gt));
  }
  if (_mm256_movemask_ps(nan)) return argmax_row_scalar(x, v);
  alignas(32) float value[8];
  alignas(32) int32_t where[8];
  _mm256_store_ps(value, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(where), at);
  float top = value[0];
  int64_t index = where[0];
  for (int k = 1; k < 8; ++k)
    if (value[k] > top || (value[k] == top && where[k] < index)) { top = value[k]; index = where[k]; }
  return argmax_row_scalar(x, v, i, index);
}
#endif

struct ArgMaxJob {
  const float* x;
  int64_t rows, v;
  int64_t* out;
};

void argmax_rows(const ArgMaxJob& job, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = job.x + r * job.v;
#ifdef LADE_X86
    if (dispatch().float_avx512) { job.out[r] = argmax_row_avx512(x, job.v); continue; }
    if (dispatch().float_avx2) { job.out[r] = argmax_row_avx2(x, job.v); continue; }
#endif
    job.out[r] = argmax_row_scalar(x, job.v);
  }
}

void run_argmax(void* data, size_t task) {
  const ArgMaxJob& job = *static_cast<const ArgMaxJob*>(data);
  const int64_t r0 = static_cast<int64_t>(task) * kArgMaxRows;
  argmax_rows(job, r0, std::min(job.rows, r0 + kArgMaxRows));
}

struct ArgMaxKernel {
  OrtStatusPtr ComputeV2(OrtKernelContext* raw) {
    try {
      Ort::KernelContext ctx(raw);
      auto x = ctx.GetInput(0);
      std::vector<int64_t> shape = shape_of(x);
      if (shape.empty() || shape.back() < 1) throw Error("input " + dims(shape) + " has no values to choose from");
      const int64_t v = shape.back();
      if (v > INT32_MAX) throw Error("rows of " + std::to_string(v) + " values are more than int32 positions");
      shape.pop_back();
      int64_t rows = 1;
      for (int64_t n : shape) rows *= n;
      auto out = ctx.GetOutput(0, shape);
      ArgMaxJob job{x.GetTensorData<float>(), rows, v, out.GetTensorMutableData<int64_t>()};
      if (rows <= kArgMaxRows) argmax_rows(job, 0, rows);
      else ctx.ParallelFor(run_argmax, static_cast<size_t>((rows + kArgMaxRows - 1) / kArgMaxRows), 0, &job);
      return nullptr;
    } catch (const std::exception& e) {
      return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, (std::string("ArgMaxRows: ") + e.what()).c_str());
    }
  }
};

template <typename TOp, typename TKernel>
struct Op : Ort::CustomOpBase<TOp, TKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    try {
      if (!dispatch().error.empty()) throw Error(dispatch().error);
      *kernel = TOp::make(info);
      return nullptr;
    } catch (const std::exception& e) {
      return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, (std::string(TOp::kName) + ": " + e.what()).c_str());
    }
  }
  const char* GetName() const { return TOp::kName; }
  size_t GetInputTypeCount() const { return TOp::kInputs; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

// MatMulBlockQ(X, Q, D, M[, R float, γ float]): inputs 4 (a residual added to Y) and 5 (the RMS norm's
// weight) are optional; attributes prologue (0 none, 1 RMS norm, 2 SwiGLU; absent: 0) and epsilon.
struct MatMulOp : Op<MatMulOp, MatMulKernel> {
  static constexpr const char* kName = "MatMulBlockQ";
  static constexpr size_t kInputs = 6;
  static MatMulKernel* make(const OrtKernelInfo* info) {
    int64_t prologue = kPrologueNone;
    float epsilon = 0.0f;
    if (OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_int64(info, "prologue", &prologue))
      Ort::GetApi().ReleaseStatus(st);
    if (OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_float(info, "epsilon", &epsilon))
      Ort::GetApi().ReleaseStatus(st);
    if (prologue != kPrologueNone && prologue != kPrologueRmsNorm && prologue != kPrologueSwiGlu)
      throw Error("attribute prologue = " + std::to_string(prologue) + " is not 0 (none), 1 (RMS norm) or 2 (SwiGLU)");
    return new MatMulKernel{attribute_n(info), attribute_compute(info), prologue, epsilon};
  }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8
           : (i == 2 || i == 3) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16
                                : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i < 4 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
};

struct GatherOp : Op<GatherOp, GatherKernel> {
  static constexpr const char* kName = "GatherBlockQ";
  static constexpr size_t kInputs = 4;
  static GatherKernel* make(const OrtKernelInfo* info) { return new GatherKernel{attribute_n(info)}; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8
           : i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64
                    : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
  }
};

struct AttentionOp : Op<AttentionOp, AttentionKernel> {
  static constexpr const char* kName = "AttentionRows";
  static constexpr size_t kInputs = 6;
  static AttentionKernel* make(const OrtKernelInfo* info) {
    return new AttentionKernel{Ort::ConstKernelInfo(info).GetAttribute<float>("scale"), attribute_past_layout(info)};
  }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 5 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};

// AttentionRows over a float16 cache (PK, PV float16 [B, P, KV, D], read in place; Q, K, V float32):
// every cached key and value is widened to float exactly, then the same operations as AttentionRows.
// The graph rounds this step's K and V to float16 and back before they reach it, so a token's key and
// value have the same bits in the cache and in a step.
struct AttentionHalfCacheOp : Op<AttentionHalfCacheOp, AttentionKernel> {
  static constexpr const char* kName = "AttentionRowsHalfCache";
  static constexpr size_t kInputs = 6;
  static AttentionKernel* make(const OrtKernelInfo* info) {
    return new AttentionKernel{Ort::ConstKernelInfo(info).GetAttribute<float>("scale"), attribute_past_layout(info),
                               true};
  }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 5 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL
           : (i == 1 || i == 3) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16
                                : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};

// RotaryAttentionRows (above): three outputs, the attention's float32 and the present key and value in float16.
struct RotaryAttentionOp : Op<RotaryAttentionOp, RotaryAttentionKernel> {
  static constexpr const char* kName = "RotaryAttentionRows";
  static constexpr size_t kInputs = 6;
  static RotaryAttentionKernel* make(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo k(info);
    const int64_t heads = k.GetAttribute<int64_t>("heads"), kv_heads = k.GetAttribute<int64_t>("kv_heads");
    if (heads < 1 || kv_heads < 1 || heads % kv_heads)
      throw Error("heads = " + std::to_string(heads) + " is not a positive multiple of kv_heads = " +
                  std::to_string(kv_heads));
    return new RotaryAttentionKernel{k.GetAttribute<float>("scale"), heads, kv_heads};
  }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 5 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL
           : (i == 3 || i == 4) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16
                                : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
  }
};

// ArgMaxRows (above): float32 in, int64 out.
struct ArgMaxOp : Op<ArgMaxOp, ArgMaxKernel> {
  static constexpr const char* kName = "ArgMaxRows";
  static constexpr size_t kInputs = 1;
  static ArgMaxKernel* make(const OrtKernelInfo*) { return new ArgMaxKernel{}; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64; }
};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  // Compiled against API version 29 (ONNX Runtime 1.29's headers); later runtimes serve it.
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) return nullptr;  // too old a runtime: ORT reports the unknown ops itself
  Ort::InitApi(api);
  static MatMulOp matmul;
  static GatherOp gather;
  static AttentionOp attention;
  static AttentionHalfCacheOp attention_half_cache;
  static RotaryAttentionOp rotary_attention;
  static ArgMaxOp argmax;
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* s = api->CreateCustomOpDomain("lade_export", &domain)) return s;
  for (OrtCustomOp* op : {static_cast<OrtCustomOp*>(&matmul), static_cast<OrtCustomOp*>(&gather),
                          static_cast<OrtCustomOp*>(&attention), static_cast<OrtCustomOp*>(&attention_half_cache),
                          static_cast<OrtCustomOp*>(&rotary_attention), static_cast<OrtCustomOp*>(&argmax)})
    if (OrtStatus* s = api->CustomOpDomain_Add(domain, op)) return s;
  return api->AddCustomOpDomain(options, domain);
}

// The kernels' paths, for the Python side (ctypes; no ONNX Runtime needed):
// lade_kernels_path(1) → the integer path this process takes ("amx", "avx512vnni", "avxvnni",
// "avx2", "portable"), lade_kernels_path(0) → the float32 path ("avx512", "portable"), or
// "error: …" when LADE_KERNELS_PATH cannot be honoured; lade_kernels_paths() → the paths this
// library holds and whether this CPU runs each, as "name:1,name:0,…".
extern "C" __attribute__((visibility("default"))) const char* lade_kernels_path(int compute) {
  static const std::string error = "error: " + dispatch().error;
  if (!dispatch().error.empty()) return error.c_str();
  return compute == 1 ? dispatch().int_name.c_str() : dispatch().float_name.c_str();
}

extern "C" __attribute__((visibility("default"))) const char* lade_kernels_paths() {
  static const std::string listing = [] {
    const Dispatch& d = dispatch();
    std::string out;
    for (int i = 4; i >= 0; --i) out += std::string(kIntNames[i]) + ":" + (d.supported[i] ? "1" : "0") + ",";
    return out + "avx512:" + (d.cpu_avx512 ? "1" : "0") + ",portable-float32:1";
  }();
  return listing.c_str();
}
