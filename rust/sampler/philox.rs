//! Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
//! SC 2011): a counter-based generator, so the random number of a draw is a pure
//! function of (key, counter) — here (the request's seed, its output position and
//! stream) — and never of what else is in the batch or of the order of steps.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

#[inline]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = u64::from(a) * u64::from(b);
    ((p >> 32) as u32, p as u32)
}

/// The 10-round Philox4x32 block for `counter` under `key`.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let (hi0, lo0) = mulhilo(M0, c[0]);
        let (hi1, lo1) = mulhilo(M1, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// The uniform in [0, 1) of draw `position` of stream `stream` under `seed`:
/// key = seed, counter = (position, stream) as little-endian 32-bit words; 53
/// bits of the block's first two words, so every value is an exact f64.
pub fn uniform(seed: u64, stream: u64, position: u64) -> f64 {
    uniform_round(seed, stream, position, 0)
}

/// Round `round` of one draw: round 0 is `uniform`, round 1 takes the same
/// block's last two words, and rounds 2k and 2k + 1 the block whose counter adds
/// `k << 48` to the position (output positions stay far below 2^48, so no two
/// draws share a block). A draw that rejects (top-p, min-p) takes its next
/// round; see `sampler::sample_full`.
pub fn uniform_round(seed: u64, stream: u64, position: u64, round: u32) -> f64 {
    let position = position.wrapping_add(u64::from(round / 2) << 48);
    let counter = [
        position as u32,
        (position >> 32) as u32,
        stream as u32,
        (stream >> 32) as u32,
    ];
    let x = philox4x32_10(counter, [seed as u32, (seed >> 32) as u32]);
    let (hi, lo) = if round.is_multiple_of(2) {
        (x[0], x[1])
    } else {
        (x[2], x[3])
    };
    let bits = (u64::from(hi) << 21) | (u64::from(lo) >> 11);
    bits as f64 * (1.0 / (1u64 << 53) as f64)
}
