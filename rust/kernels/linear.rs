//! `out = x · Wᵀ (+ bias)` for the few rows of a decode step: a matrix-vector
//! product that reads each weight row once, for all of the step's rows, straight
//! from the checkpoint's layout (`W` is `[n, k]`, as `nn.Linear` keeps it).
//!
//! Why our own: at one to a few rows a linear layer is bound by reading its
//! weights, and the library GEMMs are built for the compute-bound case; which of
//! them is fastest at which row count differs from CPU to CPU, so the runner
//! measures this kernel beside them (`asyncllm.worker.linear_select`).
//!
//! **One reduction order for every row count.** Each output element is the same
//! computation whatever `m`, the thread count or the row's place in the batch:
//! four vector accumulators over `k` in order, summed by a fixed tree, then the
//! tail, then the bias. So a row computed alone and in a batch agree bit for bit
//! (the batch-invariant mode relies on it; `tests_linear.rs` checks it).
//!
//! One source, compiled per instruction set: `columns` and `dot` are generic over
//! the vector operations of `simd` (a few lines of intrinsics per ISA) and inlined
//! into a `#[target_feature]` wrapper per ISA (portable, AVX2 + FMA, AVX-512); the
//! paths a machine cannot run are the same code as those it can.

use super::bf16::{isa_cap, IsaCap};
#[cfg(target_arch = "x86_64")]
use super::linear_dpbf16::columns_dpbf16;
pub(super) use super::linear_simd as simd;
use super::team;
use super::{bf16_to_f32, f32_to_bf16, KernelError};

/// A float the kernel reads or writes: f32, or bf16 as its bits (`u16`).
pub trait Elem: Copy + Send + Sync + 'static {
    /// Whether this is bf16 bits (vector loads widen it).
    const IS_BF16: bool;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// The elements as bf16 bits, when they are bf16.
    fn bits(s: &[Self]) -> Option<&[u16]>;
}

impl Elem for f32 {
    const IS_BF16: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn bits(_: &[f32]) -> Option<&[u16]> {
        None
    }
}

impl Elem for u16 {
    const IS_BF16: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16_to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> u16 {
        f32_to_bf16(x)
    }
    #[inline(always)]
    fn bits(s: &[u16]) -> Option<&[u16]> {
        Some(s)
    }
}

/// Rows of `x` (`m`), input features (`k`) and output features (`n`).
#[derive(Clone, Copy, Debug)]
pub struct LinearShape {
    pub m: usize,
    pub k: usize,
    pub n: usize,
}

/// Output features per work item: a multiple of the cache line's floats, small
/// enough that a step's few items per thread balance the team.
const ITEM_COLS: usize = 64;

/// The instruction sets the kernel is compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LinearIsa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// AVX-512 with AVX512-BF16: bf16 × bf16 products on `vdpbf16ps`
    /// (`linear_dpbf16`); f32 operands run the `Avx512` code.
    #[cfg(target_arch = "x86_64")]
    Avx512Bf16,
}

