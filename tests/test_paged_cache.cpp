// [cache][paged]: paged caches hold exactly the rows a contiguous cache holds, share
// pages between forks with copy-on-write, return pages on truncate and destruction,
// refuse an exhausted pool without changing anything, stay consistent with several
// threads forking and appending at once, and hold the bytes the analysis predicts with
// page rounding.
#include <catch2/catch.hpp>

#include <cstdint>
#include <limits>
#include <thread>
#include <vector>

#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/cache/paged_gqa_cache.hpp"
#include "kvattn/cache/paged_lrkv_cache.hpp"
#include "kvattn/cache/paged_mla_cache.hpp"
#include "test_util.hpp"

using namespace kvattn;

namespace {

using Mat = RowMatrix<float>;

// Every stored value of token t, in one vector, through the pointers the kernels use.
template <class Cache>
std::vector<float> token_values(const Cache& cache, Index t) {
  std::vector<float> v;
  const GqaConfig& c = cache.config();
  for (Index g = 0; g < c.n_kv_heads; ++g) {
    for (Index j = 0; j < c.head_dim; ++j) v.push_back(static_cast<float>(cache.key_row(g, t)[j]));
    for (Index j = 0; j < c.head_dim; ++j)
      v.push_back(static_cast<float>(cache.value_row(g, t)[j]));
  }
  return v;
}

struct Rows {
  Mat keys, values;
};
Rows gqa_rows(const GqaConfig& c, Index n, std::uint64_t seed) {
  return {test::random_input<float>(n, c.kv_width(), seed),
          test::random_input<float>(n, c.kv_width(), seed + 1)};
}

}  // namespace

TEST_CASE("a paged GQA cache holds the rows of a contiguous one", "[cache][paged]") {
  const GqaConfig c = gqa_config(16, 4, 6, 2);
  for (const Index page_tokens : {1, 5, 16}) {
    CAPTURE(page_tokens);
    auto pool = make_gqa_page_pool<float>(c, page_tokens, 64);
    PagedGqaCache<float> paged(c, pool);
    GqaCache<float> flat(c);
    for (const Index n : {3, 1, 7, 0, 12}) {
      const Rows r = gqa_rows(c, n, static_cast<std::uint64_t>(n + 10));
      paged.append(r.keys, r.values);
      flat.append(r.keys, r.values);
    }
    REQUIRE(paged.tokens() == 23);
    for (Index t = 0; t < 23; ++t) CHECK(token_values(paged, t) == token_values(flat, t));
    CHECK(paged.bytes() == flat.bytes());
    CHECK(paged.elements_per_token() == flat.elements_per_token());
    CHECK(paged.capacity() == (23 + page_tokens - 1) / page_tokens * page_tokens);
    CHECK(pool->pages_in_use() == paged.capacity() / page_tokens);
    // Within a page a KV head's rows are contiguous, as the kernels read them.
    CHECK(paged.key_row(1, 0) + (page_tokens - 1) * c.head_dim ==
          paged.key_row(1, page_tokens - 1));
  }
}

TEST_CASE("forks share pages; a write into a shared page copies it first", "[cache][paged]") {
  const GqaConfig c = gqa_config(8, 2, 4, 1);
  auto pool = make_gqa_page_pool<float>(c, 4, 16);
  PagedGqaCache<float> prompt(c, pool);
  const Rows r = gqa_rows(c, 6, 1);  // pages: [0..3] full, [4..5] partial
  prompt.append(r.keys, r.values);
  REQUIRE(pool->pages_in_use() == 2);
  const auto prompt_table = prompt.block_table();
  const std::vector<float> last_before = token_values(prompt, 5);
  PagedGqaCache<float> fork = prompt;  // shares both pages
  CHECK(pool->pages_in_use() == 2);
  CHECK(fork.block_table() == prompt_table);
  for (const Index page : prompt_table) CHECK(pool->use_count(page) == 2);
  const Rows more = gqa_rows(c, 3, 2);  // tokens 6, 7 into the shared page, 8 into a new one
  fork.append(more.keys, more.values);
  CHECK(pool->pages_in_use() == 4);                 // a copy of page 1 and a new page
  CHECK(fork.block_table()[0] == prompt_table[0]);  // the full page is still shared
  CHECK(fork.block_table()[1] != prompt_table[1]);
  CHECK(pool->use_count(prompt_table[0]) == 2);
  CHECK(pool->use_count(prompt_table[1]) == 1);
  CHECK(prompt.tokens() == 6);
  CHECK(token_values(prompt, 5) == last_before);  // the original is untouched
  CHECK(token_values(fork, 5) == last_before);
  GqaCache<float> flat(c);
  flat.append(r.keys, r.values);
  flat.append(more.keys, more.values);
  for (Index t = 0; t < 9; ++t) CHECK(token_values(fork, t) == token_values(flat, t));
  // Truncate returns whole pages; destruction returns the rest.
  fork.truncate(4);
  CHECK(pool->pages_in_use() == 2);  // fork holds page 0 (shared), prompt holds 0 and 1
  {
    PagedGqaCache<float> other = prompt;
    other.clear();
    CHECK(other.capacity() == 0);
  }
  CHECK(pool->pages_in_use() == 2);
  fork = PagedGqaCache<float>(c, pool);
  CHECK(pool->pages_in_use() == 2);
  prompt.truncate(0);
  CHECK(pool->pages_in_use() == 0);
}

