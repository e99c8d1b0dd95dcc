// [alloc]: once a cache has capacity and has decoded once at a thread count, decode and
// attend allocate nothing: MHA, GQA, MQA, MLA and LRKV, float and bfloat16 storage, 1
// and 2 threads (2 threads split the sequence where there is one group).
//
// Three counters: the replaced global operator new and Eigen's malloc guard (from
// alloc_counter.hpp), and, on glibc without a sanitizer, the C allocation functions
// (malloc, calloc, realloc, memalign, aligned_alloc, posix_memalign) replaced below, so
// that allocations by C code such as the OpenMP runtime count too.
#include "alloc_counter.hpp"  // first: replaces operator new, arms Eigen's malloc guard

#include <catch2/catch.hpp>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>

#include "attend_util.hpp"
#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"
#include "test_util.hpp"

#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#if defined(__has_feature)
#if !__has_feature(address_sanitizer) && !__has_feature(thread_sanitizer) && \
    !__has_feature(memory_sanitizer)
#define KVATTN_TEST_COUNT_MALLOC 1
#endif
#else
#define KVATTN_TEST_COUNT_MALLOC 1
#endif
#endif

namespace {
std::atomic<long> malloc_calls{0};
}  // namespace

#ifdef KVATTN_TEST_COUNT_MALLOC
// glibc's own entry points, to which the replacements forward.
extern "C" {
void* __libc_malloc(std::size_t size);
void* __libc_calloc(std::size_t count, std::size_t size);
void* __libc_realloc(void* p, std::size_t size);
void* __libc_memalign(std::size_t alignment, std::size_t size);

void* malloc(std::size_t size) noexcept {
  ++malloc_calls;
  return __libc_malloc(size);
}
void* calloc(std::size_t count, std::size_t size) noexcept {
  ++malloc_calls;
  return __libc_calloc(count, size);
}
void* realloc(void* p, std::size_t size) noexcept {
  ++malloc_calls;
  return __libc_realloc(p, size);
}
void* memalign(std::size_t alignment, std::size_t size) noexcept {
  ++malloc_calls;
  return __libc_memalign(alignment, size);
}
void* aligned_alloc(std::size_t alignment, std::size_t size) noexcept {
  ++malloc_calls;
  return __libc_memalign(alignment, size);
}
int posix_memalign(void** out, std::size_t alignment, std::size_t size) noexcept {
  ++malloc_calls;
  if (alignment % sizeof(void*) != 0 || (alignment & (alignment - 1)) != 0) return EINVAL;
  void* p = __libc_memalign(alignment, size);
  if (p == nullptr) return ENOMEM;
  *out = p;
  return 0;
}
}
constexpr bool kCountsMalloc = true;
#else
constexpr bool kCountsMalloc = false;
#endif

using namespace kvattn;
using kvattn::test::heads_width;
using kvattn::test::query_width;
using kvattn::test::random_input;

namespace {

using MatF = RowMatrix<float>;

struct Counts {
  long operator_new = 0;
  bool eigen_malloc = false;
  long malloc_calls = 0;  // every C allocation, operator new's included (0 if not counted)
};

template <class Body>
Counts count_all(Body&& body) {
  const long before = malloc_calls.load();
  const auto count = kvattn::test::count_allocations(body);
  return {count.operator_new, count.eigen_malloc, malloc_calls.load() - before};
}

// Random rows through the raw append (a prefill would be quadratic at these lengths).
template <class S>
void fill_random(GqaCache<float, S>& cache, Index n, std::uint64_t seed) {
  const Index w = cache.config().n_kv_heads * cache.config().head_dim;
  cache.append(random_input<float>(n, w, seed), random_input<float>(n, w, seed + 1));
}
template <class S>
void fill_random(MlaCache<float, S>& cache, Index n, std::uint64_t seed) {
  const MlaConfig& c = cache.config();
  cache.append(random_input<float>(n, c.kv_rank, seed),
               random_input<float>(n, c.rope_dim, seed + 1));
}
template <class S>
void fill_random(LrkvCache<float, S>& cache, Index n, std::uint64_t seed) {
  const LrkvConfig& c = cache.config();
  const Index hr = c.n_heads * c.rank;
  const MatF rms = MatF::Constant(n, c.key_norm ? c.n_heads : 0, 0.8f);
  cache.append({random_input<float>(n, c.head_dim, seed),
                random_input<float>(n, c.head_dim, seed + 1), random_input<float>(n, hr, seed + 2),
                random_input<float>(n, hr, seed + 3),
                random_input<float>(n, c.decoupled_dim(), seed + 4), rms});
}

constexpr Index kSteps = 20;

// A cache of `length` tokens with room for more, one warm-up decode at `threads`, then
// kSteps decodes and kSteps attends at `threads` with a workspace from make_workspace:
// nothing allocates.
template <class S, class Layer>
void check_no_allocation(const Layer& layer, Threads threads, Index length) {
  const auto& c = layer.config();
  auto cache = layer.template make_cache<S>(length + kSteps + 1);
  fill_random(cache, length, 7);
  const MatF x = random_input<float>(kSteps + 1, c.d_model, 8);
  const MatF query = random_input<float>(kSteps, query_width(c), 9);
  RowVector<float> out(c.d_model), heads(heads_width(c));
  // The warm-up decode (with a workspace of its own) starts the OpenMP team; the
  // counted steps use a workspace that make_workspace alone sized.
  layer.decode(x.row(0), cache, out, threads);
  auto workspace = layer.make_workspace(threads);
  const Index capacity = cache.capacity();
  const Counts count = count_all([&] {
    for (Index i = 0; i < kSteps; ++i) {
      layer.decode(x.row(i + 1), cache, out, workspace, threads);
      layer.attend(query.row(i), cache, heads, workspace, threads);
    }
  });
  CAPTURE(sizeof(S), threads.count, length, count.malloc_calls, kCountsMalloc);
  CHECK(count.operator_new == 0);
  CHECK_FALSE(count.eigen_malloc);
  CHECK(count.malloc_calls == 0);
  CHECK(cache.tokens() == length + kSteps + 1);
  CHECK(cache.capacity() == capacity);
  CHECK(out.allFinite());
  CHECK(heads.allFinite());
}

template <class Layer>
void check_every_storage_and_thread_count(const Layer& layer, Index length) {
  for (const Threads threads : {Threads{1}, Threads{2}}) {
    check_no_allocation<float>(layer, threads, length);
    check_no_allocation<Eigen::bfloat16>(layer, threads, length);
  }
}

// Block-quantized caches (one block per row, and several).
template <class Layer>
void check_quantized_storage(const Layer& layer, Index length) {
  for (const Threads threads : {Threads{1}, Threads{2}}) {
    check_no_allocation<Int8<128>>(layer, threads, length);
    check_no_allocation<Fp8E4M3<16>>(layer, threads, length);
  }
}

MlaConfig small_mla() {
  MlaConfig c;
  c.d_model = 48;
  c.n_heads = 4;
  c.kv_rank = 128;  // a 576-byte row: tiles of 112 tokens
  c.q_rank = 24;
  c.q_norm = true;
  c.qk_nope_dim = 16;
  c.rope_dim = 16;
  c.v_dim = 12;
  c.rope = {RopeLayout::interleaved, 10000.0, 3};
  c.yarn = {true, 4.0, 128, 32.0, 1.0, 1.0, 1.0};
  return c;
}

}  // namespace

