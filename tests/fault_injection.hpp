// Fault injection: makes the N-th heap allocation from now fail, to test that every
// mutating call keeps the strong guarantee when memory runs out. Include it FIRST, in
// exactly one translation unit per test executable (it replaces the global operator
// new/delete and Eigen's assertion macro). Not for the sanitizer build, where
// AddressSanitizer owns the allocator (tests/CMakeLists.txt leaves these tests out).
//
// What counts as an allocation: every replaceable operator new (plain, nothrow, array,
// and the std::align_val_t forms that cache buffers use), and every heap allocation
// of Eigen (its run-time malloc check, EIGEN_RUNTIME_NO_MALLOC, is kept failing while
// armed, and the eigen_assert below turns that one assertion into a counted
// allocation). C allocations by the OpenMP runtime are not counted: libgomp ends the
// process when its own allocations fail, so tests start the thread team before arming.
// Nor is Eigen's realloc (conservativeResize), which kvattn does not use.
//
// Counting: while armed, every allocation above takes one from the countdown, and the
// one that takes it from 1 to 0 fails; it sets `injected` and records its form in
// `injected_form`. So after a call, !injected means the call made fewer allocations
// than the countdown (a run of the sweep that ends it), and injected with no exception
// out of the call means the failure was swallowed inside it. tests/test_fault_injection.cpp
// checks every form.
#pragma once

#define EIGEN_RUNTIME_NO_MALLOC
#include <cstring>
#include <stdexcept>

namespace kvattn::test::fault {
void eigen_assertion(const char* expression);
}  // namespace kvattn::test::fault

#define eigen_assert(x)                                   \
  do {                                                    \
    if (!(x)) ::kvattn::test::fault::eigen_assertion(#x); \
  } while (false)

#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace kvattn::test::fault {

inline std::atomic<bool> armed{false};
inline std::atomic<long> countdown{0};     // the allocation that takes it to 0 fails
inline std::atomic<long> allocations{0};   // allocations seen while armed
inline std::atomic<bool> injected{false};  // the armed allocation has failed since arm()
/// The form of the allocation that failed ("operator new(size_t, nothrow_t)", "Eigen",
/// ...); nullptr before it fails.
inline std::atomic<const char*> injected_form{nullptr};

/// Called for every allocation, with its form: true for the one that must fail.
inline bool next_allocation_fails(const char* form) {
  if (!armed.load(std::memory_order_relaxed)) return false;
  ++allocations;
  if (countdown.fetch_sub(1) != 1) return false;
  injected_form = form;
  injected = true;
  return true;
}

/// From now on the n-th allocation (n >= 1) fails with std::bad_alloc (the nothrow
/// forms return nullptr).
inline void arm(long n) {
  allocations = 0;
  countdown = n;
  injected = false;
  injected_form = nullptr;
  Eigen::internal::set_is_malloc_allowed(false);  // every Eigen allocation asks us
  armed = true;
}

inline void disarm() {
  armed = false;
  Eigen::internal::set_is_malloc_allowed(true);
}

/// eigen_assert's failure: Eigen's "heap allocation is forbidden" check is an
/// allocation (it fails when its turn comes, else proceeds); anything else is a real
/// assertion and throws std::logic_error.
inline void eigen_assertion(const char* expression) {
  if (std::strstr(expression, "heap allocation is forbidden") != nullptr) {
    if (next_allocation_fails("Eigen aligned_malloc")) throw std::bad_alloc();
    return;
  }
  throw std::logic_error(std::string("eigen_assert failed: ") + expression);
}

/// Runs body(); returns true if it threw std::bad_alloc (injected or not).
template <class Body>
bool throws_bad_alloc(Body&& body) {
  try {
    body();
  } catch (const std::bad_alloc&) {
    return true;
  }
  return false;
}

inline void* allocate(std::size_t size, const char* form) {
  if (next_allocation_fails(form)) return nullptr;
  return std::malloc(std::max<std::size_t>(size, 1));
}

inline void* allocate_aligned(std::size_t size, std::align_val_t alignment, const char* form) {
  if (next_allocation_fails(form)) return nullptr;
  const auto align = static_cast<std::size_t>(alignment);
  // aligned_alloc wants a multiple of the alignment; a size of 0 still gets a unique
  // block (max(size, 1)), and a size too large to round up is an allocation failure.
  const std::size_t bytes = std::max<std::size_t>(size, 1);
  if (bytes > SIZE_MAX - (align - 1)) return nullptr;
  return std::aligned_alloc(align, (bytes + align - 1) / align * align);
}

}  // namespace kvattn::test::fault

void* operator new(std::size_t size) {
  if (void* p = kvattn::test::fault::allocate(size, "operator new(size_t)")) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) {
  if (void* p = kvattn::test::fault::allocate(size, "operator new[](size_t)")) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  return kvattn::test::fault::allocate(size, "operator new(size_t, nothrow_t)");
}
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept {
  return kvattn::test::fault::allocate(size, "operator new[](size_t, nothrow_t)");
}
void* operator new(std::size_t size, std::align_val_t alignment) {
  if (void* p = kvattn::test::fault::allocate_aligned(size, alignment,
                                                      "operator new(size_t, align_val_t)"))
    return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size, std::align_val_t alignment) {
  if (void* p = kvattn::test::fault::allocate_aligned(size, alignment,
                                                      "operator new[](size_t, align_val_t)"))
    return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t size, std::align_val_t alignment, const std::nothrow_t&) noexcept {
  return kvattn::test::fault::allocate_aligned(size, alignment,
                                               "operator new(size_t, align_val_t, nothrow_t)");
}
void* operator new[](std::size_t size, std::align_val_t alignment, const std::nothrow_t&) noexcept {
  return kvattn::test::fault::allocate_aligned(size, alignment,
                                               "operator new[](size_t, align_val_t, nothrow_t)");
}
// GCC 12 inlines these into a caller that allocated with operator new (std::make_shared of
// a PagePool, say) and then takes the free() for a mismatched deallocation; every
// operator new above allocates with malloc / aligned_alloc, which free() releases.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
