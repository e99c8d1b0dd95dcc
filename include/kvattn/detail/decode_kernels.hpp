// Vectorized tile kernels of the decode step (Eigen packets: SSE, AVX, AVX-512 or
// NEON, whatever the build targets). Cached rows are read in storage type S and
// widened to the compute type T in registers; everything accumulates in T.
//
// Layouts: a tile holds n cached tokens, row t at `rows + t * row_stride`. Logits and
// softmax weights are token-major, w[t * w_stride + i] for query row i, so a tile's
// online-softmax update is vectorized over query rows.
//
//   score_dot        logits of a few query rows (G small): one dot product per
//                    (token, query), several tokens in flight to hide FMA latency;
//   score_broadcast  logits of many query rows (G a multiple of the packet size):
//                    the query block lives in registers, each cached element is
//                    broadcast once and multiplies every query row at once (no
//                    horizontal reductions);
//   accumulate       acc (G x d_v) += w^T V_tile, register-blocked 4 query rows x
//                    4 packets of value columns.
#pragma once

#include <type_traits>

#include <Eigen/Core>

#include "kvattn/core/types.hpp"

// Register blocks are small arrays indexed by constant-trip loops; they must be
// fully unrolled so the arrays live in registers, not on the stack.
#if defined(__clang__)
#define KVATTN_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define KVATTN_UNROLL _Pragma("GCC unroll 16")
#else
#define KVATTN_UNROLL
#endif

