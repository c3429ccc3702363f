//! Property test: no input makes the decoder panic. Random bytes rarely get
//! past the header, so most cases mutate valid frames (bit flips, byte
//! overwrites, insertions, deletions, truncations, splices of two frames).
//! Whatever still decodes must re-encode to a frame that decodes the same.

use super::*;

fn check(bytes: &[u8]) {
    // `decode` returning at all (Ok or Err) is the property; a panic fails the test.
    if let Ok(message) = decode(bytes) {
        let again = encode(&message).expect("a decoded message re-encodes");
        let back = decode(&again).expect("a re-encoded message decodes");
        assert_eq!(encode(&back).unwrap(), again);
    }
}

#[test]
fn random_bytes_never_panic() {
    let mut rng = Rng::new(0xf022);
    for _ in 0..50_000 {
        let n = rng.below(64) as usize;
        let mut bytes: Vec<u8> = (0..n).map(|_| rng.u32() as u8).collect();
        // Give most of them a valid header so the body parsers are exercised.
        if n >= 2 && !rng.chance(4) {
            bytes[0] = MessageType::ALL[rng.below(8) as usize] as u8;
            bytes[1] = WIRE_VERSION;
        }
        check(&bytes);
    }
}

fn mutate(rng: &mut Rng, bytes: &mut Vec<u8>, other: &[u8]) {
    for _ in 0..1 + rng.below(4) {
        let len = bytes.len().max(1) as u64;
        let at = rng.below(len) as usize;
        match rng.below(7) {
            0 if !bytes.is_empty() => bytes[at] ^= 1 << rng.below(8),
            1 if !bytes.is_empty() => bytes[at] = rng.u32() as u8,
            // Bytes that are msgpack markers or lengths are the interesting ones.
            2 if !bytes.is_empty() => {
                bytes[at] = [0x00, 0x7f, 0x80, 0x90, 0xc0, 0xc4, 0xc6, 0xdc, 0xdd, 0xff]
                    [rng.below(10) as usize]
            }
            3 => bytes.insert(at.min(bytes.len()), rng.u32() as u8),
            4 if !bytes.is_empty() => {
                bytes.remove(at);
            }
            5 => bytes.truncate(at),
            _ => {
                let from = rng.below(other.len() as u64 + 1) as usize;
                bytes.truncate(at);
                bytes.extend_from_slice(&other[from..]);
            }
        }
    }
}

#[test]
fn mutated_frames_never_panic() {
    let mut rng = Rng::new(0xbad_f4a3e);
    let frames: Vec<Vec<u8>> = (0..200)
        .map(|_| encode(&random_message(&mut rng)).unwrap())
        .collect();
    for i in 0..100_000 {
        let mut bytes = frames[i % frames.len()].clone();
        let other = &frames[rng.below(frames.len() as u64) as usize];
        mutate(&mut rng, &mut bytes, other);
        check(&bytes);
    }
}