impl LinearIsa {
    /// The best variant this CPU runs within the cap of `ASYNCLLM_KERNEL_ISA`.
    pub(super) fn detect() -> Result<LinearIsa, KernelError> {
        let cap = isa_cap()?;
        #[cfg(target_arch = "x86_64")]
        if cap != IsaCap::Portable
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
        {
            if !matches!(cap, IsaCap::Avx2 | IsaCap::AvxVnni) && is_x86_feature_detected!("avx512f")
            {
                if cap == IsaCap::Auto && is_x86_feature_detected!("avx512bf16") {
                    return Ok(LinearIsa::Avx512Bf16);
                }
                return Ok(LinearIsa::Avx512);
            }
            return Ok(LinearIsa::Avx2);
        }
        let _ = cap;
        Ok(LinearIsa::Portable)
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            LinearIsa::Portable => "portable",
            #[cfg(target_arch = "x86_64")]
            LinearIsa::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            LinearIsa::Avx512 => "avx512",
            #[cfg(target_arch = "x86_64")]
            LinearIsa::Avx512Bf16 => "avx512bf16",
        }
    }

    /// Every variant this CPU can run (tests force each one).
    #[cfg(test)]
    pub(super) fn available() -> Vec<LinearIsa> {
        #[allow(unused_mut)]
        let mut isas = vec![LinearIsa::Portable];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            isas.push(LinearIsa::Avx2);
            if is_x86_feature_detected!("avx512f") {
                isas.push(LinearIsa::Avx512);
                if is_x86_feature_detected!("avx512bf16") {
                    isas.push(LinearIsa::Avx512Bf16);
                }
            }
        }
        isas
    }

    #[inline]
    fn columns<W: Elem>(self, job: &Job<'_, W>, cols: std::ops::Range<usize>, out: &mut [f32]) {
        match self {
            LinearIsa::Portable => columns::<simd::Portable, W>(job, cols, out),
            // SAFETY: `Avx2` is only constructed where the CPU has AVX2 and FMA
            // (`detect` and `available` check them).
            #[cfg(target_arch = "x86_64")]
            LinearIsa::Avx2 => unsafe { columns_avx2(job, cols, out) },
            // SAFETY: `Avx512` is only constructed where the CPU has AVX2, FMA
            // and AVX512F (`detect` and `available` check them).
            #[cfg(target_arch = "x86_64")]
            LinearIsa::Avx512 => unsafe { columns_avx512(job, cols, out) },
            #[cfg(target_arch = "x86_64")]
            LinearIsa::Avx512Bf16 => match (&job.xb, W::bits(job.w)) {
                // SAFETY: `Avx512Bf16` is only constructed where the CPU has
                // AVX512F and AVX512-BF16 (`detect` and `available` check them).
                (Some(xb), Some(w)) => unsafe {
                    let (m, k) = (job.shape.m, job.shape.k);
                    columns_dpbf16((m, k), xb.get(), w, job.bias, cols, out)
                },
                // SAFETY: as above; AVX512-BF16 implies AVX512F (and the CPUs
                // that have it have AVX2 and FMA: `detect` checks them first).
                _ => unsafe { columns_avx512(job, cols, out) },
            },
        }
    }
}

