// Linked into the AVX-512 build of a test (tests/CMakeLists.txt): when the CPU lacks the
// instructions that binary was compiled for (-march=x86-64-v4: AVX-512 F, BW, DQ, VL),
// it says so and exits with 77, which CTest reports as "skipped" (SKIP_RETURN_CODE),
// before any of its own code runs. This file is compiled without AVX-512 flags, and
// the check is a constructor of priority 101: it runs before every ordinary static
// initializer (Catch's test registrations included), which the compiler is free to
// vectorize with AVX-512 instructions.
#include <cstdio>

#include <unistd.h>

namespace {

__attribute__((constructor(101))) void require_avx512() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
    return;
  }
  std::fputs(
      "skipped: this CPU lacks AVX-512 (F, BW, DQ, VL), which this test binary was compiled "
      "for (-march=x86-64-v4); the same tests run in the test built without it\n",
      stderr);
  _exit(77);
}

}  // namespace
