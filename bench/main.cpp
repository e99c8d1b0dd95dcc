// kvattn_bench: the micro-benchmarks of every attention mechanism (issue 6).
//
// USAGE
//   kvattn_bench [Google Benchmark flags]     the full sizes (minutes; needs ~5 GB)
//   kvattn_bench --kvattn_smoke               every benchmark once at L = 64 (CI's
//                                             bench.smoke); the factored decode steps
//                                             are checked against the references and a
//                                             mismatch exits with 1
//   e.g. --benchmark_filter='^decode/mha/L:65536' --benchmark_out=r.json
//        --benchmark_out_format=json
//
// NAMES (Google Benchmark appends "/real_time", and "/iterations:1" in smoke mode;
// L = cached tokens, or prompt tokens for prefill; T = threads: 1 and "all
// cores", omp_get_max_threads(), 2 on the reference machine). Mechanisms: mha
// (mha_config(4096, 32, 128)), gqa (gqa_config(4096, 32, 128, 8)), mqa
// (mqa_config(4096, 32, 128)), mla (deepseek_v2_lite_config(): d 2048, 16 heads, d_c
// 512, d_R 64, d_nope 128, d_v 128, no query compression), mla_v2
// (deepseek_v2_config(): d 5120, 128 heads, d_c' 1536), lrkv (d 4096, 32 heads, d_h 128,
// rank 54, rope_mode shared, half-split RoPE, no key norm). GQA-family layers have no
// RoPE.
//   decode/<mech>/L:<L>/T:<T>           L in {1024, 4096, 16384, 65536}, all six mechs.
//       layer.attend(query, cache, heads, workspace, Threads{T}) over a cache of L
//       tokens filled with the raw append (each rotation slot has its workspace, made by
//       make_workspace(Threads{T}) before timing: no step allocates): the attention step of the
//       newest cached token, projected query in, per-head outputs (before W_O) out. MLA's
//       absorption through W_UK and W_UV and LRKV's through B^K and B^V are part of the step.
//   decode_naive/<mech>/L:<L>/T:<T>     the baseline: the attention step as a competent
//       Eigen user would write it over the same fp32 cache buffers (bench/naive.hpp), in
//       the faster of two forms, picked per run by timing one step of each (the label
//       says which): per_head (per query head a GEMV over its KV head's dense key block,
//       softmax, a transposed GEMV over the values; threads over heads) or per_group
//       (per KV group one GEMM of its query rows against the block, row softmax, one
//       GEMM with the values; threads over groups / blocks of query rows). MLA: the
//       absorbed math over the latent rows in both forms; LRKV: the shared key plus each
//       head's residual slice. Registered before decode/ (same L, T), which reads its
//       time for vs_naive. All six mechanisms, L as decode.
//   decode_bf16/<mech>/L:<L>/T:<T>      the same step as decode/ on a bf16 cache
//       (make_cache<Eigen::bfloat16>): mha at L 4096, 16384 and 65536, the others at
//       16384 and 65536.
//   decode_bf16dot/<gqa|mqa|mla|mla_v2|lrkv>/L:<L>/T:<T>  decode_bf16/'s step with the
//       layer's DecodeArithmetic::bf16_dot (the query, MLA's absorbed one, and the softmax
//       weights rounded to bf16 and multiplied by the CPU's bf16 dot-product instruction
//       where the build has AVX512-BF16, else the same code as decode_bf16/); L 16384 and
//       65536. Smoke mode checks it against the reference to the stated 2^-6
//       (docs/api.md), not 2e-3.
//   decode_int8/<mech>/L:65536/T:<T>    the same step on an int8 cache (kvattn::Int8<128>:
//       int8 codes, one fp32 scale per 128-element row; MLA's rope key in bf16); all six
//       mechanisms. bytes include the scales. Counters vs_bf16, vs_bf16_goal.
//   decode_fp8/<mech>/L:65536/T:<T>     the same on an fp8 e4m3 cache (kvattn::Fp8E4M3<128>;
//       for mla and mla_v2 DeepSeek's fp8 layout, 656 bytes per token at d_c 512, d_R 64).
//   layer_decode/<mech>/L:<L>/T:<T>     the whole layer step, layer.decode(x, cache,
//       out, workspace, Threads{T}) (projections, append, attention over L + 1 tokens, W_O), then
//       cache.truncate(L). L as decode.
//   decode_expanded/<mech>/L:<L>/T:1    kvattn::reference::decode_step on the same
//       cache: every head's K and V materialized (GQA: copied from its KV group; MLA:
//       re-projected C W_UK_h, C W_UV_h from the latent cache every step; LRKV: shared
//       rows plus R_h B_h^T), then dense attention. L in {1024, 4096} (mla_v2: 1024);
//       T = 1 only (the references are serial: kvattn builds EIGEN_DONT_PARALLELIZE).
//   decode_precached/mla/L:<L>/T:<T>    MLA without absorption: a cache of the
//       up-projected per-head keys [C W_UK_h | K_R] (192) and values C W_UV_h (128),
//       16 heads, 5120 floats per token (8.9x the latent row), decoded like MHA by a
//       kernel in bench_mla.cpp (per head a dot-product pass over K_h, a softmax and an
//       axpy pass over V_h, reading each element once; heads over threads). L as decode.
//   prefill/<mech>/L:<L>/T:<T>          layer.prefill(x, cache, Threads{T}) of L tokens
//       on a cleared cache, L in {512, 2048, 8192}; mha, gqa, mqa, mla, lrkv.
//   decode_paged/<mech>/L:65536/T:<T>   layer.attend over a paged cache (pages of 256
//       tokens, one pool) of L tokens; after each timed step, untimed, the same attend
//       over a contiguous cache holding the same rows. mha, gqa, mqa, mla, lrkv. Counter
//       vs_contiguous.
//   decode_batch/<mech>/B:<B>/T:<T>     layer.decode_batch(x, caches, out, workspace,
//       Threads{T}) over B contiguous caches of ragged lengths, spread evenly from 1,024
//       to 2 x 65,536 / B - 1,024 tokens (65,536 tokens in all; B = 1: one of 65,536),
//       each truncated back after the step; B in {1, 4, 16, 64}. After each timed step,
//       untimed, B layer.decode calls on the same caches. Counter vs_separate.
//   decode_shared/<mech>/B:16/T:<T>     16 paged sequences forked from one 8,192-token
//       prompt, each with 512 tokens of its own: decode_batch with
//       BatchOptions{.shared_prefix = 8192} (the prompt's pages read once for all 16).
//       Untimed after each step: decode_batch without the shared prefix, and 16 decode
//       calls. Counters vs_separate, vs_unshared, roofline_ratio.
//   (Smoke mode: pages of 16 tokens; decode_batch at B = 3 with 16 ... 64 tokens;
//   decode_shared with a 32-token prompt and 16 tokens each; each compared with the
//   separate decode calls, or decode_paged with the contiguous cache.)
//   decode_window/<mech>/W:4096/L:65536/T:<T>   layer.attend with config.window = 4,096
//       over a paged cache (pages of 256 tokens) that 65,536 tokens went through and
//       that holds the last 4,096 of them (docs/serving.md § Windows). Untimed after each
//       step: the global layer's attend over a contiguous cache of 4,096 tokens (what
//       decode/<mech>/L:4096 times). Counter vs_decode_W. (Smoke mode: W:16 of 64.)
//   kernel/<kernel>/<fp32|bf16>         one decode kernel alone over 4 hot tiles of 16
//       cached rows (L2-resident; bench_kernels.cpp): lrkv_score, lrkv_values_shared,
//       lrkv_values_residual (LRKV's shape above). Counters ns_per_token, fma_peak and
//       fma_frac only (below); no memory stream, so what they time is the arithmetic and
//       the loads. Smoke mode checks their output against plain loops.
//
// COUNTERS (every benchmark above but kernel/; "step" = one timed iteration)
//   bytes             bytes the step must read: the cache (cache_bytes) plus the
//                     weights it reads. decode*: GQA family the cache only; MLA the
//                     latent rows (d_c + d_R per token) + W_UK + W_UV; LRKV the key and
//                     value rows (2 (d_h + H r) per token) + B^K + B^V. layer_decode:
//                     the cache + every weight of the layer. prefill: x + every weight
//                     + the cache it writes (and reads back).
//   cache_bytes       the cache's bytes alone (cache.bytes(), storage type included).
//   bytes_per_second  bytes / time per step.
//   flops             arithmetic per step (2 per multiply-add; exponentials, norms and
//                     RoPE not counted):
//                       GQA decode         4 H L d_h
//                       MLA decode         2 H d_nope d_c + 2 H d_c d_v
//                                          + L H (2 (d_c + d_R) + 2 d_c)
//                       LRKV decode        L H (4 d_h + 4 r) + 4 H d_h r
//                       precached MLA      2 L H (d_nope + d_R + d_v)
//                       expanded           GQA as decode; MLA 2 L H d_c (d_nope + d_v)
//                                          + 2 L H (d_nope + d_R + d_v); LRKV L H (4 r d_h
//                                          + d_h + 2 (2 d_h) + 2 d_h) for shared
//                       layer_decode       2 x (weights of the projections and W_O) +
//                                          the decode formula at L + 1
//                       prefill            L x per-token projections + the attention
//                                          of L (L + 1) / 2 causal pairs
//                     (bench/mech_*.hpp derive each one next to its code).
//   bw_ref            bytes/s of a read-only vectorized pass over the same buffers (the
//                     same cache memory and weights), run after every step outside the
//                     timed region (PauseTiming), with T threads splitting the bytes;
//                     the sum of all passes' bytes over their time.
//   flop_ref          FLOP/s of a dense Eigen float GEMM (1024^3) with T threads (each
//                     its own row block): best-of-5 measured after the steps, and the
//                     reported value is the best seen so far in this run with T threads
//                     (a best-of-20 calibration runs before the first benchmark). The
//                     best, because on a shared machine a single GEMM is often
//                     preempted, and flop_ref is the attainable rate.
//   predicted_seconds decode/ and decode_bf16/ rows: the analysis module's prediction of
//                     the step, analysis::roofline_seconds(attend_cost(config, L,
//                     storage), {bw_ref, flop_ref}) (bytes and FLOPs from the config
//                     alone; flops above is attend_cost's too).
//   roofline_frac     max(bytes / bw_ref, flops / flop_ref) / time per step: the
//                     fraction of the attainable speed the step reaches (1 = at the
//                     bound). The label says which bound applies (bound:memory or
//                     bound:compute).
//   vs_naive          (fp32 decode/ rows) time per step of the naive step
//                     (decode_naive/<mech>'s, the faster form) / this row's time per
//                     step; > 1 = kvattn faster. The naive step is timed inside this
//                     row's loop, one after every timed step (paused), so both see the
//                     same memory bandwidth; both are mean steady_clock times.
//   block_bytes       (decode, decode_naive, decode_bf16) the largest block one query
//                     head's attention reads: one KV group's K and V (2 L d_h), MLA's
//                     latent rows (L (d_c + d_R)), LRKV's key and value rows. The
//                     naive per-head form re-reads it for every head of the group, so
//                     once it exceeds the last-level cache the factored step must win
//                     by the group size (the report's 1.5x target).
//   vs_bf16           (decode_int8, decode_fp8) decode_bf16/<mech>'s time per step at the
//                     same L and T, measured earlier in this run (its latest repetition),
//                     / this row's; > 1 = the quantized cache is faster.
//   vs_bf16_goal      0.85 x decode_bf16's roofline time / this row's roofline time (both
//                     max(bytes / bw_ref, flops / flop_ref) from their own runs): the
//                     speedup a quantized cache should reach (vs_bf16 >= vs_bf16_goal).
//   vs_contiguous     (decode_paged) the contiguous cache's time per step / the paged
//                     cache's; >= 0.95 is the goal (paging costs at most 5%).
//   vs_separate       (decode_batch, decode_shared) the time of one decode call per
//                     sequence (the same threads and caches) / the batch step's; > 1 =
//                     the batch is faster.
//   vs_unshared       (decode_shared) decode_batch without the shared prefix / with it.
//   vs_decode_W       (decode_window) global attend over a contiguous cache of W tokens /
//                     the windowed step over L tokens (>= 0.9: the cost follows the window).
//   roofline_ratio    (decode_shared) the separate calls' roofline time over the shared
//                     step's: max(bytes / bw_ref, flops / flop_ref) of each, the separate
//                     calls reading every sequence's cache and every weight B times: the
//                     most reading the prefix once can gain.
//   ns_per_token      (kernel/) the kernel's time per cached row it passes over.
//   fma_peak          (kernel/) FLOP/s of one thread's FMA units: 12 independent chains
//                     of packet FMAs, nothing loaded, best of 5 (flop_ref's GEMM reaches
//                     about 2/3 of it on the AVX-512 VM). A bound only in builds with
//                     FMA instructions (-mfma, -march=native); without them it is a
//                     latency-bound multiply and add, and fma_frac can exceed 1.
//   fma_frac          (kernel/) the kernel's FLOPs (2 per multiply-add: score 2 H (d_h + r),
//                     values 2 H d_h and 2 H r per row) per second / fma_peak: 1.0 = the
//                     FMA units' bound.
//   (serving rows: bytes = the caches' bytes, each shared page once, + the weights the
//   step reads, once; flops = the sum of the sequences' layer_decode formulas.)
//
// CONTEXT
//   simd_level        kvattn::simd_level(): the instruction set kvattn's kernels were
//                     compiled for ("avx512", "avx2+fma", "sse2", ...), in the JSON
//                     context; the report prints it.
//
// MEASUREMENT
//   * Real time (UseRealTime) for every benchmark, microseconds.
//   * Cache rotation: a step's data (cache + the weights it reads) smaller than 96 MiB
//     (3x the 32 MiB L3) is replicated N times so that N copies hold >= 96 MiB, and
//     step i uses copy i mod N (with a private copy of the layer when the step reads
//     weights), as the layers of a deep model would; the read pass after step i reads
//     copy (i + N/2) mod N, so neither finds its data in L3 (decode/: every read takes
//     the copy read longest ago, N prime to the reads per step, so each read visits
//     every copy; docs/bench-method.md). Not in smoke mode.
//   * Caches are filled by append with a pool of min(L, 1024) kvattn::random_normal
//     rows, repeated cyclically (never a quadratic prefill).
//   * Layers are built once per run (seed 1) and shared; caches are built inside each
//     benchmark and freed after it, so memory stays below ~5 GB (MHA at L = 65536:
//     2.1 GB per fp32 cache).
#include <benchmark/benchmark.h>

#include <string_view>

#include <Eigen/Core>

#include <kvattn/core/simd.hpp>

#include "bench_util.hpp"

int main(int argc, char** argv) {
  // Our own flag first, so that Google Benchmark never sees it.
  bool smoke = false;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--kvattn_smoke") {
      smoke = true;
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  argv[argc] = nullptr;

  kvb::set_smoke(smoke);
  // Eigen never starts threads of its own here: kvattn runs its own (and builds with
  // EIGEN_DONT_PARALLELIZE), and the references and limits say their thread counts.
  Eigen::setNbThreads(1);
  benchmark::Initialize(&argc, argv);
  // The vector instruction set kvattn's kernels were compiled for (core/simd.hpp): the
  // report names it, as numbers from different ISAs are not comparable.
  benchmark::AddCustomContext("simd_level", kvattn::simd_level());
  benchmark::AddCustomContext("bf16_dot", kvattn::bf16_dot_available() ? "yes" : "no");
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  kvb::register_gqa();
  kvb::register_mla();
  kvb::register_lrkv();
  kvb::register_prefill();
  kvb::register_serving();
  kvb::register_window();
  kvb::register_kernels();
  kvb::calibrate_gemm();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return kvb::any_failure() ? 1 : 0;
}
