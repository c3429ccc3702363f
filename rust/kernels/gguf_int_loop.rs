//! The GGUF integer kernel's loops (`gguf_int`): a work item's panels of weight
//! rows, the groups of x rows that share each unpacked block, and the integer
//! dot products and float steps of one sub-block. Compiled inside each ISA's
//! wrapper of `gguf_int`, once per block type.

use super::gguf_int_blocks::{IntBlock, Panels, Rows, Source};
use super::gguf_panel::Panel;
use super::gguf_panels::PANEL;
use super::gguf_q8::Q8Rows;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};

/// Where a group of x rows' results go: `(first x row, first output feature of
/// the item, one `[f32; 16]` of lanes a row, lanes in use)`. One call a group,
/// not a row: each is a dynamic call, and converts the lanes to the output's type.
pub(super) type Store<'a> = &'a dyn Fn(usize, usize, &[[f32; 16]], usize);

/// One work item's weight rows: the item's bytes, the next item's first panel (read ahead),
/// and whether they are whole panels of the panel layout (`gguf_panels`).
#[derive(Clone, Copy)]
pub(super) struct Item<'a> {
    pub(super) w: &'a [u8],
    pub(super) after: &'a [u8],
    pub(super) panel: bool,
}

/// Every weight row of the item against every row of `xq`, a panel of
/// `P::LANES` weight rows at a time (in the GGUF layout, the last panel repeats
/// its last row into the lanes it lacks, whose results are dropped), x rows in
/// groups that share each unpacked block (a row's result does not depend on its
/// group): all of them up to `P::MAX_GROUP` rows (one unpack of each block for
/// a verification's k + 1 rows: 1.4-1.7x at 5 rows on Zen 5), groups of
/// `P::MAX_GROUP` (or 8) below 32 rows, else 32 or 64, whose
/// accumulators live in memory but which unpack each block once for all of them
/// (1.04-1.25x at 64 rows on Zen 5).
#[inline(always)]
pub(super) fn rows<P: Panel, B: IntBlock>(it: Item<'_>, xq: &Q8Rows, store: Store<'_>) {
    let rb = xq.blocks / B::SUBS * B::BYTES;
    let (w, n) = (it.w, it.w.len() / rb);
    for first_row in (0..n).step_by(P::LANES) {
        let lanes = P::LANES.min(n - first_row);
        // lane l holds weight row first_row + l (the last one repeated)
        let rows: [*const u8; 16] = std::array::from_fn(|l| {
            let j = first_row + l.min(lanes - 1);
            w[j * rb..(j + 1) * rb].as_ptr()
        });
        // the next panel's bytes (past this item's rows: the next item's, which
        // the same thread usually takes), read ahead while this one runs; only
        // the first group of x rows needs them, the others find them cached
        let ahead = (first_row + P::LANES).min(n) * rb..(first_row + 2 * P::LANES).min(n) * rb;
        let next = if ahead.is_empty() {
            it.after
        } else {
            &w[ahead]
        };
        if it.panel {
            assert!(n % PANEL == 0, "panels are whole");
            let panel = &w[first_row / PANEL * PANEL * rb..][..PANEL * rb];
            let src = Panels {
                base: panel.as_ptr(),
                lane: first_row % PANEL,
            };
            groups::<P, B, Panels>(src, panel, next, xq, lanes, first_row, store);
        } else {
            groups::<P, B, Rows>(Rows(&rows), &[], next, xq, lanes, first_row, store);
        }
    }
}

