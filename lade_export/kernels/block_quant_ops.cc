// Block-quantized weight kernels for ONNX Runtime's CPU provider, as a custom-op library
// (ONNX Runtime "Custom operators": a library exporting RegisterCustomOps). Domain
// "lade_export", version 1; the Python side (layout, packing) is lade_export/quantize.py's
// pack_block_lanes, the build side lade_export/kernels/__init__.py.
//
//   MatMulBlockQ(X float[..., K], Q uint8[N/16, K/32, 64·bits], D float16[N/16, K/32, 16],
//                M float16[N/16, K/32, 16]) -> Y float[..., N]            attribute N
//   GatherBlockQ(Q, D, M, ids int64[...]) -> float[..., K]                attribute N
//       rows of the same table: a tied token embedding read from the LM head's tensors.
//
// Weights come in blocks of 32 along K with bits ∈ {4, 8} per weight: w = D·code + M (GGML's
// Q4_1; Q8_0 as code = q + 128, M = −128·D).
//
// Arithmetic: float32. The sequence of operations that makes Y[r, n] depends only on X[r, :]
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
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
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

bool portable_forced() {  // LADE_KERNELS_PORTABLE=1 forces the portable path (tests of it on AVX-512 machines)
  const char* value = std::getenv("LADE_KERNELS_PORTABLE");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

bool has_avx512() {
  static const bool yes = !portable_forced() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return yes;
}
#endif

void run_task(void* data, size_t task) {
  const Job& job = *static_cast<const Job*>(data);
  const int64_t t0 = static_cast<int64_t>(task) * job.chunk;
  const int64_t t1 = std::min(job.tiles, t0 + job.chunk);
#ifdef LADE_X86
  if (has_avx512()) return job.bits == 4 ? tiles_avx512<4>(job, t0, t1) : tiles_avx512<8>(job, t0, t1);
#endif
  tiles_portable(job, t0, t1);
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

struct MatMulKernel {
  int64_t n;
  OrtStatusPtr ComputeV2(OrtKernelContext* raw) {
    try {
      Ort::KernelContext ctx(raw);
      auto x = ctx.GetInput(0);
      const auto xs = shape_of(x);
      const Packed p = read_packed(ctx, 1, n);
      if (xs.empty() || xs.back() != p.blocks * kBlock)
        throw Error("X " + dims(xs) + " does not end in K = " + std::to_string(p.blocks * kBlock));
      Job job{};
      static_cast<Packed&>(job) = p;
      job.k = xs.back();
      job.rows = 1;
      for (size_t i = 0; i + 1 < xs.size(); ++i) job.rows *= xs[i];
      std::vector<int64_t> ys(xs.begin(), xs.end() - 1);
      ys.push_back(job.n);
      auto y = ctx.GetOutput(0, ys);
      job.y = y.GetTensorMutableData<float>();
      if (job.rows == 0) return nullptr;
      // Each row's inputs, scaled per element (exact: powers of two) and summed per block, in
      // the same order for every row count.
      const float* xd = x.GetTensorData<float>();
      const int per = 32 / job.bits;
      std::vector<float> scaled(static_cast<size_t>(job.rows * job.k)), sums(static_cast<size_t>(job.rows * p.blocks));
      for (int64_t r = 0; r < job.rows; ++r)
        for (int64_t b = 0; b < p.blocks; ++b) {
          float s = 0.0f;
          for (int j = 0; j < kBlock; ++j) {
            const float v = xd[r * job.k + b * kBlock + j];
            s += v;
            scaled[r * job.k + b * kBlock + j] = std::ldexp(v, -job.bits * (j % per));
          }
          sums[r * p.blocks + b] = s;
        }
      job.xs = scaled.data();
      job.sums = sums.data();
      job.chunk = 4;  // tiles (64 columns) per parallel task
      const size_t tasks = static_cast<size_t>((job.tiles + job.chunk - 1) / job.chunk);
      ctx.ParallelFor(run_task, tasks, 0, &job);
      return nullptr;
    } catch (const std::exception& e) {
      return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, (std::string("MatMulBlockQ: ") + e.what()).c_str());
    }
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

template <typename TOp, typename TKernel>
struct Op : Ort::CustomOpBase<TOp, TKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    try {
      *kernel = new TKernel{attribute_n(info)};
      return nullptr;
    } catch (const std::exception& e) {
      return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, (std::string(TOp::kName) + ": " + e.what()).c_str());
    }
  }
  const char* GetName() const { return TOp::kName; }
  size_t GetInputTypeCount() const { return 4; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

struct MatMulOp : Op<MatMulOp, MatMulKernel> {
  static constexpr const char* kName = "MatMulBlockQ";
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
           : i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8
                    : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
  }
};

struct GatherOp : Op<GatherOp, GatherKernel> {
  static constexpr const char* kName = "GatherBlockQ";
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8
           : i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64
                    : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
  }
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
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* s = api->CreateCustomOpDomain("lade_export", &domain)) return s;
  for (OrtCustomOp* op : {static_cast<OrtCustomOp*>(&matmul), static_cast<OrtCustomOp*>(&gather)})
    if (OrtStatus* s = api->CustomOpDomain_Add(domain, op)) return s;
  return api->AddCustomOpDomain(options, domain);
}
