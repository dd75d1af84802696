// Cycles per (16-row group × 16 columns × block of 32) of MatMulBlockQ's integer kernels, called
// directly (no ONNX Runtime session): a finer clock than bench/matmul_rows.py for comparing the AMX
// and AVX512-VNNI kernels on one layer, 4-bit weights, warm caches, one thread. Time stamp counter
// ticks (this machine: ~2.1 GHz, the nominal frequency), the third of five repeats sorted, and the
// smallest; a shared machine inflates both, so compare runs taken back to back.
//
// It includes the kernel source itself (the kernels live in an anonymous namespace):
//   g++ -O3 -std=c++17 -ffp-contract=off -I ~/.cache/lade-export/ort-include bench/matmul_cycles.cc -o CYCLES
//   CYCLES K N ROWS PATH ITERS        PATH: avx512vnni or amx; e.g. CYCLES 576 1536 16 amx 200
#include "../lade_export/kernels/block_quant_ops.cc"

#include <x86intrin.h>

#include <cstdio>
#include <random>

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s K N ROWS avx512vnni|amx ITERS\n", argv[0]);
    return 2;
  }
  const int64_t k = std::atoll(argv[1]), n = std::atoll(argv[2]), rows = std::atoll(argv[3]);
  const bool amx = std::strcmp(argv[4], "amx") == 0;
  const int iters = std::atoi(argv[5]);
  if (k % 32 || n % 16 || rows < 1 || iters < 1 || (!amx && std::strcmp(argv[4], "avx512vnni") != 0)) {
    std::fprintf(stderr, "K must be a multiple of 32, N of 16, ROWS and ITERS positive, PATH avx512vnni or amx\n");
    return 2;
  }
  if (amx && !amx_permitted()) {
    std::fprintf(stderr, "the OS does not grant the AMX tile state\n");
    return 1;
  }
  std::mt19937 rng(1);
  const int64_t tiles = n / 16, blocks = k / 32;
  std::vector<uint8_t> q(tiles * blocks * 256);
  for (auto& v : q) v = static_cast<uint8_t>(rng());
  std::vector<uint16_t> d(tiles * blocks * 16, 0x2000), m(tiles * blocks * 16, 0xa000);  // float16 2^-7, -2^-7
  std::vector<int8_t> qa(rows * k);
  for (auto& v : qa) v = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
  std::vector<float> dx(rows * blocks, 0.01f), sx(rows * blocks, 0.3f), y(rows * n);
  std::vector<int32_t> qsum(rows * blocks, 5);
  IJob job{};
  job.bits = 4, job.tiles = tiles, job.blocks = blocks, job.n = n;
  job.q = q.data(), job.d = d.data(), job.m = m.data();
  job.qa = qa.data(), job.dx = dx.data(), job.sx = sx.data(), job.qsum = qsum.data();
  job.rows = rows, job.k = k, job.y = y.data(), job.chunk = 4, job.path = amx ? kAmx : kAvx512Vnni;
  std::vector<double> ticks;
  for (int repeat = 0; repeat < 5; ++repeat) {
    const uint64_t start = __rdtsc();
    for (int i = 0; i < iters; ++i)
      for (int64_t t = 0; t < tiles; t += job.chunk) run_itask(&job, static_cast<size_t>(t / job.chunk));
    ticks.push_back(static_cast<double>(__rdtsc() - start) / iters / (tiles * blocks * ((rows + 15) / 16)));
  }
  std::sort(ticks.begin(), ticks.end());
  std::printf("K=%lld N=%lld rows=%lld %s: %.1f ticks per 16-row group x 16 columns x block (smallest %.1f)\n",
              static_cast<long long>(k), static_cast<long long>(n), static_cast<long long>(rows), argv[4], ticks[2],
              ticks[0]);
  return 0;
}
