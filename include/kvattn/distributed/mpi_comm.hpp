// What kvattn's MPI layers share: a private communicator, the checked MPI calls, the
// collective agreement on input checks, and the reduction of partial softmax states.
//
// Every member function of ContextParallel and HeadParallel is collective: all ranks of
// the communicator call it, in the same order. A check that fails on one rank (a shape,
// a full cache, an allocation) must fail on all of them, or the others would wait in
// the next collective forever: `agree` runs each rank's checks, and when any rank's
// fail, every rank throws (that rank its own error, the others a shape_error naming
// it) before anything changed.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <exception>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "kvattn/core/errors.hpp"
#include "kvattn/core/softmax_states.hpp"
#include "kvattn/core/types.hpp"

namespace kvattn::mpi {

/// An MPI call returned an error code (only reachable when the communicator's error
/// handler returns errors; MPI's default, MPI_ERRORS_ARE_FATAL, aborts instead).
class mpi_error : public std::runtime_error, public kvattn::error {
 public:
  using std::runtime_error::runtime_error;
  const char* what() const noexcept override { return std::runtime_error::what(); }
};

namespace detail {

inline void check(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw mpi_error(std::string(call) +
                  " failed: " + std::string(text, static_cast<std::size_t>(length)));
}

template <class T>
MPI_Datatype scalar_type() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "kvattn::mpi computes in float or double");
  return std::is_same_v<T, float> ? MPI_FLOAT : MPI_DOUBLE;
}

/// A duplicate of the caller's communicator, so that kvattn's collectives never match
/// the caller's own messages; freed on destruction (before MPI_Finalize, then).
class Communicator {
 public:
  explicit Communicator(MPI_Comm comm) {
    if (comm == MPI_COMM_NULL) throw config_error("kvattn::mpi: the communicator is MPI_COMM_NULL");
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) throw config_error("kvattn::mpi: MPI_Init has not been called");
    check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  Communicator(Communicator&& other) noexcept
      : comm_(std::exchange(other.comm_, MPI_COMM_NULL)), rank_(other.rank_), size_(other.size_) {}
  Communicator& operator=(Communicator&&) = delete;
  ~Communicator() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
  }

  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

/// The kvattn error kinds a refused call is reported as on the ranks that did not fail.
enum class ErrorKind : int { none = 0, config, shape, value, length, other };

inline ErrorKind kind_of(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const config_error&) {
    return ErrorKind::config;
  } catch (const shape_error&) {
    return ErrorKind::shape;
  } catch (const value_error&) {
    return ErrorKind::value;
  } catch (const length_error&) {
    return ErrorKind::length;
  } catch (...) {
    return ErrorKind::other;
  }
}

[[noreturn]] inline void throw_as(ErrorKind kind, const std::string& message) {
  switch (kind) {
    case ErrorKind::config:
      throw config_error(message);
    case ErrorKind::value:
      throw value_error(message);
    case ErrorKind::length:
      throw length_error(message);
    default:
      throw shape_error(message);
  }
}

/// Runs `checks` on this rank, then agrees with every rank: if any rank's checks threw,
/// all ranks throw. A rank whose own checks threw rethrows its error; the others throw
/// an error of the same kvattn type (shape_error for anything else) naming the lowest
/// failing rank. Collective.
template <class Checks>
void agree(const Communicator& comm, const char* where, Checks&& checks) {
  std::exception_ptr failure;
  try {
    checks();
  } catch (...) {
    failure = std::current_exception();
  }
  // MINLOC over (rank, kind) pairs: the lowest failing rank and its error's kind (ranks
  // that did not fail send size(), which loses to every rank).
  const int mine[2] = {failure ? comm.rank() : comm.size(),
                       static_cast<int>(failure ? kind_of(failure) : ErrorKind::none)};
  int first[2] = {comm.size(), 0};
  check(MPI_Allreduce(mine, first, 1, MPI_2INT, MPI_MINLOC, comm.get()), "MPI_Allreduce");
  if (failure) std::rethrow_exception(failure);
  if (first[0] < comm.size()) {
    throw_as(static_cast<ErrorKind>(first[1]),
             std::string(where) + ": rank " + std::to_string(first[0]) +
                 " refused the call (its own exception says why); nothing was changed");
  }
}

/// shape_error on every rank unless every rank passes the same row count (an L x d
/// input whose L differs between ranks). Collective.
inline void agree_rows(const Communicator& comm, const char* where, Index rows) {
  const long long mine[2] = {static_cast<long long>(rows), -static_cast<long long>(rows)};
  long long extremes[2] = {0, 0};
  check(MPI_Allreduce(mine, extremes, 2, MPI_LONG_LONG, MPI_MIN, comm.get()), "MPI_Allreduce");
  if (extremes[0] != -extremes[1]) {
    throw shape_error(std::string(where) + ": x has " + std::to_string(rows) + " rows on rank " +
                      std::to_string(comm.rank()) +
                      ", and the ranks disagree (every rank passes the same L x d)");
  }
}

/// Runs op(offset, count) over [0, size) in pieces whose count fits MPI's int.
template <class Op>
void in_int_pieces(Index size, Op&& op) {
  constexpr Index kPiece = Index{1} << 30;
  for (Index offset = 0; offset < size; offset += kPiece)
    op(offset, static_cast<int>(std::min(kPiece, size - offset)));
}