// Lengths at which the one-group mechanisms split the sequence across 2 threads for the
// whole run (ranges of >= 4 tiles: MQA's tile is 128 tokens, MLA's 112, LRKV's 16); MHA
// and GQA spread their KV groups instead.
TEST_CASE("Decode and attend allocate nothing after a warm-up, every mechanism", "[alloc]") {
  if (!kCountsMalloc) WARN("C allocation functions are not counted in this build (sanitizer)");
  const RopeConfig rope{RopeLayout::half_split, 10000.0, 0};
  SECTION("MHA") {
    check_every_storage_and_thread_count(GqaLayer<float>::random(mha_config(64, 4, 32, rope), 1),
                                         300);
  }
  SECTION("GQA") {
    check_every_storage_and_thread_count(GqaLayer<float>::random(gqa_config(64, 8, 32, 2, rope), 2),
                                         300);
  }
  SECTION("MQA") {
    check_every_storage_and_thread_count(GqaLayer<float>::random(mqa_config(64, 8, 64, rope), 3),
                                         1100);
  }
  SECTION("GQA and MQA, quantized caches") {
    check_quantized_storage(GqaLayer<float>::random(gqa_config(64, 8, 32, 2, rope), 2), 300);
    check_quantized_storage(GqaLayer<float>::random(mqa_config(64, 8, 64, rope), 3), 1100);
  }
  SECTION("MLA") {
    const auto layer = MlaLayer<float>::random(small_mla(), 4);
    const MlaConfig& c = layer.config();
    CHECK(detail::plan_split(1, c.n_heads, c.kv_rank, 1000, layer.decode_tile(), 0, 2).splits >= 2);
    check_every_storage_and_thread_count(layer, 1000);
    check_quantized_storage(layer, 1000);
    // 16 heads: on AVX-512 (test_decode_noalloc_avx512) the scores take the transposed
    // score, whose transposed queries live in the workspace too.
    MlaConfig wide = small_mla();
    wide.n_heads = 16;
    check_every_storage_and_thread_count(MlaLayer<float>::random(wide, 6), 1000);
  }
  SECTION("LRKV") {
    LrkvConfig c{64, 4, 32, 8, LrkvRopeMode::shared, rope};
    c.key_norm = true;
    const auto layer = LrkvLayer<float>::random(c, 5);
    check_every_storage_and_thread_count(layer, 300);
    check_quantized_storage(layer, 300);
  }
}

// A sequence that grows across the point where 2 threads start splitting it (one group:
// 2 ranges of >= 2 split granules each, detail::split_granule, so from 4 granules): the
// workspace is sized for the split at warm-up, so the growing sequence does not allocate
// either.
TEST_CASE("Decode allocates nothing as a sequence grows across the thread split", "[alloc]") {
  const auto layer = GqaLayer<float>::random(mqa_config(64, 8, 64), 6);
  const auto& c = layer.config();
  const Index start = 4 * detail::split_granule(layer.decode_tile()) - 10;  // warm-up: start + 1
  CHECK(detail::plan_split(1, c.n_heads, c.head_dim, start + 1, layer.decode_tile(), 0, 2).splits ==
        1);
  CHECK(detail::plan_split(1, c.n_heads, c.head_dim, start + kSteps + 1, layer.decode_tile(), 0, 2)
            .splits == 2);
  check_no_allocation<float>(layer, Threads{2}, start);
}

TEST_CASE("The allocation counters of this binary do fire", "[alloc]") {
  const auto by_new = count_all([] {
    void* volatile p = ::operator new(16);
    ::operator delete(p);
  });
  CHECK(by_new.operator_new == 1);
  CHECK(count_all([] { RowMatrix<float> m(64, 64); }).eigen_malloc);
  if (kCountsMalloc) {
    const auto by_malloc = count_all([] {
      void* volatile p = std::malloc(16);
      std::free(p);
      void* volatile q = std::aligned_alloc(64, 128);
      std::free(q);
    });
    CHECK(by_malloc.malloc_calls == 2);
    CHECK(by_new.malloc_calls == 1);  // operator new allocates with malloc
  }
}
