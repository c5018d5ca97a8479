// FlashAttention for the CPU: header-only, fp32 accumulation, O(S*D) extra memory.
//
// Layout and masking follow flashgen/attention.h (BSHD, GQA/MQA, causal with a
// top-left or bottom-right offset; a row that sees no key gives o = 0,
// lse = -inf and no gradient).
//
// Forward, per work item (batch, q head, block of BQ query rows):
//   Qt = the q block transposed (loaded once per item; 16x16 register
//   transposes where AVX-512 is available);
//   for each visible key block of BK keys:
//     St = K_blk * Qt            [BK][BQ] fp32, lanes run over query rows,
//     online softmax over the key axis (row max / row sum are lane-wise, no
//     horizontal reductions), exponentials in base 2 with the scale folded in
//     (in unmasked blocks the scale and the max are the GEMM's epilogue; once
//     a row block's max is set, P = 2^(S - m) too while no score exceeds m by
//     more than kExpSlack, in blocks crossing the causal diagonal as well, masked
//     scores -inf: no separate pass, no rescale; the first unmasked block takes
//     m from its first rows; else the block is redone),
//     O = diag(alpha) O + P V    (P read transposed from St; the alpha scaling
//     only where a row's max moved).
//   Work items run one (batch, head)'s q blocks in a row. With fp32 products
//   the dense forward packs K and V to contiguous fp32 once per call when a key
//   block is read more than once (several q blocks or a GQA group), instead of
//   gathering each block per q block; the backward packs q and dout the same
//   way (with its row terms) when there is more than one key block.
//   Key blocks that are fully masked (causal) are skipped; in blocks that cross
//   the diagonal the products skip the masked micro-tiles (a key-row group
//   starts at its first visible query vector, a query-row group stops at its
//   last visible key) and the remaining elements get a per-element mask.
//   Sliding window: only key blocks inside the window band are visited; blocks
//   crossing a window edge get full products and a per-element band mask.
//   Softcap: St = c * tanh(St * scale / c) (vectorized tanh) before masking;
//   the backward multiplies dS by 1 - tanh^2.
// Backward (FlashAttention-2), per work item (batch, kv head, key chunk):
//   for each key block of the chunk (Kt, Vt transposed once per block):
//     for each q head of the group and each q block that sees the key block:
//       S = Q Kt, P = exp2(S*scale*log2e - lse*log2e), dP = dO Vt,
//       dS = scale * P o (dP - Drow), dV += P^T dO, dK += dS^T Q, dQ += dS K.
//   dQ accumulates in fp32: in dq itself (T = float and one chunk per kv head)
//   or in a [chunks][B][Sq][Hq][D] buffer reduced at the end; every accumulator
//   region belongs to exactly one work item and is summed in a fixed order, so
//   there are no races and every gradient is the same on every run.
//
//
// Variants (README "Variants"; attention.h ScoreExtras / VarlenArgs / PagedArgs):
//   Score extras (dense targets): ALiBi, an additive bias (f32 or the q type,
//   broadcast over batch / heads / queries by strides), a boolean mask and segment ids.
//   Forward: per key block an extras tile Xt [BK][BQ] (bias transposed, minus
//   slope * |i + off - j|, times log2(e); -inf where mask / segments hide the
//   pair) is added to the base-2 scores after scale, softcap and the band mask.
//   Backward: the same terms per query row, along the key lanes; dS' = P o (dP -
//   Drow) is dbias's share, dS = dS' * scale (* (1 - tanh^2) with softcap).
//   dbias accumulates in fp32 (dbias itself when f32; a bias broadcast over
//   the queries sums them into its one row, in row order), each element in one
//   work item and in a fixed order (bit-reproducible, no locks): an item
//   (batch, kv head, key chunk) that owns its slots writes them directly; when
//   slots are shared (bias broadcast over the batch or over kv-head groups),
//   the items are (group of pairs sharing slots, key chunk), running the
//   group's (batch, kv head) pairs in order for each key block. Key blocks whose
//   segment-id range is disjoint from the q block's are skipped; everything
//   else is masked per element. Without extras the code path is the one above.
//   Packed varlen: every work item is a (sequence, head, q block) forward or
//   (sequence, kv head, key chunk) backward of a dense problem with its own
//   base pointers and lengths (lse [Hq][Tq]); rows outside every sequence get
//   o = 0, lse = -inf and zero gradients.
//   Paged KV (forward): key rows come through a row accessor (block table) into
//   the same contiguous block buffers; batch entry b has seqused_k[b] keys.
//   Varlen and paged take ALiBi only (the slopes of ScoreExtras; per sequence /
//   batch entry b, with that problem's own Sq, Sk for the offset); it goes
//   through the same extras path as the dense targets (a constant in the
//   backward: no slope gradient).
//   Split-KV (dense and paged forward): when there are fewer row blocks than
//   useful threads, each row block's keys are split into ranges processed by
//   different items, each writing fp32 partial (o, lse); a log-sum-exp merge
//   combines them (partials with lse = -inf contribute nothing).
//
// Matrix products go through one register-blocked micro-kernel written with
// GCC/Clang vector extensions (AVX-512, AVX2/FMA, or SSE2 depending on the
// target flags), so the header compiles with and without -march=native.
// bf16 with AVX512_BF16 (compiled for a host that has it, e.g. -march=native on
// Zen 4/5 or Sapphire Rapids): every product runs on vdpbf16ps (pairs of bf16,
// fp32 accumulation). Q K^T and dO V^T take bf16 inputs only and are exact up
// to fp32 accumulation; P (forward and backward) and dS are rounded to bf16
// before the products that take them (P V, P^T dO, dS^T Q, dS K), as GPU
// FlashAttention does: each such product is off by at most 2^-9 of the sum of
// the absolute values of its terms. Softmax statistics, lse and every
// accumulator stay fp32. f32 and f16, and bf16 on other hosts, compute in fp32
// (FLASHGEN_CPU_NO_BF16_DOT forces that for bf16 too).
//
// Threads: parallel_for hands items to helper workers that run on a Workers
// pool (XLA's intra-op pool through the FFI, or a persistent pool of this
// header's own) while the calling thread works too; per-thread workspaces are
// cached, so a small call allocates nothing big and starts no thread.
// Not supported: -ffast-math / -ffinite-math-only (masking relies on infinities).
//
// Files: parallel.h (threads), numerics.h (element types, lane math), tiles.h
// (GEMM micro-kernel, tile loads), problems.h (row sources, extras), fwd_tiles.h
// (the forward's products and their epilogues), forward.h,
// backward.h.
#pragma once

// Forward before backward: the order the compiler sees them in is the order of
// the single header they came from (its inlining choices depend on it).
#include "flashgen/cpu/forward.h"
#include "flashgen/cpu/backward.h"