/// Broadcasts rows x cols scalars of `m` from `root` (m already has that shape on every
/// rank). Collective.
template <class T>
void broadcast(RowMatrix<T>& m, int root, MPI_Comm comm) {
  in_int_pieces(m.size(), [&](Index offset, int count) {
    check(MPI_Bcast(m.data() + offset, count, scalar_type<T>(), root, comm), "MPI_Bcast");
  });
}

/// `sum` on rank `root` = the element-wise sum of every rank's `part` (same shapes on
/// every rank; `sum` significant on the root only). Collective.
template <class T>
void sum_to_root(const RowMatrix<T>& part, RowMatrix<T>& sum, int root, MPI_Comm comm) {
  in_int_pieces(part.size(), [&](Index offset, int count) {
    check(MPI_Reduce(part.data() + offset, sum.data() + offset, count, scalar_type<T>(), MPI_SUM,
                     root, comm),
          "MPI_Reduce");
  });
}

/// Rank 0's x into `tokens` on every rank (an MPI_Bcast), once every rank agreed that its
/// own x is rows x cols (rows < 0: any count, the same on every rank) and that `checks`
/// (the call's other checks and allocations) passed. Collective.
template <class T, class Checks>
void receive(const Communicator& comm, const char* where, const ConstMatrixRef<T>& x, Index rows,
             Index cols, RowMatrix<T>& tokens, Checks&& checks) {
  if (rows < 0) agree_rows(comm, where, x.rows());
  agree(comm, where, [&] {
    kvattn::detail::check_shape(where, "x", x, rows, cols);
    checks();
    tokens = x;
  });
  broadcast(tokens, 0, comm.get());
}

/// agree over `part`, this rank's share of a step that appends to `cache`: when any
/// rank's part fails, every rank throws, and a rank whose part went through truncates
/// `cache` back, so that no rank's cache moves ahead of the others'. Collective.
template <class Cache, class Part>
void agree_or_undo(const Communicator& comm, const char* where, Cache& cache, Part&& part) {
  const Index held = cache.sequence_length();
  try {
    agree(comm, where, part);
  } catch (...) {
    if (cache.sequence_length() != held) cache.truncate(held);
    throw;
  }
}

/// Partial softmax states packed for MPI: one record per state row,
/// [max, sum, acc (width)], and the reduction that merges two arrays of them record by
/// record (core/softmax_states.hpp's exact merge).
template <class T>
class StatesReduction {
 public:
  explicit StatesReduction(Index width) : width_(width) {
    check(MPI_Type_contiguous(static_cast<int>(width + 2), scalar_type<T>(), &record_),
          "MPI_Type_contiguous");
    check(MPI_Type_commit(&record_), "MPI_Type_commit");
    // Commutative: the merge gives the same state whichever part comes first (up to
    // rounding), so MPI may combine the ranks' parts in any tree.
    check(MPI_Op_create(&merge_records, 1, &op_), "MPI_Op_create");
  }
  StatesReduction(const StatesReduction&) = delete;
  StatesReduction& operator=(const StatesReduction&) = delete;
  StatesReduction(StatesReduction&& other) noexcept
      : width_(other.width_),
        record_(std::exchange(other.record_, MPI_DATATYPE_NULL)),
        op_(std::exchange(other.op_, MPI_OP_NULL)) {}
  StatesReduction& operator=(StatesReduction&&) = delete;
  ~StatesReduction() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    if (op_ != MPI_OP_NULL) MPI_Op_free(&op_);
    if (record_ != MPI_DATATYPE_NULL) MPI_Type_free(&record_);
  }

  Index width() const { return width_; }
  Index record_size() const { return width_ + 2; }

  /// Writes `states` (rows x width) as records at `records`.
  void pack(const SoftmaxStates<T>& states, T* records) const {
    for (Index i = 0; i < states.rows(); ++i) {
      T* record = records + i * record_size();
      record[0] = states.max(i);
      record[1] = states.sum(i);
      Eigen::Map<RowVector<T>>(record + 2, width_) = states.acc.row(i);
    }
  }

  /// `count` records at `records` (rows of states, in order) into `states`, resized.
  void unpack(const T* records, Index count, SoftmaxStates<T>& states) const {
    states.reset(count, width_);
    for (Index i = 0; i < count; ++i) {
      const T* record = records + i * record_size();
      states.max(i) = record[0];
      states.sum(i) = record[1];
      states.acc.row(i) = Eigen::Map<const RowVector<T>>(record + 2, width_);
    }
  }

  /// Merges every rank's `count` records into rank `root`'s `result` (count records; only
  /// significant on the root). Collective.
  void reduce(const T* records, T* result, Index count, int root, MPI_Comm comm) const {
    check(MPI_Reduce(records, result, static_cast<int>(count), record_, op_, root, comm),
          "MPI_Reduce");
  }

 private:
  // MPI_User_function: inout[i] = merge(in[i], inout[i]). The record width comes from
  // the datatype, since a user function gets no other context.
  static void merge_records(void* in, void* inout, int* count, MPI_Datatype* type) {
    int bytes = 0;
    MPI_Type_size(*type, &bytes);
    const Index size = bytes / static_cast<Index>(sizeof(T));
    const Index width = size - 2;
    const T* part = static_cast<const T*>(in);
    T* into = static_cast<T*>(inout);
    for (int i = 0; i < *count; ++i, part += size, into += size) {
      kvattn::detail::merge_state_row(part[0], part[1], part + 2, into[0], into[1], into + 2,
                                      width);
    }
  }

  Index width_ = 0;
  MPI_Datatype record_ = MPI_DATATYPE_NULL;
  MPI_Op op_ = MPI_OP_NULL;
};

}  // namespace detail
}  // namespace kvattn::mpi
