//! The activations of the GGUF integer kernel (`gguf_int`): each row of `x`
//! quantized to int8 per 16 elements, as llama.cpp quantizes its Q8 activations.

use super::gguf_int::QuantIsa;
use super::linear::Elem;
use super::KernelError;

/// `x`'s rows quantized to int8 as llama.cpp's Q8 activations, but with a scale
/// per 16 elements (half a block) instead of 32: it costs one multiply a block and
/// an outlier then coarsens 16 neighbours, not 32 (on SmolLM2 the held-out
/// perplexity moved 1.05 % from the float kernel's with scales per 32). Indexed by
/// `row * blocks + block`.
pub(super) struct Q8Rows {
    /// 32-blocks per row.
    pub(super) blocks: usize,
    pub(super) qs: Vec<i8>,
    /// Each block's scales `dx`, by half.
    pub(super) dx: Vec<[f32; 2]>,
    /// Each block's `Σ x_q` by half (for signed weights on `vpdpbusd`).
    pub(super) xs: Vec<[i32; 2]>,
    /// Each block's `dx · Σ x_q` over its first half, its second half and whole
    /// (for weights with a float offset or a bias).
    pub(super) sx: Vec<[f32; 3]>,
    pub(super) rows: usize,
}

/// One run of rows' share of each of `Q8Rows`' arrays.
type RowsMut<'a, E> = (
    &'a [E],
    (
        &'a mut [i8],
        (&'a mut [[f32; 2]], (&'a mut [[i32; 2]], &'a mut [[f32; 3]])),
    ),
);

impl Q8Rows {
    /// `x` (rows of `k`, a multiple of 32) quantized, compiled for `isa`'s
    /// instructions (the same IEEE operations, the same bits, but rounding in
    /// vectors rather than a `roundf` call per element: at 16 rows a tenth of a
    /// SmolLM2 step went there). Rows are shared out over `num_threads` threads of
    /// the kernel team where there are several: at a 9-row verification it was a
    /// twentieth of the step, run on the calling thread while the others waited.
    pub(super) fn quantize<E: Elem>(
        isa: QuantIsa,
        k: usize,
        x: &[E],
        num_threads: usize,
    ) -> Result<Q8Rows, KernelError> {
        let n = x.len() / 32;
        let mut rows = Q8Rows {
            blocks: k / 32,
            qs: vec![0; x.len()],
            dx: vec![[0.0; 2]; n],
            xs: vec![[0; 2]; n],
            sx: vec![[0.0; 3]; n],
            rows: x.len() / k.max(1),
        };
        let per = (k / 32).max(1) * ROWS_PER_ITEM;
        let items = x.chunks(32 * per).zip(
            rows.qs.chunks_mut(32 * per).zip(
                rows.dx
                    .chunks_mut(per)
                    .zip(rows.xs.chunks_mut(per).zip(rows.sx.chunks_mut(per))),
            ),
        );
        let threads = if rows.rows > 1 { num_threads } else { 1 };
        super::elementwise::on_rows(items, threads, &|item| fill_on(isa, item))?;
        Ok(rows)
    }
}

/// Rows quantized per work item.
const ROWS_PER_ITEM: usize = 1;

/// `fill` on `isa`'s copy. The arrays go as separate arguments: inside a tuple
/// they lose the no-alias promise of `&mut`, and the halves' rounding then stays
/// scalar (3x the time of the vector form, measured).
fn fill_on<E: Elem>(isa: QuantIsa, (x, (qs, (dx, (xs, sx)))): RowsMut<'_, E>) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: every path but `Portable` is only constructed where the CPU
        // has AVX2, FMA and F16C (`available`).
        QuantIsa::Avx2 | QuantIsa::AvxVnni => unsafe { fill_avx2(x, qs, dx, xs, sx) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx512Vnni` is only constructed where the CPU has AVX2, FMA,
        // F16C, AVX512F and AVX512VL (`available`).
        QuantIsa::Avx512Vnni => unsafe { fill_avx512(x, qs, dx, xs, sx) },
        _ => fill(x, qs, dx, xs, sx),
    }
}

/// Quantizes one run of blocks into their shares of the arrays.
#[inline(always)]
fn fill<E: Elem>(
    x: &[E],
    qs: &mut [i8],
    dx: &mut [[f32; 2]],
    xs: &mut [[i32; 2]],
    sx: &mut [[f32; 3]],
) {
    for (b, xb) in x.chunks_exact(32).enumerate() {
        let mut d = [0.0f32; 2];
        let mut sum = [0i32; 2];
        for h in 0..2 {
            // widened here (bf16 rows: a shift), so callers pass their rows as they are
            let xh: [f32; 16] = std::array::from_fn(|i| xb[16 * h + i].to_f32());
            let qh: &mut [i8; 16] = (&mut qs[32 * b + 16 * h..32 * b + 16 * h + 16])
                .try_into()
                .unwrap();
            (d[h], sum[h]) = quantize_half(&xh, qh);
        }
        dx[b] = d;
        xs[b] = sum;
        let s = [d[0] * sum[0] as f32, d[1] * sum[1] as f32];
        sx[b] = [s[0], s[1], s[0] + s[1]];
    }
}

/// One 16-element half of an activation block: its scale `max|x| / 127` and
/// `Σ x_q`, with `x_q = round(x / scale)` (ties to even: one vector instruction)
/// into `q`. Fixed-size arrays and no branches per element, so it compiles to
/// a few vector instructions on each ISA.
#[inline(always)]
fn quantize_half(x: &[f32; 16], q: &mut [i8; 16]) -> (f32, i32) {
    // max |x| as the largest magnitude's bits (an integer max, which
    // vectorizes); above infinity's bits it is a NaN
    let top = x.iter().fold(0u32, |a, v| a.max(v.to_bits() & 0x7fff_ffff));
    // a NaN anywhere makes the scale NaN, so it reaches the output
    let d = if top > f32::INFINITY.to_bits() {
        f32::NAN
    } else {
        f32::from_bits(top) / 127.0
    };
    // an all-zero, infinite or NaN half, or a scale whose inverse overflows,
    // quantizes to zeros and NaNs (0 · inf) that become 0
    let id = if d > 0.0 && d.is_finite() {
        1.0 / d
    } else {
        0.0
    };
    let id = if id.is_finite() { id } else { 0.0 };
    let mut sum = 0;
    for (q, v) in q.iter_mut().zip(x) {
        let r = (v * id).round_ties_even().clamp(-127.0, 127.0);
        let r = if r.is_nan() { 0.0 } else { r };
        // SAFETY: `r` is finite and within [-127, 127] (clamped, NaN replaced)
        let r = unsafe { r.to_int_unchecked::<i32>() };
        *q = r as i8;
        sum += r;
    }
    (d, sum)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn fill_avx2<E: Elem>(
    x: &[E],
    qs: &mut [i8],
    dx: &mut [[f32; 2]],
    xs: &mut [[i32; 2]],
    sx: &mut [[f32; 3]],
) {
    fill(x, qs, dx, xs, sx)
}

/// 16 floats a vector: a half block is one register.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
fn fill_avx512<E: Elem>(
    x: &[E],
    qs: &mut [i8],
    dx: &mut [[f32; 2]],
    xs: &mut [[i32; 2]],
    sx: &mut [[f32; 3]],
) {
    fill(x, qs, dx, xs, sx)
}
