// kvattn over MPI: decode and prefill of one sequence across the ranks of a
// communicator (docs/distributed.md). Only code that includes this header needs MPI
// (link kvattn::mpi); the rest of kvattn never includes it.
//
//   kvattn::mpi::ContextParallel<Layer, S>   the cache cut into token ranges, one per
//                                            rank; partial softmax states merged exactly
//   kvattn::mpi::HeadParallel<Layer, S>      the heads split by kvcalc's --tp rules;
//                                            partial outputs summed
//
// Both are collective objects: every rank of the communicator constructs one and calls
// the same member functions in the same order. Inputs are significant on rank 0 (an
// MPI_Bcast's convention) and outputs are the same bits on every rank.
#pragma once

#include "kvattn/distributed/context_parallel.hpp"
#include "kvattn/distributed/head_parallel.hpp"
#include "kvattn/distributed/mpi_comm.hpp"