TEST_CASE("an exhausted pool is a clear error that changes nothing",
          "[cache][paged][reliability]") {
  const GqaConfig c = gqa_config(8, 2, 4, 1);
  auto pool = make_gqa_page_pool<float>(c, 4, 3);
  PagedGqaCache<float> a(c, pool);
  const Rows r = gqa_rows(c, 10, 3);  // 3 pages
  a.append(r.keys, r.values);
  REQUIRE(pool->pages_free() == 0);
  PagedGqaCache<float> b = a;  // shares all three
  const auto table = b.block_table();
  const std::vector<float> last = token_values(b, 9);
  const Rows one = gqa_rows(c, 1, 4);
  // b's last page is shared: writing needs a copy, and the pool has none left.
  CHECK_THROWS_AS(b.append(one.keys, one.values), pool_exhausted);
  CHECK_THROWS_WITH(b.append(one.keys, one.values),
                    Catch::Contains("all 3 pages of 4 tokens are in use"));
  CHECK(b.tokens() == 10);
  CHECK(b.block_table() == table);
  CHECK(token_values(b, 9) == last);
  CHECK(pool->pages_in_use() == 3);
  CHECK_THROWS_AS(a.reserve(13), pool_exhausted);
  CHECK(a.capacity() == 12);
  // More pages than the whole pool holds, up to the largest n (no overflow rounding it
  // up to pages, no std::length_error from the block table): pool_exhausted, unchanged.
  CHECK_THROWS_WITH(a.reserve(std::numeric_limits<Index>::max()),
                    Catch::Contains("the pool holds 3 in all"));
  CHECK_THROWS_AS(a.reserve(std::numeric_limits<Index>::max() - 1), pool_exhausted);
  CHECK(a.capacity() == 12);
  CHECK(a.block_table().size() == 3);
  CHECK(pool->pages_in_use() == 3);
  // A pool of another layout is refused.
  CHECK_THROWS_WITH(PagedGqaCache<float>(gqa_config(8, 2, 4, 2), pool),
                    Catch::Contains("make_gqa_page_pool"));
  CHECK_THROWS_AS(PagedGqaCache<double>(c, pool), config_error);
}

TEST_CASE("threads fork one prompt and append at once", "[cache][paged][threads]") {
  const GqaConfig c = gqa_config(8, 2, 4, 2);
  auto pool = make_gqa_page_pool<float>(c, 8, 512);
  PagedGqaCache<float> prompt(c, pool);
  const Rows r = gqa_rows(c, 20, 5);  // 3 pages, the last one partial
  prompt.append(r.keys, r.values);
  constexpr int kThreads = 4;
  std::vector<PagedGqaCache<float>> forks(kThreads, prompt);
  std::vector<Rows> added;
  for (int i = 0; i < kThreads; ++i) added.push_back(gqa_rows(c, 50, 100 + std::uint64_t(i)));
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      for (Index t = 0; t < 50; ++t) {
        forks[std::size_t(i)].append(added[std::size_t(i)].keys.row(t),
                                     added[std::size_t(i)].values.row(t));
      }
    });
  }
  for (auto& t : threads) t.join();
  // Each fork: the 2 full prompt pages shared, then ceil(70 / 8) - 2 = 7 pages of its own.
  CHECK(pool->pages_in_use() == 3 + kThreads * 7);
  for (int i = 0; i < kThreads; ++i) {
    GqaCache<float> flat(c);
    flat.append(r.keys, r.values);
    flat.append(added[std::size_t(i)].keys, added[std::size_t(i)].values);
    for (Index t = 0; t < 70; ++t)
      CHECK(token_values(forks[std::size_t(i)], t) == token_values(flat, t));
  }
  CHECK(prompt.tokens() == 20);
  forks.clear();
  CHECK(pool->pages_in_use() == 3);
}