/// The `lanes` weight rows of `src` against every row of `xq`, in groups of x
/// rows (see `rows`), stored as output features `first_row..`.
#[inline(always)]
fn groups<P: Panel, B: IntBlock, S: Source<P>>(
    src: S,
    mut cur: &[u8],
    mut next: &[u8],
    xq: &Q8Rows,
    lanes: usize,
    first_row: usize,
    store: Store<'_>,
) {
    let mut r = 0;
    while r < xq.rows {
        let size = match xq.rows - r {
            64.. => 64,
            32.. => 32,
            16.. if P::MAX_GROUP == 16 => 16,
            // below MAX_GROUP, one group of them all: each unpacks the blocks
            // once (a verification of k = 8 drafts is 9 rows)
            few if few <= P::MAX_GROUP => few,
            _ => 8,
        };
        let mut out = [[0.0f32; 16]; 64];
        match size {
            64 => panel::<P, B, S, 64>(src, cur, next, xq, r, &mut out),
            32 => panel::<P, B, S, 32>(src, cur, next, xq, r, &mut out),
            16 => panel::<P, B, S, 16>(src, cur, next, xq, r, &mut out),
            15 => panel::<P, B, S, 15>(src, cur, next, xq, r, &mut out),
            14 => panel::<P, B, S, 14>(src, cur, next, xq, r, &mut out),
            13 => panel::<P, B, S, 13>(src, cur, next, xq, r, &mut out),
            12 => panel::<P, B, S, 12>(src, cur, next, xq, r, &mut out),
            11 => panel::<P, B, S, 11>(src, cur, next, xq, r, &mut out),
            10 => panel::<P, B, S, 10>(src, cur, next, xq, r, &mut out),
            9 => panel::<P, B, S, 9>(src, cur, next, xq, r, &mut out),
            8 => panel::<P, B, S, 8>(src, cur, next, xq, r, &mut out),
            7 => panel::<P, B, S, 7>(src, cur, next, xq, r, &mut out),
            6 => panel::<P, B, S, 6>(src, cur, next, xq, r, &mut out),
            5 => panel::<P, B, S, 5>(src, cur, next, xq, r, &mut out),
            4 => panel::<P, B, S, 4>(src, cur, next, xq, r, &mut out),
            3 => panel::<P, B, S, 3>(src, cur, next, xq, r, &mut out),
            2 => panel::<P, B, S, 2>(src, cur, next, xq, r, &mut out),
            _ => panel::<P, B, S, 1>(src, cur, next, xq, r, &mut out),
        }
        store(r, first_row, &out[..size], lanes);
        (cur, next) = (&[], &[]);
        r += size;
    }
}

/// The panel of weight rows `src` (one a lane, each `xq.blocks` elements)
/// dotted with rows `first..first + R` of `xq`, into `out[..R][..P::LANES]`.
///
/// The caller's `src` holds whole rows of blocks: `Rows` from `rows`' slices
/// of whole rows, `Panels` from a whole panel.
#[inline(always)]
fn panel<P: Panel, B: IntBlock, S: Source<P>, const R: usize>(
    src: S,
    cur: &[u8],
    next: &[u8],
    xq: &Q8Rows,
    first: usize,
    out: &mut [[f32; 16]; 64],
) {
    let nb = xq.blocks;
    assert!(
        (first + R) * nb <= xq.dx.len()
            && xq.qs.len() == 32 * xq.dx.len()
            && xq.xs.len() == xq.dx.len()
            && xq.sx.len() == xq.dx.len(),
        "rows first..first + R of xq"
    );
    // SAFETY: each block read lies in its row or panel (whole rows of `nb`
    // elements: the caller's); the activation block `at = (first + r) * nb + xb`
    // (r < R, xb < nb) lies in `xq` (asserted); the instructions of `P` are those
    // of the wrapper this is inlined into (see `QuantIsa::rows`).
    unsafe {
        let mut acc = [P::fzero(); R];
        let blocks = nb / B::SUBS;
        // the stream this panel's reads walk: its own lines (the GGUF layout's
        // rows are not one stream: as many as the next's), then the next's
        let lines = next.len().div_ceil(64);
        let own = if cur.is_empty() {
            lines
        } else {
            cur.len() / 64
        };
        // lines a sub-block in 16.16 fixed point, rounded up: no division a
        // sub-block (the shares' bounds are hints; the last may overshoot by a
        // line, which the bounds check below drops)
        let step = (own << 16).div_ceil(nb);
        let mut done = own;
        for bi in 0..blocks {
            // a share of the stream's lines one panel ahead: a panel's rows are
            // each too short a stream for the CPU's prefetcher to learn (Q8_0
            // rows of 576: ten lines), and demand misses had left a 49152 x 576
            // LM head at 8 GB/s. A share a block where several x rows make the
            // call compute-bound (a share a sub-block there cost 9 rows of Q8_0
            // 1.1-1.2x)...
            if R > 2 {
                for line in bi * lines / blocks..(bi + 1) * lines / blocks {
                    prefetch(next.as_ptr().add(64 * line));
                }
            }
            B::panel::<P, S>(src, bi, |s, wv, sc, off| {
                // ...and a share a sub-block at one or two, where the stream
                // binds: a K type's block had asked for 36-53 lines at once
                // (out of cache, one row, two threads, Zen 5: Q4_K 28 -> 41
                // GB/s, Q6_K 25 -> 34). Written with the branch on this panel's
                // own lines (which one panel ahead never takes): the branch-free
                // loop unrolls into bursts, Q8_0 1.2x slower. In cache (a
                // matrix in L2, one thread) one row is 1.1-1.3x slower than a
                // share a block; out of cache, where a model's weights are,
                // SmolLM2's batch-1 decode is 1.07x faster.
                let xb = bi * B::SUBS + s;
                let to = if R > 2 {
                    done
                } else {
                    own + (((xb + 1) * step) >> 16)
                };
                for line in done..to {
                    if line < own {
                        prefetch(cur.as_ptr().add(64 * line));
                    } else if line - own < lines {
                        prefetch(next.as_ptr().add(64 * (line - own)));
                    }
                }
                done = to;
                let wv = if B::SIGNED { signed::<P>(*wv) } else { *wv };
                for (r, acc) in acc.iter_mut().enumerate() {
                    *acc = sub_dot::<P, B>(*acc, &wv, sc, off, xq, (first + r) * nb + xb);
                }
            });
        }
        for (r, acc) in acc.into_iter().enumerate() {
            P::store(acc, &mut out[r]);
        }
    }
}

