// [alloc]: tests/fault_injection.hpp checked on its own, since every strong-guarantee
// test trusts it. Armed to fail the next allocation, each replaceable operator new form
// fails (the throwing forms with std::bad_alloc, the nothrow forms with nullptr) and so
// does an Eigen allocation; the countdown fails exactly the n-th allocation and says so
// (injected, injected_form, allocations); sizes of 0 and sizes too large to round up
// are handled; and strong_guarantee.hpp's sweep ends when a run no longer reaches the
// failing allocation, but reports a run that swallowed it.
#include "fault_injection.hpp"  // first: replaces operator new and eigen_assert

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <string>

#include "strong_guarantee.hpp"

using namespace kvattn;
namespace fault = kvattn::test::fault;

namespace {

// What one armed call did. Read after disarming: Catch's macros allocate.
struct Outcome {
  bool threw = false;       // std::bad_alloc
  void* pointer = nullptr;  // what the call returned
  long allocations = 0;     // counted while armed
  bool injected = false;
  std::string form;  // of the failed allocation
};

template <class Allocate>
Outcome armed_once(long n, Allocate allocate) {
  Outcome o;
  fault::arm(n);
  try {
    o.pointer = allocate();
  } catch (const std::bad_alloc&) {
    o.threw = true;
  }
  fault::disarm();
  o.allocations = fault::allocations;
  o.injected = fault::injected;
  if (const char* form = fault::injected_form) o.form = form;
  return o;
}

constexpr std::size_t kAlign = 64;
constexpr auto kAlignment = std::align_val_t{kAlign};

bool aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % kAlign == 0; }

struct alignas(kAlign) Line {  // over-aligned: new Line takes the align_val_t form
  unsigned char bytes[kAlign];
};

// Keeps an allocation observable, so the compiler cannot drop a new/delete pair.
void* volatile sink = nullptr;

}  // namespace

TEST_CASE("fault injection fails the next allocation in every operator new form",
          "[alloc][fault_injection]") {
  // The throwing forms: std::bad_alloc, nothing returned.
  struct Form {
    const char* name;
    void* (*allocate)();
    void (*release)(void*);
    bool nothrow;
    bool over_aligned;
  };
  const Form forms[] = {
      {"operator new(size_t)", [] { return ::operator new(24); },
       [](void* p) { ::operator delete(p); }, false, false},
      {"operator new[](size_t)", [] { return ::operator new[](24); },
       [](void* p) { ::operator delete[](p); }, false, false},
      {"operator new(size_t, nothrow_t)", [] { return ::operator new(24, std::nothrow); },
       [](void* p) { ::operator delete(p, std::nothrow); }, true, false},
      {"operator new[](size_t, nothrow_t)", [] { return ::operator new[](24, std::nothrow); },
       [](void* p) { ::operator delete[](p, std::nothrow); }, true, false},
      {"operator new(size_t, align_val_t)", [] { return ::operator new(24, kAlignment); },
       [](void* p) { ::operator delete(p, kAlignment); }, false, true},
      {"operator new[](size_t, align_val_t)", [] { return ::operator new[](24, kAlignment); },
       [](void* p) { ::operator delete[](p, kAlignment); }, false, true},
      {"operator new(size_t, align_val_t, nothrow_t)",
       [] { return ::operator new(24, kAlignment, std::nothrow); },
       [](void* p) { ::operator delete(p, kAlignment, std::nothrow); }, true, true},
      {"operator new[](size_t, align_val_t, nothrow_t)",
       [] { return ::operator new[](24, kAlignment, std::nothrow); },
       [](void* p) { ::operator delete[](p, kAlignment, std::nothrow); }, true, true},
  };
  for (const Form& form : forms) {
    INFO(form.name);
    const Outcome failed = armed_once(1, form.allocate);
    CHECK(failed.threw == !form.nothrow);
    CHECK(failed.pointer == nullptr);
    CHECK(failed.allocations == 1);
    CHECK(failed.injected);
    CHECK(failed.form == form.name);
    // Armed for a later allocation, the same call succeeds and is counted.
    const Outcome passed = armed_once(2, form.allocate);
    CHECK_FALSE(passed.threw);
    REQUIRE(passed.pointer != nullptr);
    CHECK(passed.allocations == 1);
    CHECK_FALSE(passed.injected);
    if (form.over_aligned) CHECK(aligned(passed.pointer));
    std::memset(passed.pointer, 0xab, 24);  // usable
    form.release(passed.pointer);
  }
  // New-expressions of an over-aligned type reach the align_val_t forms.
  const Outcome object = armed_once(1, [] {
    sink = new Line;
    return sink;
  });
  CHECK(object.threw);
  CHECK(object.form == "operator new(size_t, align_val_t)");
  const Outcome array = armed_once(1, [] {
    sink = new (std::nothrow) Line[3];
    return sink;
  });
  CHECK_FALSE(array.threw);
  CHECK(array.pointer == nullptr);
  CHECK(array.form == "operator new[](size_t, align_val_t, nothrow_t)");
}