namespace kvattn::detail {

namespace ei = Eigen::internal;

template <class T>
using Packet = typename ei::packet_traits<T>::type;

template <class T>
inline constexpr Index packet_size = ei::unpacket_traits<Packet<T>>::size;

/// Register blocks are sized so accumulators, operands and a broadcast fit in the
/// vector registers: 16 (SSE, AVX2, NEON-32) or 32 (AVX-512, NEON-64).
inline constexpr bool many_registers = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS >= 32;

/// Asks for `count` rows of `row_bytes` bytes, `row_stride` elements apart, to be
/// brought into cache ahead of use: the decode driver touches the next tile while it
/// computes on this one, so the memory system always has a stream of requests in
/// flight (the hardware prefetcher alone stalls on the tile's access pattern).
template <class S>
inline void prefetch_rows(const S* rows, Index row_stride, Index count, Index row_elements) {
#if defined(__GNUC__) || defined(__clang__)
  const Index row_bytes = row_elements * static_cast<Index>(sizeof(S));
  for (Index t = 0; t < count; ++t) {
    const char* row = reinterpret_cast<const char*>(rows + t * row_stride);
    for (Index b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
  }
#else
  (void)rows, (void)row_stride, (void)count, (void)row_elements;
#endif
}

/// P consecutive elements of storage type S as one packet of T.
template <class T, class S>
inline Packet<T> load_widened(const S* from) {
  if constexpr (std::is_same_v<S, T>) {
    return ei::ploadu<Packet<T>>(from);
  } else {
#if defined(EIGEN_VECTORIZE_AVX512)
    if constexpr (std::is_same_v<T, float> && std::is_same_v<S, Eigen::bfloat16> &&
                  packet_size<T> == 16) {
      return ei::pcast<ei::Packet16bf, ei::Packet16f>(ei::ploadu<ei::Packet16bf>(from));
    }
#elif defined(EIGEN_VECTORIZE_AVX)
    if constexpr (std::is_same_v<T, float> && std::is_same_v<S, Eigen::bfloat16> &&
                  packet_size<T> == 8) {
      return ei::pcast<ei::Packet8bf, ei::Packet8f>(ei::ploadu<ei::Packet8bf>(from));
    }
#endif
    // Portable path: widen through a small stack array.
    alignas(64) T widened[packet_size<T>];
    for (Index k = 0; k < packet_size<T>; ++k) widened[k] = static_cast<T>(from[k]);
    return ei::pload<Packet<T>>(widened);
  }
}

/// logits[t * w_stride + i] (+)= q_i . k_t for i < G, t < n (q: G x dk rows of stride
/// q_stride; k_t = rows + t * row_stride). With `add`, the logits are added to.
///
/// B adjacent tokens x M query rows are in flight (one accumulator chain each), so
/// each loaded query packet serves B tokens and each key packet M queries; the B rows
/// are contiguous in memory, so the tile still streams front to back.
template <class T, class S>
void score_dot(const T* q, Index q_stride, Index G, Index dk, const S* rows, Index row_stride,
               Index n, T* logits, Index w_stride, bool add) {
  constexpr Index P = packet_size<T>;
  const Index full = dk / P * P;
  auto block = [&]<int M, int B>(Index i0, Index t0) {
    Packet<T> acc[B][M];
    KVATTN_UNROLL
    for (int b = 0; b < B; ++b) {
      KVATTN_UNROLL
      for (int m = 0; m < M; ++m) acc[b][m] = ei::pset1<Packet<T>>(T(0));
    }
    for (Index j = 0; j < full; j += P) {
      Packet<T> qp[M];
      KVATTN_UNROLL
      for (int m = 0; m < M; ++m) qp[m] = ei::ploadu<Packet<T>>(q + (i0 + m) * q_stride + j);
      KVATTN_UNROLL
      for (int b = 0; b < B; ++b) {
        const Packet<T> kp = load_widened<T>(rows + (t0 + b) * row_stride + j);
        KVATTN_UNROLL
        for (int m = 0; m < M; ++m) acc[b][m] = ei::pmadd(qp[m], kp, acc[b][m]);
      }
    }
    KVATTN_UNROLL
    for (int b = 0; b < B; ++b) {
      const S* k = rows + (t0 + b) * row_stride;
      KVATTN_UNROLL
      for (int m = 0; m < M; ++m) {
        const T* qi = q + (i0 + m) * q_stride;
        T s = ei::predux(acc[b][m]);
        for (Index jj = full; jj < dk; ++jj) s += qi[jj] * static_cast<T>(k[jj]);
        T& out = logits[(t0 + b) * w_stride + i0 + m];
        out = add ? out + s : s;
      }
    }
  };
  auto run_rows = [&]<int M, int B>(Index i0) {
    Index t0 = 0;
    for (; t0 + B <= n; t0 += B) block.template operator()<M, B>(i0, t0);
    for (; t0 < n; ++t0) block.template operator()<M, 1>(i0, t0);
  };
  Index i0 = 0;
  for (; i0 + 4 <= G; i0 += 4) run_rows.template operator()<4, 2>(i0);
  switch (G - i0) {
    case 3:
      run_rows.template operator()<3, 2>(i0);
      break;
    case 2:
      run_rows.template operator()<2, 4>(i0);
      break;
    case 1:
      run_rows.template operator()<1, 4>(i0);
      break;
    default:
      break;
  }
}

/// logits[t * w_stride + i] (+)= q_i . k_t as score_dot, for G a multiple of the
/// packet size, from the transposed query block qt (dk x G, row j holds q_.j).
template <class T, class S>
void score_broadcast(const T* qt, Index G, Index dk, const S* rows, Index row_stride, Index n,
                     T* logits, Index w_stride, bool add) {
  constexpr Index P = packet_size<T>;
  // B tokens x Q packets of query rows in registers.
  auto block = [&]<int Q, int B>(Index i0, Index t0) {
    Packet<T> acc[B][Q];
    KVATTN_UNROLL
    for (int b = 0; b < B; ++b) KVATTN_UNROLL
    for (int c = 0; c < Q; ++c) acc[b][c] = ei::pset1<Packet<T>>(T(0));
    const S* k[B];
    KVATTN_UNROLL
    for (int b = 0; b < B; ++b) k[b] = rows + (t0 + b) * row_stride;
    for (Index j = 0; j < dk; ++j) {
      Packet<T> qp[Q];
      KVATTN_UNROLL
      for (int c = 0; c < Q; ++c) qp[c] = ei::ploadu<Packet<T>>(qt + j * G + i0 + c * P);
      KVATTN_UNROLL
      for (int b = 0; b < B; ++b) {
        const Packet<T> kv = ei::pset1<Packet<T>>(static_cast<T>(k[b][j]));
        KVATTN_UNROLL
        for (int c = 0; c < Q; ++c) acc[b][c] = ei::pmadd(qp[c], kv, acc[b][c]);
      }
    }
    KVATTN_UNROLL
    for (int b = 0; b < B; ++b) {
      KVATTN_UNROLL
      for (int c = 0; c < Q; ++c) {
        T* out = logits + (t0 + b) * w_stride + i0 + c * P;
        const Packet<T> value = add ? ei::padd(ei::ploadu<Packet<T>>(out), acc[b][c]) : acc[b][c];
        ei::pstoreu(out, value);
      }
    }
  };
  auto run_rows = [&]<int Q, int B>(Index i0) {
    Index t0 = 0;
    for (; t0 + B <= n; t0 += B) block.template operator()<Q, B>(i0, t0);
    for (; t0 < n; ++t0) block.template operator()<Q, 1>(i0, t0);
  };
  Index i0 = 0;
  if constexpr (many_registers) {
    for (; i0 + 4 * P <= G; i0 += 4 * P) run_rows.template operator()<4, 4>(i0);
  } else {
    for (; i0 + 4 * P <= G; i0 += 4 * P) run_rows.template operator()<4, 2>(i0);
  }
  for (; i0 + 2 * P <= G; i0 += 2 * P) run_rows.template operator()<2, 4>(i0);
  for (; i0 + P <= G; i0 += P) run_rows.template operator()<1, 8>(i0);
}

/// acc_i += sum_t w[t * w_stride + i] v_t for G <= 4 query rows, visiting the value
/// rows in order, two at a time (streaming order; acc stays in L1). Each loaded value
/// packet serves every query row, and the weights of the two tokens stay in registers.
template <class T, class S>
void accumulate_streaming(const T* w, Index w_stride, Index G, const S* rows, Index row_stride,
                          Index dv, Index n, T* acc, Index acc_stride) {
  constexpr Index P = packet_size<T>;
  const Index full = dv / P * P;
  auto run = [&]<int M>() {
    Index t = 0;
    for (; t + 2 <= n; t += 2) {
      const S* v0 = rows + t * row_stride;
      const S* v1 = v0 + row_stride;
      Packet<T> w0[M], w1[M];
      KVATTN_UNROLL
      for (int m = 0; m < M; ++m) {
        w0[m] = ei::pset1<Packet<T>>(w[t * w_stride + m]);
        w1[m] = ei::pset1<Packet<T>>(w[(t + 1) * w_stride + m]);
      }
      for (Index j = 0; j < full; j += P) {
        const Packet<T> a0 = load_widened<T>(v0 + j);
        const Packet<T> a1 = load_widened<T>(v1 + j);
        KVATTN_UNROLL
        for (int m = 0; m < M; ++m) {
          T* a = acc + m * acc_stride + j;
          ei::pstoreu(a, ei::pmadd(w1[m], a1, ei::pmadd(w0[m], a0, ei::ploadu<Packet<T>>(a))));
        }
      }
      for (Index j = full; j < dv; ++j) {
        for (int m = 0; m < M; ++m) {
          acc[m * acc_stride + j] += w[t * w_stride + m] * static_cast<T>(v0[j]) +
                                     w[(t + 1) * w_stride + m] * static_cast<T>(v1[j]);
        }
      }
    }
    for (; t < n; ++t) {
      const S* v = rows + t * row_stride;
      for (int m = 0; m < M; ++m) {
        const T weight = w[t * w_stride + m];
        const Packet<T> wp = ei::pset1<Packet<T>>(weight);
        T* a = acc + m * acc_stride;
        for (Index j = 0; j < full; j += P) {
          ei::pstoreu(a + j, ei::pmadd(wp, load_widened<T>(v + j), ei::ploadu<Packet<T>>(a + j)));
        }
        for (Index j = full; j < dv; ++j) a[j] += weight * static_cast<T>(v[j]);
      }
    }
  };
  switch (G) {
    case 4:
      run.template operator()<4>();
      break;
    case 3:
      run.template operator()<3>();
      break;
    case 2:
      run.template operator()<2>();
      break;
    default:
      run.template operator()<1>();
      break;
  }
}

/// acc_i (+)= sum_t w[t * w_stride + i] v_t for i < G, v_t = rows + t * row_stride
/// (dv wide); acc row i at acc + i * acc_stride.
template <class T, class S>
void accumulate(const T* w, Index w_stride, Index G, const S* rows, Index row_stride, Index dv,
                Index n, T* acc, Index acc_stride) {
  constexpr Index P = packet_size<T>;
  if (G <= 4) {  // memory-bound: stream the rows in order
    accumulate_streaming(w, w_stride, G, rows, row_stride, dv, n, acc, acc_stride);
    return;
  }
  auto block = [&]<int M, int D>(Index i0, Index d0) {
    Packet<T> a[M][D];
    KVATTN_UNROLL
    for (int m = 0; m < M; ++m) KVATTN_UNROLL
    for (int d = 0; d < D; ++d)
      a[m][d] = ei::ploadu<Packet<T>>(acc + (i0 + m) * acc_stride + d0 + d * P);
    for (Index t = 0; t < n; ++t) {
      Packet<T> v[D];
      KVATTN_UNROLL
      for (int d = 0; d < D; ++d) v[d] = load_widened<T>(rows + t * row_stride + d0 + d * P);
      KVATTN_UNROLL
      for (int m = 0; m < M; ++m) {
        const Packet<T> weight = ei::pset1<Packet<T>>(w[t * w_stride + i0 + m]);
        KVATTN_UNROLL
        for (int d = 0; d < D; ++d) a[m][d] = ei::pmadd(weight, v[d], a[m][d]);
      }
    }
    KVATTN_UNROLL
    for (int m = 0; m < M; ++m) KVATTN_UNROLL
    for (int d = 0; d < D; ++d) ei::pstoreu(acc + (i0 + m) * acc_stride + d0 + d * P, a[m][d]);
  };
  auto run_columns = [&]<int M>(Index i0) {
    Index d0 = 0;
    if constexpr (many_registers || M <= 2) {
      for (; d0 + 4 * P <= dv; d0 += 4 * P) block.template operator()<M, 4>(i0, d0);
    } else {
      for (; d0 + 2 * P <= dv; d0 += 2 * P) block.template operator()<M, 2>(i0, d0);
    }
    for (; d0 + P <= dv; d0 += P) block.template operator()<M, 1>(i0, d0);
    for (; d0 < dv; ++d0) {  // scalar tail columns
      for (Index m = 0; m < M; ++m) {
        T sum = acc[(i0 + m) * acc_stride + d0];
        for (Index t = 0; t < n; ++t) {
          sum += w[t * w_stride + i0 + m] * static_cast<T>(rows[t * row_stride + d0]);
        }
        acc[(i0 + m) * acc_stride + d0] = sum;
      }
    }
  };
  Index i0 = 0;
  for (; i0 + 4 <= G; i0 += 4) run_columns.template operator()<4>(i0);
  switch (G - i0) {
    case 3:
      run_columns.template operator()<3>(i0);
      break;
    case 2:
      run_columns.template operator()<2>(i0);
      break;
    case 1:
      run_columns.template operator()<1>(i0);
      break;
    default:
      break;
  }
}

/// Logits of G query rows against n cached rows, choosing the kernel by G: the
/// broadcast kernel needs qt (the transposed queries, dk x G) and G % packet == 0.
template <class T, class S>
void score(const T* q, const T* qt, Index G, Index dk, const S* rows, Index row_stride, Index n,
           T* logits, Index w_stride, bool add) {
  if (qt != nullptr && G % packet_size<T> == 0) {
    score_broadcast(qt, G, dk, rows, row_stride, n, logits, w_stride, add);
  } else {
    score_dot(q, dk, G, dk, rows, row_stride, n, logits, w_stride, add);
  }
}

}  // namespace kvattn::detail
