# Compiler flags for the targets kvattn builds itself (tests, header checks,
# benchmarks, examples). The library target kvattn::kvattn carries none of them:
# consumers choose their own warnings, architecture and sanitizers.
#
#   kvattn_warnings   -Wall -Wextra -Wpedantic -Werror (GCC/Clang), /W4 /WX (MSVC)
#   kvattn_options    -march=native (KVATTN_NATIVE), ASan + UBSan (KVATTN_SANITIZE),
#                     libFuzzer coverage + ASan + UBSan (KVATTN_FUZZ)
#   kvattn_avx512     -march=x86-64-v4, for the tests of the AVX-512 kernels (x86-64
#                     GCC/Clang that accept the flag; defined only then)
#   kvattn_avx2       -mavx2 -mfma, for the tests of the AVX2 kernels (likewise)
#   kvattn_avx512bf16 -march=x86-64-v4 -mavx512bf16, for the tests of the bf16 dot-product
#                     kernel (likewise)
#
# kvattn_project_target(<target>) links both into a target.
include_guard(GLOBAL)

add_library(kvattn_warnings INTERFACE)
add_library(kvattn_options INTERFACE)

if(MSVC)
  target_compile_options(kvattn_warnings INTERFACE /W4 /WX /permissive-)
else()
  target_compile_options(kvattn_warnings INTERFACE -Wall -Wextra -Wpedantic -Werror)
endif()

if(KVATTN_NATIVE)
  if(MSVC)
    message(WARNING "KVATTN_NATIVE has no effect with MSVC (use /arch:AVX2 in CMAKE_CXX_FLAGS)")
  else()
    target_compile_options(kvattn_options INTERFACE -march=native)
  endif()
endif()

if(KVATTN_SANITIZE)
  if(MSVC)
    message(FATAL_ERROR "KVATTN_SANITIZE needs GCC or Clang (AddressSanitizer + UBSan)")
  endif()
  # AddressSanitizer + UndefinedBehaviorSanitizer. -fno-sanitize-recover=all makes
  # every UBSan report abort the process, so a finding fails its test instead of
  # scrolling past in the log.
  set(_kvattn_sanitize_flags -fsanitize=address,undefined -fno-sanitize-recover=all
                             -fno-omit-frame-pointer)
  target_compile_options(kvattn_options INTERFACE ${_kvattn_sanitize_flags})
  target_link_options(kvattn_options INTERFACE ${_kvattn_sanitize_flags})
endif()

if(KVATTN_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "KVATTN_FUZZ needs Clang (libFuzzer), not ${CMAKE_CXX_COMPILER_ID}: "
                        "cmake --preset fuzz uses clang++-14 (Debian: clang-14 libclang-rt-14-dev)")
  endif()
  # Every kvattn target gets libFuzzer's coverage instrumentation and the sanitizers;
  # only the fuzz targets link libFuzzer's main (tests/fuzz/CMakeLists.txt).
  set(_kvattn_fuzz_flags -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all
                         -fno-omit-frame-pointer)
  target_compile_options(kvattn_options INTERFACE ${_kvattn_fuzz_flags})
  target_link_options(kvattn_options INTERFACE -fsanitize=address,undefined)
endif()

# GCC 12 reports false -Wmaybe-uninitialized positives from inside Eigen's and
# libstdc++'s headers when it inlines deeply: under -march=native or -march=x86-64-v4
# (Eigen's AVX-512 code paths, which an AVX2 machine never compiles) and under
# AddressSanitizer (GCC bug 105593, fixed in GCC 13). The warning points into system
# headers we cannot change, and a build that prints pages of them hides real ones, so
# on GCC < 13 it is off for kvattn's own targets, whatever the flags; GCC 13+ and Clang
# keep it (as an error).
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
  target_compile_options(kvattn_warnings INTERFACE -Wno-maybe-uninitialized)
endif()

# kvattn's own targets run its threads (kvattn::openmp when OpenMP is found), and
# Eigen's products inside them stay serial: EIGEN_DONT_PARALLELIZE, for these
# targets only (every translation unit of them has it, so Eigen's code is one copy).
target_compile_definitions(kvattn_options INTERFACE EIGEN_DONT_PARALLELIZE)