TEST_CASE("fault injection fails an Eigen allocation", "[alloc][fault_injection]") {
  const Outcome failed = armed_once(1, [] {
    RowMatrix<float> m(64, 64);
    sink = m.data();
    return static_cast<void*>(nullptr);
  });
  CHECK(failed.threw);
  CHECK(failed.allocations == 1);
  CHECK(failed.injected);
  CHECK(failed.form == "Eigen aligned_malloc");
  // The second of two matrices, not the first.
  const Outcome second = armed_once(2, [] {
    RowMatrix<float> a(8, 8);
    sink = a.data();
    RowMatrix<double> b(8, 8);
    sink = b.data();
    return static_cast<void*>(nullptr);
  });
  CHECK(second.threw);
  CHECK(second.allocations == 2);
  // Without its turn, an Eigen allocation goes through (and an empty matrix allocates
  // nothing, so it takes no turn).
  const Outcome passed = armed_once(3, [] {
    RowMatrix<float> m(64, 64);
    m.setOnes();
    sink = m.data();
    RowMatrix<float> empty(0, 64);
    sink = empty.data();
    return static_cast<void*>(nullptr);
  });
  CHECK_FALSE(passed.threw);
  CHECK(passed.allocations == 1);
  CHECK_FALSE(passed.injected);
  // A failing Eigen assertion that is not the allocation check stays an error.
  CHECK_THROWS_AS(fault::eigen_assertion("rows >= 0"), std::logic_error);
}

TEST_CASE("fault injection fails exactly the n-th allocation", "[alloc][fault_injection]") {
  void* p[3] = {};
  fault::arm(2);
  p[0] = ::operator new(8, std::nothrow);  // 1st: succeeds
  p[1] = ::operator new(8, std::nothrow);  // 2nd: fails
  p[2] = ::operator new(8, std::nothrow);  // 3rd: past the countdown, succeeds
  fault::disarm();
  const long allocations = fault::allocations;
  const bool injected = fault::injected;
  CHECK(p[0] != nullptr);
  CHECK(p[1] == nullptr);
  CHECK(p[2] != nullptr);
  CHECK(allocations == 3);
  CHECK(injected);
  for (void* q : p) ::operator delete(q);
  // Disarmed, nothing is counted and nothing fails.
  sink = ::operator new(8);
  ::operator delete(sink);
  const long after = fault::allocations;
  CHECK(after == 3);
}

TEST_CASE("fault injection: sizes of 0 and sizes that cannot be rounded up",
          "[alloc][fault_injection]") {
  // A size of 0 still gets a distinct, usable block, in both the plain and aligned forms
  // (max(size, 1); the aligned one used to ask aligned_alloc for 0 bytes, which may
  // return nullptr and so a bad_alloc nobody injected).
  void* a = ::operator new(0, kAlignment);
  void* b = ::operator new(0, kAlignment);
  CHECK(a != b);
  CHECK(aligned(a));
  CHECK(aligned(b));
  ::operator delete(a, kAlignment);
  ::operator delete(b, kAlignment);
  void* c = ::operator new(0);
  void* d = ::operator new(0);
  CHECK(c != d);
  ::operator delete(c);
  ::operator delete(d);
  // SIZE_MAX - 8 rounded up to a multiple of 64 wraps past 0: a failure, not a tiny
  // block (it used to round to 0 and return one). volatile: no compile-time size.
  volatile std::size_t huge = SIZE_MAX - 8;
  void* e = ::operator new(huge, kAlignment, std::nothrow);
  CHECK(e == nullptr);
  CHECK_THROWS_AS(sink = ::operator new(huge, kAlignment), std::bad_alloc);
}

namespace {

using Layer = GqaLayer<float>;
using Cache = Layer::cache_type<float>;
using Workspace = Layer::Workspace;

// A tiny layer and a cache of 4 tokens for the sweep's own tests.
struct Sweep {
  Layer layer = Layer::random(gqa_config(8, 2, 4, 1), 1);
  Cache start = layer.make_cache();
  Sweep() { layer.prefill(test::random_input<float>(4, 8, 2), start, Threads{1}); }
};

// Two allocations of its own, the cache untouched.
void two_allocations(Cache&, Workspace&) {
  sink = ::operator new(8);
  ::operator delete(sink);
  sink = ::operator new[](8, kAlignment);
  ::operator delete[](sink, kAlignment);
}

// Swallows the failure of its first allocation, then allocates again.
void swallowing_call(Cache&, Workspace&) {
  try {
    sink = ::operator new(8);
    ::operator delete(sink);
  } catch (const std::bad_alloc&) {
    // swallowed: the call goes on as if the memory had been there
  }
  sink = ::operator new(8);
  ::operator delete(sink);
}

}  // namespace

TEST_CASE("the strong-guarantee sweep fails each allocation once, then ends",
          "[alloc][fault_injection]") {
  const Sweep s;
  // Runs 1 and 2 throw; run 3 makes 2 < 3 allocations and ends the sweep.
  CHECK(test::check_every_allocation_failure("two allocations", s.layer, s.start, Threads{1},
                                             two_allocations) == 2);
  // A call that allocates nothing: the first run ends it.
  CHECK(test::check_every_allocation_failure("no allocation", s.layer, s.start, Threads{1},
                                             [](Cache&, Workspace&) {}) == 0);
}

// Expected to fail, and only by the sweep's report: swallowing_call swallows the
// failure of its first allocation (a caught std::bad_alloc), so run 1 completes
// although its armed allocation failed. The sweep used to take that run for the end of
// the sweep (the call "succeeded"), so this test passed and no later allocation was
// tried; now it reports "allocation 1 (operator new(size_t)) failed but the call
// completed" and goes on: run 2 fails the second allocation (thrown), run 3 ends. No
// other assertion here: with [!shouldfail] any failing one would make the test pass.
TEST_CASE("the strong-guarantee sweep reports a swallowed allocation failure",
          "[alloc][fault_injection][!shouldfail]") {
  const Sweep s;
  test::check_every_allocation_failure("swallowing", s.layer, s.start, Threads{1}, swallowing_call);
}
