// The KV-cache concept that every mechanism's cache models.
//
// A cache holds one sequence's keys and values for one layer, in the compact form
// of its mechanism (see the table in docs/api.md). Its members:
//
//   compute_type, storage_type  T (float/double) and S (defaults to T)
//   rows_type                   a struct of the already-projected rows append takes
//   tokens()                    number of cached (held) tokens
//   sequence_length()           the sequence's length, the position of the next token:
//                               tokens() plus what a windowed cache no longer holds
//   capacity(), reserve(n)      tokens that fit without reallocating; grow to n
//   clear(), truncate(n)        drop every token; roll back to the first n tokens of the
//                               sequence
//   elements_per_token()        stored scalars per token, from the storage layout
//   bytes()                     bytes held for the cached tokens (real buffer extents)
//   capacity_bytes()            bytes allocated for cache contents
//   append(rows)                append raw rows (import a cache, or fill one fast)
//
// Guarantees every model gives: copying forks the sequence; capacity grows
// geometrically; append never reallocates when capacity suffices; a failed append
// (bad shape, allocation failure) leaves the cache exactly as it was.
#pragma once

#include <concepts>
#include <cstddef>

#include "kvattn/core/types.hpp"

namespace kvattn {

template <class C>
concept KVCache = std::copyable<C> &&
    requires(C& cache, const C& const_cache, Index n, const typename C::rows_type& rows) {
  typename C::compute_type;
  typename C::storage_type;
  { const_cache.tokens() } -> std::same_as<Index>;
  { const_cache.sequence_length() } -> std::same_as<Index>;
  { const_cache.capacity() } -> std::same_as<Index>;
  cache.reserve(n);
  cache.clear();
  cache.truncate(n);
  { const_cache.elements_per_token() } -> std::same_as<Index>;
  { const_cache.bytes() } -> std::same_as<std::size_t>;
  { const_cache.capacity_bytes() } -> std::same_as<std::size_t>;
  cache.append(rows);
};

namespace detail {

// Grows every cache of a decode_batch, all or none (attention/decode_batch.hpp); a friend
// of each cache type.
struct BatchGrowth;

// Member-by-member checks, so a type that misses one member gets a message naming
// it instead of a wall of template errors. Use: static_assert(check_kv_cache<C>()).
template <class C>
consteval bool check_kv_cache() {
  static_assert(std::copyable<C>, "a KVCache must be copyable (copying forks the sequence)");
  static_assert(
      requires { typename C::compute_type; }, "a KVCache needs compute_type");
  static_assert(
      requires { typename C::storage_type; }, "a KVCache needs storage_type");
  static_assert(
      requires { typename C::rows_type; }, "a KVCache needs rows_type");
  static_assert(
      requires(const C& c) {
        { c.tokens() } -> std::same_as<Index>;
      },
      "a KVCache needs Index tokens() const");
  static_assert(
      requires(const C& c) {
        { c.sequence_length() } -> std::same_as<Index>;
      },
      "a KVCache needs Index sequence_length() const");
  static_assert(
      requires(const C& c) {
        { c.capacity() } -> std::same_as<Index>;
      },
      "a KVCache needs Index capacity() const");
  static_assert(
      requires(C & c, Index n) { c.reserve(n); }, "a KVCache needs reserve(Index)");
  static_assert(
      requires(C & c) { c.clear(); }, "a KVCache needs clear()");
  static_assert(
      requires(C & c, Index n) { c.truncate(n); }, "a KVCache needs truncate(Index)");
  static_assert(
      requires(const C& c) {
        { c.elements_per_token() } -> std::same_as<Index>;
      },
      "a KVCache needs Index elements_per_token() const");
  static_assert(
      requires(const C& c) {
        { c.bytes() } -> std::same_as<std::size_t>;
      },
      "a KVCache needs std::size_t bytes() const");
  static_assert(
      requires(const C& c) {
        { c.capacity_bytes() } -> std::same_as<std::size_t>;
      },
      "a KVCache needs std::size_t capacity_bytes() const");
  return KVCache<C>;
}

}  // namespace detail
}  // namespace kvattn