# AVX-512 code on GCC < 13 (bug 105593): GCC's own AVX-512 intrinsics pass an undefined
# vector through (_mm512_undefined_*), and every function that inlines one of them from
# Eigen's AVX-512 packet code (pexp, pmax, ptranspose, predux) gets -Wuninitialized /
# -Wmaybe-uninitialized warnings pointing into avx512fintrin.h. Nothing in them is
# ours to fix (kvattn's own bf16 widening uses the zero-masking intrinsics that do not
# warn), so kvattn's own targets compiled for AVX-512 turn those two warnings off; all
# other warnings stay errors. Consumers are unaffected: kvattn::kvattn carries no flags.
#
# "Compiled for AVX-512" is what the compiler sees, not which option asked for it:
#   kvattn_avx512 (-march=x86-64-v4) carries the two flags itself;
#   every other kvattn target gets them (through kvattn_warnings) when the flags it is
#   built with define __AVX512F__: CMAKE_CXX_FLAGS, the build type's flags and
#   -march=native under KVATTN_NATIVE (so CMAKE_CXX_FLAGS=-march=x86-64-v4 or -mavx512f,
#   or -march=native on an AVX-512 machine, builds under -Werror).
set(_kvattn_avx512_quiet "")
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
  set(_kvattn_avx512_quiet -Wno-uninitialized -Wno-maybe-uninitialized)
endif()

if(NOT MSVC AND CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  include(CheckCXXCompilerFlag)
  check_cxx_compiler_flag(-march=x86-64-v4 KVATTN_HAVE_MARCH_X86_64_V4)
  if(KVATTN_HAVE_MARCH_X86_64_V4)
    add_library(kvattn_avx512 INTERFACE)
    target_compile_options(kvattn_avx512 INTERFACE -march=x86-64-v4 ${_kvattn_avx512_quiet})
  endif()
  check_cxx_compiler_flag(-mavx512bf16 KVATTN_HAVE_MAVX512BF16)
  if(KVATTN_HAVE_MARCH_X86_64_V4 AND KVATTN_HAVE_MAVX512BF16)
    add_library(kvattn_avx512bf16 INTERFACE)
    target_compile_options(kvattn_avx512bf16 INTERFACE -march=x86-64-v4 -mavx512bf16
                                                       ${_kvattn_avx512_quiet})
  endif()
  check_cxx_compiler_flag(-mavx2 KVATTN_HAVE_MAVX2)
  check_cxx_compiler_flag(-mfma KVATTN_HAVE_MFMA)
  if(KVATTN_HAVE_MAVX2 AND KVATTN_HAVE_MFMA)
    add_library(kvattn_avx2 INTERFACE)
    target_compile_options(kvattn_avx2 INTERFACE -mavx2 -mfma)
  endif()
  if(_kvattn_avx512_quiet)
    # try_compile adds CMAKE_CXX_FLAGS itself; the build type's flags and -march=native
    # go in through CMAKE_REQUIRED_FLAGS.
    set(_kvattn_probe_flags "")
    if(CMAKE_BUILD_TYPE)
      string(TOUPPER "${CMAKE_BUILD_TYPE}" _kvattn_config)
      set(_kvattn_probe_flags "${CMAKE_CXX_FLAGS_${_kvattn_config}}")
    endif()
    if(KVATTN_NATIVE)
      string(APPEND _kvattn_probe_flags " -march=native")
    endif()
    # The result is cached: probe again whenever the flags it was probed with change.
    set(_kvattn_probe_key "${CMAKE_CXX_FLAGS} | ${_kvattn_probe_flags}")
    if(NOT _kvattn_probe_key STREQUAL "${KVATTN_AVX512_PROBED_WITH}")
      unset(KVATTN_FLAGS_ENABLE_AVX512 CACHE)
      set(KVATTN_AVX512_PROBED_WITH "${_kvattn_probe_key}" CACHE INTERNAL
          "the flags KVATTN_FLAGS_ENABLE_AVX512 was probed with")
    endif()
    include(CheckCXXSourceCompiles)
    set(CMAKE_REQUIRED_FLAGS "${_kvattn_probe_flags}")
    check_cxx_source_compiles("#ifndef __AVX512F__
#error no AVX-512
#endif
int main() { return 0; }" KVATTN_FLAGS_ENABLE_AVX512)
    unset(CMAKE_REQUIRED_FLAGS)
    if(KVATTN_FLAGS_ENABLE_AVX512)
      target_compile_options(kvattn_warnings INTERFACE ${_kvattn_avx512_quiet})
    endif()
    if(KVATTN_FLAGS_ENABLE_AVX512)
      message(STATUS "kvattn: the flags enable AVX-512 (GCC < 13: -Wno-uninitialized "
                     "-Wno-maybe-uninitialized on kvattn's own targets)")
    endif()
  endif()
endif()

function(kvattn_project_target target)
  if(TARGET kvattn::openmp)
    target_link_libraries(${target} PRIVATE kvattn::openmp)
  else()
    target_link_libraries(${target} PRIVATE kvattn::kvattn)
  endif()
  target_link_libraries(${target} PRIVATE kvattn_warnings kvattn_options)
endfunction()