TEST_CASE("pool bytes in use equal the analysis with page rounding", "[cache][paged][analysis]") {
  using namespace analysis;
  const GqaConfig g = gqa_config(64, 8, 16, 2);
  MlaConfig m;
  m.d_model = 32;
  m.n_heads = 4;
  m.kv_rank = 24;
  m.qk_nope_dim = 8;
  m.rope_dim = 8;
  m.v_dim = 8;
  m.rope.layout = RopeLayout::half_split;
  LrkvConfig l{32, 4, 8, 3, LrkvRopeMode::decoupled, {RopeLayout::half_split, 10000.0, 0}};
  l.rope_dim = 4;
  l.key_norm = true;
  for (const Index seq_len : {1, 15, 16, 17, 100}) {
    for (const Index page_tokens : {1, 16, 64}) {
      CAPTURE(seq_len, page_tokens);
      const Workload work{seq_len, 1, page_tokens};
      {
        auto pool = make_gqa_page_pool<Eigen::bfloat16>(g, page_tokens, 128);
        PagedGqaCache<float, Eigen::bfloat16> cache(g, pool);
        cache.reserve(seq_len);
        const auto predicted = total_bytes(cache_layout(g), plain_storage(Dtype::bf16), {1}, work);
        CHECK(pool->bytes_in_use() == static_cast<std::size_t>(predicted));
        CHECK(cache.capacity_bytes() == static_cast<std::size_t>(predicted));
      }
      {
        auto pool = make_mla_page_pool<float>(m, page_tokens, 128);
        PagedMlaCache<float> cache(m, pool);
        cache.reserve(seq_len);
        CHECK(pool->bytes_in_use() == static_cast<std::size_t>(total_bytes(
                                          cache_layout(m), plain_storage(Dtype::fp32), {1}, work)));
      }
      {
        auto pool = make_lrkv_page_pool<Eigen::bfloat16>(l, page_tokens, 128);
        PagedLrkvCache<float, Eigen::bfloat16> cache(l, pool);
        cache.reserve(seq_len);
        CHECK(pool->bytes_in_use() == static_cast<std::size_t>(total_bytes(
                                          cache_layout(l), plain_storage(Dtype::bf16), {1}, work)));
      }
    }
  }
}

TEST_CASE("paged MLA and LRKV caches hold the rows of contiguous ones", "[cache][paged]") {
  MlaConfig m;
  m.d_model = 16;
  m.n_heads = 2;
  m.kv_rank = 10;
  m.qk_nope_dim = 4;
  m.rope_dim = 4;
  m.v_dim = 4;
  m.rope.layout = RopeLayout::interleaved;
  {
    auto pool = make_mla_page_pool<Eigen::bfloat16>(m, 3, 16);
    PagedMlaCache<float, Eigen::bfloat16> paged(m, pool);
    MlaCache<float, Eigen::bfloat16> flat(m);
    const Mat latent = test::random_input<float>(11, m.kv_rank, 1);
    const Mat rope = test::random_input<float>(11, m.rope_dim, 2);
    paged.append(latent, rope);
    flat.append(latent, rope);
    for (Index t = 0; t < 11; ++t) {
      for (Index j = 0; j < m.cache_elements_per_token(); ++j) {
        CHECK(paged.row_data(t)[j] == flat.row_data(t)[j]);
      }
    }
  }
  LrkvConfig l{16, 3, 6, 3, LrkvRopeMode::decoupled, {RopeLayout::half_split, 10000.0, 0}};
  l.rope_dim = 2;
  l.key_norm = true;
  auto pool = make_lrkv_page_pool<Eigen::bfloat16>(l, 5, 16);
  PagedLrkvCache<float, Eigen::bfloat16> paged(l, pool);
  LrkvCache<float, Eigen::bfloat16> flat(l);
  const Index n = 13, hr = l.residual_width();
  const Mat sk = test::random_input<float>(n, 6, 3), sv = test::random_input<float>(n, 6, 4);
  const Mat rk = test::random_input<float>(n, hr, 5), rv = test::random_input<float>(n, hr, 6);
  const Mat kr = test::random_input<float>(n, 2, 7);
  const Mat rms = (test::random_input<float>(n, 3, 8).array().abs() + 0.5f).matrix();
  paged.append({sk, sv, rk, rv, kr, rms});
  flat.append({sk, sv, rk, rv, kr, rms});
  for (Index t = 0; t < n; ++t) {
    for (Index j = 0; j < 6 + hr + 2; ++j) CHECK(paged.key_row(t)[j] == flat.key_row(t)[j]);
    for (Index j = 0; j < 6 + hr; ++j) CHECK(paged.value_row(t)[j] == flat.value_row(t)[j]);
    for (Index h = 0; h < 3; ++h) CHECK(paged.rms_row(t)[h] == flat.rms_row(t)[h]);
    // Every element is aligned to its own size (packed pages, the RMS block first).
    CHECK(reinterpret_cast<std::uintptr_t>(paged.rms_row(t)) % alignof(float) == 0);
    CHECK(reinterpret_cast<std::uintptr_t>(paged.key_row(t)) % alignof(Eigen::bfloat16) == 0);
  }
  RowMatrix<float> bad_rms = rms.topRows(1);
  bad_rms(0, 2) = 0.0f;
  CHECK_THROWS_AS(paged.append({sk.topRows(1), sv.topRows(1), rk.topRows(1), rv.topRows(1),
                                kr.topRows(1), bad_rms}),
                  shape_error);
  CHECK(paged.tokens() == n);
}