/// The variant `linear` runs here (for tests and benchmarks).
pub fn linear_isa() -> Result<&'static str, KernelError> {
    Ok(LinearIsa::detect()?.name())
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ + bias[n]` on `num_threads` threads, with the
/// best instruction set this CPU has. Every check runs before `out` is written.
pub fn linear<X: Elem, W: Elem, O: Elem>(
    shape: LinearShape,
    x: &[X],
    w: &[W],
    bias: Option<&[f32]>,
    num_threads: usize,
    out: &mut [O],
) -> Result<(), KernelError> {
    run(shape, x, w, bias, num_threads, out, LinearIsa::detect()?)
}

/// The validated operands: `x` widened to f32 once (it is small), `w` in place.
struct Job<'a, W> {
    shape: LinearShape,
    x: AlignedRows<f32>,
    /// `x` as bf16 bits, for the `vdpbf16ps` variant when x and w are bf16.
    xb: Option<AlignedRows<u16>>,
    w: &'a [W],
    bias: Option<&'a [f32]>,
}

/// `x` widened to f32 and starting on a 64-byte boundary: a vector load of it
/// then never straddles two cache lines (a split load costs two: measured 1.5x
/// faster at one row on a 1024 x 512 weight held in L2, f32 and bf16).
struct AlignedRows<T> {
    buf: Vec<T>,
    start: usize,
}

impl<T: Copy + Default> AlignedRows<T> {
    fn new(values: impl Iterator<Item = T>, len: usize) -> Self {
        let pad = 64 / std::mem::size_of::<T>();
        let mut buf: Vec<T> = Vec::with_capacity(len + pad);
        let start = buf.as_ptr().align_offset(64).min(pad);
        buf.resize(start, T::default());
        buf.extend(values);
        AlignedRows { buf, start }
    }

    fn get(&self) -> &[T] {
        &self.buf[self.start..]
    }
}

/// `linear` with the instruction set chosen by the caller (tests run each).
pub(super) fn run<X: Elem, W: Elem, O: Elem>(
    shape: LinearShape,
    x: &[X],
    w: &[W],
    bias: Option<&[f32]>,
    num_threads: usize,
    out: &mut [O],
    isa: LinearIsa,
) -> Result<(), KernelError> {
    let LinearShape { m, k, n } = shape;
    let bad = |what: String| Err(KernelError::Shape(what));
    if num_threads == 0 {
        return bad("num_threads must be at least 1".into());
    }
    if x.len() != m * k || w.len() != n * k || out.len() != m * n {
        return bad(format!(
            "linear: x has {} elements, w {}, out {}; [m={m}, k={k}] x [n={n}, k={k}] needs {}, {}, {}",
            x.len(),
            w.len(),
            out.len(),
            m * k,
            n * k,
            m * n
        ));
    }
    if bias.is_some_and(|b| b.len() != n) {
        return bad(format!("linear: bias must have n={n} elements"));
    }
    let job = Job {
        shape,
        x: AlignedRows::new(x.iter().map(|v| v.to_f32()), x.len()),
        xb: match (isa, X::bits(x), W::IS_BF16) {
            #[cfg(target_arch = "x86_64")]
            (LinearIsa::Avx512Bf16, Some(bits), true) => {
                Some(AlignedRows::new(bits.iter().copied(), bits.len()))
            }
            _ => None,
        },
        w,
        bias,
    };
    // Work items are column ranges of `out`, computed into an item's own
    // [m, cols] buffer and then stored: items never share an output element.
    let num_items = n.div_ceil(ITEM_COLS);
    let store = |cols: std::ops::Range<usize>, tile: &[f32], out: &OutPtr<O>| {
        let width = cols.len();
        for (i, row) in tile.chunks_exact(width).enumerate() {
            for (j, v) in row.iter().enumerate() {
                // SAFETY: `out` points at `m * n` elements (checked above) that
                // only this call writes; (i, cols.start + j) is in bounds and
                // belongs to this item's column range alone, so no two threads
                // write the same element.
                unsafe { out.0.add(i * n + cols.start + j).write(O::from_f32(*v)) };
            }
        }
    };
    let out_ptr = OutPtr(out.as_mut_ptr());
    let item = |idx: usize, tile: &mut Vec<f32>| {
        let cols = idx * ITEM_COLS..((idx + 1) * ITEM_COLS).min(n);
        tile.clear();
        tile.resize(m * cols.len(), 0.0);
        isa.columns(&job, cols.clone(), tile);
        store(cols, tile, &out_ptr);
    };
    team::run_items(num_items, num_threads, &item)
}

/// The output's base pointer, shared by the work items (see `store`).
struct OutPtr<O>(*mut O);
// SAFETY: the items behind this pointer write disjoint elements (see `store`),
// and the pointer outlives them: `run` returns only after every item is done.
unsafe impl<O: Send> Sync for OutPtr<O> {}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn columns_avx2<W: Elem>(job: &Job<'_, W>, cols: std::ops::Range<usize>, out: &mut [f32]) {
    columns::<simd::Avx2, W>(job, cols, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f")]
fn columns_avx512<W: Elem>(job: &Job<'_, W>, cols: std::ops::Range<usize>, out: &mut [f32]) {
    columns::<simd::Avx512, W>(job, cols, out)
}

/// The item's tile `out[m, cols]`: weight row by weight row, each read from
/// memory once for all of `x`'s rows (it stays in L1 while they use it).
#[inline(always)]
fn columns<S: simd::Simd, W: Elem>(
    job: &Job<'_, W>,
    cols: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let LinearShape { m, k, .. } = job.shape;
    let width = cols.len();
    let bias = |j: usize| job.bias.map_or(0.0, |b| b[j]);
    let groups = m / 4 * 4;
    for (c, j) in cols.clone().enumerate() {
        let w = &job.w[j * k..(j + 1) * k];
        for i in (0..groups).step_by(4) {
            let [sums] = dot::<S, W, 4, 1>(&job.x.get()[i * k..(i + 4) * k], [w]);
            for (r, s) in sums.iter().enumerate() {
                out[(i + r) * width + c] = s + bias(j);
            }
        }
    }
    // The rows left over (all of them at one row): two weight rows at a time, so
    // twice the independent chains hide the FMA and reduction latency (each
    // output still in the one order).
    for i in groups..m {
        let x = &job.x.get()[i * k..(i + 1) * k];
        let mut c = 0;
        while c + 2 <= width {
            let j = cols.start + c;
            let pair = [&job.w[j * k..(j + 1) * k], &job.w[(j + 1) * k..(j + 2) * k]];
            let [[a], [b]] = dot::<S, W, 1, 2>(x, pair);
            out[i * width + c] = a + bias(j);
            out[i * width + c + 1] = b + bias(j + 1);
            c += 2;
        }
        if c < width {
            let j = cols.start + c;
            out[i * width + c] = dot::<S, W, 1, 1>(x, [&job.w[j * k..(j + 1) * k]])[0][0] + bias(j);
        }
    }
}

/// `x_r · w_c` for the `R` rows of `x` (each `k` long) and the `C` weight rows
/// `ws` (each `k` long), each in the one order described at the top: four vector
/// accumulators over blocks of `4 * S::LANES`, then one over the remaining whole
/// vectors, summed as ((a0 + a1) + (a2 + a3)) + a4 and across lanes by a fixed
/// tree, then the scalar tail in order. Rows share each weight load; no output's
/// operations depend on `R` or `C`, so a row gives the same bits in any group.
#[inline(always)]
fn dot<S: simd::Simd, W: Elem, const R: usize, const C: usize>(
    x: &[f32],
    ws: [&[W]; C],
) -> [[f32; R]; C] {
    let (k, l) = (ws[0].len(), S::LANES);
    assert!(x.len() >= R * k, "x holds R rows of k");
    assert!(ws.iter().all(|w| w.len() == k), "every weight row holds k");
    let xp = x.as_ptr();
    // SAFETY: every load below reads `S::LANES` elements at an offset `o` of a
    // row with `o + S::LANES <= k`, within each `w` (k long: asserted) and row
    // `r` of `x` (`r * k + o`, with x at least R * k long: asserted); the
    // intrinsics inside are those of the ISA the caller was compiled for
    // (`columns_avx2` / `columns_avx512` run only on CPUs that have it).
    unsafe {
        let mut acc = [[[S::zero(); 4]; R]; C];
        let mut o = 0;
        while o + 4 * l <= k {
            for a in 0..4 {
                let p = o + a * l;
                for (w, acc) in ws.iter().zip(acc.iter_mut()) {
                    let wv = S::load_w(w.as_ptr().add(p));
                    for (r, acc) in acc.iter_mut().enumerate() {
                        acc[a] = S::fma(S::load(xp.add(r * k + p)), wv, acc[a]);
                    }
                }
            }
            o += 4 * l;
        }
        let mut last = [[S::zero(); R]; C];
        while o + l <= k {
            for (w, last) in ws.iter().zip(last.iter_mut()) {
                let wv = S::load_w(w.as_ptr().add(o));
                for (r, last) in last.iter_mut().enumerate() {
                    *last = S::fma(S::load(xp.add(r * k + o)), wv, *last);
                }
            }
            o += l;
        }
        let mut sums = [[0.0f32; R]; C];
        for c in 0..C {
            for r in 0..R {
                let a = &acc[c][r];
                let v = S::add(S::add(S::add(a[0], a[1]), S::add(a[2], a[3])), last[c][r]);
                let mut s = S::sum(v);
                for t in o..k {
                    s = S::scalar_fma(x[r * k + t], ws[c][t].to_f32(), s);
                }
                sums[c][r] = s;
            }
        }
        sums
    }
}
