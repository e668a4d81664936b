// Which instruction set this CPU offers tokenmill's kernels, read once from cpuid, and a cap
// on it (limit_cpu_isa: tests run the AVX2 and portable builds on any machine; the
// TOKENMILL_CPU_ISA setting).
#include <algorithm>
#include <atomic>

#include "ops.h"

namespace tokenmill {
namespace {

std::atomic<int64_t> isa_limit{3};

int64_t detected_isa() {
  static const int64_t isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("avx512bf16")) return 3;
    if (__builtin_cpu_supports("avx512bf16")) return 2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return 1;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 0;
    return -1;
  }();
  return isa;
}

}  // namespace

int64_t cpu_isa() { return std::min(detected_isa(), isa_limit.load(std::memory_order_relaxed)); }

int64_t limit_cpu_isa(int64_t limit) {
  isa_limit.store(limit, std::memory_order_relaxed);
  return cpu_isa();
}

}  // namespace tokenmill
