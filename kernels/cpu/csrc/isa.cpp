// Which instruction set this CPU offers tokenmill's kernels, read once from cpuid.
#include "ops.h"

namespace tokenmill {

int64_t cpu_isa() {
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

}  // namespace tokenmill
