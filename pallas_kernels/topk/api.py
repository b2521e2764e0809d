"""Top-k positions of masked indexer scores, without sorting the row.

    topk_indices(scores f32[b, C], k) -> i32[b, K]

is lax.top_k's choice and order (value descending, ties by the lower position) with every -inf
(masked) position reported as -1 at the tail, and positions past C (K > C) -1 too:
models/dsa/indexer.py's select_topk on scores already masked. -0.0 and +0.0 tie (the reference maps
-0 to +0 first: lax.top_k ties them on the GPU, whose sort is CUB's radix sort, but ranks +0
first on the CPU). A NaN score ranks first and is reported as -1, as there.

The kernels never sort the C scores; default_method picks one of two by size (measured).
method="radix": a bucket select over
several programs per request, then an exact select inside the threshold bucket only:
  1. histogram (grid b x S, S slices of L scores): each valid score's digit, the top 8 bits of
     its fp16 order key (sign, 5 exponent bits, 2 mantissa bits: a monotone function of the
     score; SGLang's top-k buckets the same way), counted per slice in i32[b, S, 256] by a
     one-hot product on the tensor cores ([16, L] x [L, 16] -> 16 x 16 buckets);
  2. plan (grid b): the threshold digit D (the largest with >= K scores at or above it) from
     the row's histograms, and each slice's offsets (the sure scores and candidates of the
     slices before it); split (grid b x S): the scores above D are kept outright, in position
     order, and those at D (the candidates) compacted in position order to a scratch row, at
     the slice's offsets (row_plan=False: every split program plans from the whole histogram);
  3. resolve (grid b): among the candidates, the exact (K - kept)-th largest key T by bisection
     between the candidates' smallest and largest keys (a 2**21-wide range for one fp16
     bucket of 2 mantissa bits), then the candidates > T and the lowest-position ones == T
     appended to the kept row;
  4. the K kept pairs ordered by lax.sort on (~key, position): key descending, ties by the
     lower position; NaN and padding carry position -1 already.
  Step 1 can come with the scores: the indexer's scoring kernel with histogram=True counts each
  program's digits as it writes them (common.digit_counts, the same one-hot product), and
  topk_indices_pallas(scores, k, hist=..., slice_len=...) then starts at step 2.
method="bisect" (the 2026-12-01 kernel): one program per request row:
  1. each score becomes a signed-int key in float order (bits ^ (sign ? 0x7fffffff : 0));
     -inf and below (masked) become INVALID;
  2. the K-th largest key T by bisection on the key's integer range: each step counts the keys
     >= mid in one pass over the row (held in registers when it fits one chunk); it stops early
     once exactly K keys are >= mid;
  3. one pass keeps the keys > T and the lowest-position keys == T, K in all, and compacts them
     in position order to a scratch row (one cumsum gives each kept key its slot);
  4. the K kept (key, position) pairs are ordered by (key desc, position asc) with a bitonic
     network in registers (Triton's tl.sort, written with reshapes and 2-wide sums; Pallas has
     no sort), and the positions written, -1 for INVALID and NaN keys.
  order: step 4 by lax.sort of the K kept pairs ("xla", the default: on the H200 XLA's sort of
  b x 2048 pairs beat the bitonic network in Pallas), in a second kernel ("kernel", fewer
  warps than the select needs), or in the selecting kernel ("fused").

Shape letters: b requests, C scores per request, K selected, P = K rounded up to a power of 2,
S slices per request (radix), L scores per slice, N = 256 histogram buckets (digits).
"""

from __future__ import annotations

from pallas_kernels import common
from pallas_kernels.common import check_rank
from pallas_kernels.topk.pallas_triton import topk_indices_pallas
from pallas_kernels.topk.reference import topk_reference


def topk_indices(scores, k: int, *, implementation=None, **tuning):
    """Top-k positions of masked scores: f32[b, C] (-inf: not allowed) -> i32[b, K], lax.top_k's
    choice and order, -1 for -inf scores and past C; see the module docstring."""
    check_rank("scores", scores, 2, "[b, C]")
    if common.resolve_gpu_implementation(implementation, "the indexer") == "pallas":
        return topk_indices_pallas(scores, k, **tuning)
    return topk_reference(scores, k)
