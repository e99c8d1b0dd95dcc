// Linked into an instruction-set build of a test (kvattn_add_isa_test in
// tests/CMakeLists.txt): when the CPU lacks the instructions that binary was compiled
// for (KVATTN_GUARD_AVX512: -march=x86-64-v4, AVX-512 F, BW, DQ, VL;
// KVATTN_GUARD_AVX512BF16: the same and AVX512-BF16; KVATTN_GUARD_AVX2: -mavx2 -mfma), it says so
// and exits with 77, which CTest reports as "skipped" (SKIP_RETURN_CODE), before any of its own
// code runs. This file is compiled without those flags, and the check is a constructor of priority
// 101: it runs before every ordinary static initializer (Catch's test registrations included),
// which the compiler is free to vectorize with the wider instructions.
#include <cstdio>

#include <unistd.h>

namespace {

#if defined(KVATTN_GUARD_AVX512) || defined(KVATTN_GUARD_AVX512BF16)
bool cpu_has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
#endif

#if defined(KVATTN_GUARD_AVX512BF16)
constexpr const char* kLevel =
    "AVX-512 (F, BW, DQ, VL) with AVX512-BF16 (-march=x86-64-v4 -mavx512bf16)";
bool cpu_has_level() { return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16"); }
#elif defined(KVATTN_GUARD_AVX512)
constexpr const char* kLevel = "AVX-512 (F, BW, DQ, VL; -march=x86-64-v4)";
bool cpu_has_level() { return cpu_has_avx512(); }
#elif defined(KVATTN_GUARD_AVX2)
constexpr const char* kLevel = "AVX2 and FMA (-mavx2 -mfma)";
bool cpu_has_level() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
#else
#error "define KVATTN_GUARD_AVX512, KVATTN_GUARD_AVX512BF16 or KVATTN_GUARD_AVX2"
#endif

__attribute__((constructor(101))) void require_level() {
  __builtin_cpu_init();
  if (cpu_has_level()) return;
  std::fprintf(stderr,
               "skipped: this CPU lacks %s, which this test binary was compiled for; the same "
               "tests run in the test built without it\n",
               kLevel);
  _exit(77);
}

}  // namespace
