// A page pool and a paged cache for each layer type, by overload: the batch and paged
// tests run one body over GqaLayer, MlaLayer and LrkvLayer.
#pragma once

#include <memory>
#include <utility>

#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/lrkv.hpp"
#include "kvattn/attention/mla.hpp"

namespace kvattn::test {

template <class S, class T>
std::shared_ptr<PagePool> make_pool(const GqaLayer<T>& layer, Index page, Index pages) {
  return make_gqa_page_pool<S>(layer.config(), page, pages);
}
template <class S, class T>
std::shared_ptr<PagePool> make_pool(const MlaLayer<T>& layer, Index page, Index pages) {
  return make_mla_page_pool<S>(layer.config(), page, pages);
}
template <class S, class T>
std::shared_ptr<PagePool> make_pool(const LrkvLayer<T>& layer, Index page, Index pages) {
  return make_lrkv_page_pool<S>(layer.config(), page, pages);
}
template <class S, class T>
PagedGqaCache<T, S> make_paged(const GqaLayer<T>& layer, std::shared_ptr<PagePool> pool) {
  return PagedGqaCache<T, S>(layer.config(), std::move(pool));
}
template <class S, class T>
PagedMlaCache<T, S> make_paged(const MlaLayer<T>& layer, std::shared_ptr<PagePool> pool) {
  return PagedMlaCache<T, S>(layer.config(), std::move(pool));
}
template <class S, class T>
PagedLrkvCache<T, S> make_paged(const LrkvLayer<T>& layer, std::shared_ptr<PagePool> pool) {
  return PagedLrkvCache<T, S>(layer.config(), std::move(pool));
}

}  // namespace kvattn::test
