// The raw storage of cache buffers: aligned for the widest vector unit and, for large
// buffers on Linux, advised onto transparent huge pages.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvattn {

/// A fixed-size array of trivially copyable S, aligned to 64 bytes (an AVX-512
/// register, a cache line). Buffers of 4 MiB and more are aligned to 2 MiB and, on
/// Linux, advised with madvise(MADV_HUGEPAGE): a decode step streams the whole cache,
/// and 4 KiB pages cost a TLB miss every 4 KiB of it. The advice is best effort (the
/// kernel may have THP disabled); it never fails the allocation. Elements are left
/// uninitialized: caches write a token before they count it.
template <class S>
class AlignedBuffer {
  static_assert(std::is_trivially_copyable_v<S>, "cache storage must be trivially copyable");

 public:
  static constexpr std::size_t kAlignment = 64;
  static constexpr std::size_t kHugePage = std::size_t{2} << 20;
  static constexpr std::size_t kHugeThreshold = std::size_t{4} << 20;

  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t size) : size_(size) {
    if (size == 0) return;
    const std::size_t bytes = size * sizeof(S);
    alignment_ = bytes >= kHugeThreshold ? kHugePage : kAlignment;
    const std::size_t rounded = (bytes + alignment_ - 1) / alignment_ * alignment_;
    data_ = static_cast<S*>(::operator new (rounded, std::align_val_t{alignment_}));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (alignment_ == kHugePage) (void)::madvise(data_, rounded, MADV_HUGEPAGE);
#endif
  }
  AlignedBuffer(const AlignedBuffer& other) : AlignedBuffer(other.size_) {
    if (size_ > 0) std::memcpy(data_, other.data_, size_ * sizeof(S));
  }
  AlignedBuffer(AlignedBuffer&& other) noexcept { swap(other); }
  AlignedBuffer& operator=(AlignedBuffer other) noexcept {
    swap(other);
    return *this;
  }
  ~AlignedBuffer() {
    if (data_ != nullptr) ::operator delete (data_, std::align_val_t{alignment_});
  }

  void swap(AlignedBuffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    std::swap(alignment_, other.alignment_);
  }

  S* data() noexcept { return data_; }
  const S* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  S* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t alignment_ = kAlignment;
};

}  // namespace kvattn