/// Asks for the cache line at `p` ahead of its use (a hint: never faults).
#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that reads nothing architecturally and never
    // faults, whatever the address; SSE is part of x86-64.
    unsafe {
        _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>())
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Signed weights as `P::dot_s` takes them.
#[inline(always)]
unsafe fn signed<P: Panel>(mut wv: [P::V; 8]) -> [P::V; 8] {
    for v in wv.iter_mut() {
        // SAFETY: the caller runs on `P`'s instructions.
        *v = unsafe { P::signed(*v) };
    }
    wv
}

/// `acc` plus one 32-element sub-block `wv` of the panel (scales and offsets by
/// half) dotted with activation block `at` of `xq`.
///
/// SAFETY (for the caller): `at` < `xq`'s blocks, and `P`'s instructions run.
#[inline(always)]
unsafe fn sub_dot<P: Panel, B: IntBlock>(
    acc: P::F,
    wv: &[P::V; 8],
    scale: [P::F; 2],
    offset: [P::F; 2],
    xq: &Q8Rows,
    at: usize,
) -> P::F {
    // SAFETY: `qs` holds 32 bytes per block and the other vectors one entry.
    unsafe {
        let x = xq.qs.as_ptr().add(32 * at).cast::<i32>();
        let (mut i0, mut i1) = (P::izero(), P::izero());
        for j in 0..4 {
            let (x0, x1) = (x.add(j).read_unaligned(), x.add(4 + j).read_unaligned());
            if B::SIGNED {
                i0 = P::dot_s(i0, wv[j], x0);
                i1 = P::dot_s(i1, wv[4 + j], x1);
            } else {
                i0 = P::dot(i0, wv[j], x0);
                i1 = P::dot(i1, wv[4 + j], x1);
            }
        }
        // the signed weights' bias of this ISA's dot product (Q8_0 on `vpdpbusd`)
        // leaves in integers, so every path has the same sums
        if B::SIGNED && P::SIGNED_BIAS != 0 {
            let xs = *xq.xs.get_unchecked(at);
            i0 = P::isub(i0, P::SIGNED_BIAS * xs[0]);
            i1 = P::isub(i1, P::SIGNED_BIAS * xs[1]);
        }
        let dx = *xq.dx.get_unchecked(at);
        let sx = *xq.sx.get_unchecked(at);
        let bias = P::splat(-(B::BIAS as f32));
        let mut acc = acc;
        if B::UNIFORM {
            // one scale for the block: both halves' sums meet it once
            let mut t = P::scaled_add(P::scaled(i0, dx[0]), i1, dx[1]);
            if B::BIAS != 0 {
                t = P::fma_s(bias, sx[2], t);
            }
            acc = P::fma(t, scale[0], acc);
            if B::OFFSET {
                acc = P::fma_s(offset[0], sx[2], acc);
            }
        } else {
            for (h, i) in [i0, i1].into_iter().enumerate() {
                let mut t = P::scaled(i, dx[h]);
                if B::BIAS != 0 {
                    t = P::fma_s(bias, sx[h], t);
                }
                acc = P::fma(t, scale[h], acc);
                if B::OFFSET {
                    acc = P::fma_s(offset[h], sx[h], acc);
                }
            }
        }
        acc
    }
}
