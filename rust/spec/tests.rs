use super::backoff::MAX_COOLDOWN;
use super::ngram::{NgramError, NgramProposer};

fn propose(p: &mut NgramProposer, row: usize, new: &[u32], k: usize) -> Vec<u32> {
    let mut out = Vec::new();
    let n = p.step(row, new, 0, 0, k, &mut out).unwrap();
    assert_eq!(n, out.len());
    out
}

#[test]
fn proposes_the_continuation_of_the_latest_match() {
    let mut p = NgramProposer::new(2, 2, 3).unwrap();
    // "1 2 3 4 5 ... 1 2 3 9 ... 1 2" -> the latest "1 2" is followed by 3 9
    p.add(0, &[1, 2, 3, 4, 5, 6, 1, 2, 3, 9, 7]).unwrap();
    assert_eq!(propose(&mut p, 0, &[1, 2], 3), vec![3, 9, 7]);
    // longer n wins: "9 7 1 2" ... now append 3 -> suffix "1 2 3" matched at 6..9
    assert_eq!(propose(&mut p, 0, &[3], 4), vec![9, 7, 1, 2]);
}

#[test]
fn no_match_no_proposal_and_a_repeating_tail_goes_on_repeating() {
    let mut p = NgramProposer::new(1, 2, 4).unwrap();
    p.add(0, &[1, 2, 3, 4]).unwrap();
    assert!(propose(&mut p, 0, &[], 5).is_empty());
    // "3 4" seen once, at 2..4, followed by the new "3 4" only: the text
    // repeats with period 2, so the drafts repeat it past the end
    assert_eq!(propose(&mut p, 0, &[3, 4], 5), vec![3, 4, 3, 4, 3]);
    assert!(propose(&mut p, 0, &[], 0).is_empty());
    // period 3: the longest match of the tail "8 9 7 8" is at 2..6, three
    // before the end: its continuation is "9 7 8" from the context, then the
    // drafts' own "9 7 8 9"
    let mut p = NgramProposer::new(1, 2, 4).unwrap();
    p.add(0, &[6, 7, 8, 9, 7, 8, 9, 7, 8]).unwrap();
    assert_eq!(propose(&mut p, 0, &[], 7), vec![9, 7, 8, 9, 7, 8, 9]);
}

#[test]
fn incremental_index_equals_indexing_at_once() {
    let seq: Vec<u32> = (0..400).map(|i| (i * 7 + i / 13) % 23).collect();
    let mut a = NgramProposer::new(1, 1, 5).unwrap();
    a.add(0, &seq[..10]).unwrap();
    for i in 10..seq.len() {
        let got = propose(&mut a, 0, &seq[i..i + 1], 6);
        let mut b = NgramProposer::new(1, 1, 5).unwrap();
        b.add(0, &seq[..=i]).unwrap();
        assert_eq!(got, propose(&mut b, 0, &[], 6), "at {i}");
    }
}

#[test]
fn rejected_drafts_back_off_and_accepted_reset() {
    let mut p = NgramProposer::new(1, 1, 1).unwrap();
    p.add(0, &[1, 2, 3, 4, 1]).unwrap();
    let mut out = Vec::new();
    let mut step = |drafted, accepted| p.step(0, &[], drafted, accepted, 3, &mut out).unwrap();
    // a proposal rejected outright: the row waits 1 step, then 2, then 4 ...
    assert_eq!(step(3, 0), 0);
    assert_eq!(step(0, 0), 3);
    assert_eq!(step(3, 0), 0);
    assert_eq!(step(0, 0), 0);
    assert_eq!(step(0, 0), 3);
    // any draft token accepted: the cooldown starts again from 1
    assert_eq!(step(3, 1), 3);
    assert_eq!(step(3, 0), 0);
    assert_eq!(step(0, 0), 3);
    for _ in 0..20 {
        step(3, 0);
    }
    let mut waited = 0;
    while step(0, 0) == 0 {
        waited += 1;
    }
    assert!(waited <= MAX_COOLDOWN as usize);
}

#[test]
fn errors_name_the_problem() {
    assert_eq!(
        NgramProposer::new(1, 3, 2).err(),
        Some(NgramError::BadRange { min: 3, max: 2 })
    );
    let mut p = NgramProposer::new(1, 1, 2).unwrap();
    assert_eq!(
        p.add(1, &[1]).err(),
        Some(NgramError::BadRow {
            row: 1,
            num_rows: 1
        })
    );
    let mut out = Vec::new();
    assert_eq!(
        p.step(0, &[1], 0, 0, 1, &mut out).err(),
        Some(NgramError::NoRow(0))
    );
    p.add(0, &[1]).unwrap();
    p.remove(0);
    assert_eq!(
        p.step(0, &[1], 0, 0, 1, &mut out).err(),
        Some(NgramError::NoRow(0))
    );
}
