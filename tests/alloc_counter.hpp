// Counts heap allocations in a test binary. Include it FIRST, in exactly one
// translation unit per test executable (it replaces global operator new/delete).
//
// Two counters: a replaced global operator new (std containers, Catch2), and Eigen's
// own run-time malloc guard (EIGEN_RUNTIME_NO_MALLOC; Eigen allocates with
// std::malloc, not new), whose eigen_assert is made to throw here, in every build type.
#pragma once

#define EIGEN_RUNTIME_NO_MALLOC
#include <stdexcept>
#define eigen_assert(x)                                           \
  do {                                                            \
    if (!(x)) throw std::logic_error("eigen_assert failed: " #x); \
  } while (false)

#include <Eigen/Core>
#include <atomic>
#include <cstdlib>
#include <new>

namespace kvattn::test {

inline std::atomic<long> operator_new_calls{0};

struct AllocationCount {
  long operator_new = 0;      // calls of the global operator new
  bool eigen_malloc = false;  // Eigen tried to allocate on the heap
};

/// Runs `body` and reports the heap allocations it made.
template <class Body>
AllocationCount count_allocations(Body&& body) {
  AllocationCount count;
  const long before = operator_new_calls.load();
  Eigen::internal::set_is_malloc_allowed(false);
  try {
    body();
  } catch (const std::logic_error&) {
    count.eigen_malloc = true;
  }
  Eigen::internal::set_is_malloc_allowed(true);
  count.operator_new = operator_new_calls.load() - before;
  return count;
}

}  // namespace kvattn::test

void* operator new(std::size_t size) {
  ++kvattn::test::operator_new_calls;
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
// Catch2 allocates with new (std::nothrow): replace it too, so that every pointer
// reaching the replaced delete came from malloc (AddressSanitizer checks the pairing).
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  ++kvattn::test::operator_new_calls;
  return std::malloc(size == 0 ? 1 : size);
}
// GCC 12 inlines these into a caller that allocated with operator new (a std::vector's
// destructor, say) and then takes the free() for a mismatched deallocation (as in
// fault_injection.hpp); every operator new above allocates with malloc.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
