use super::suffix::{SuffixConfig, SuffixError, SuffixProposer};
use super::suffix_trie::{DraftLimits, SuffixTrie};

fn config(depth: usize, max_requests: usize, max_tokens: usize) -> SuffixConfig {
    SuffixConfig {
        max_tree_depth: depth,
        max_cached_requests: max_requests,
        max_cached_tokens: max_tokens,
        max_spec_factor: 1.0,
        min_token_prob: 0.1,
    }
}

fn seq(n: usize, seed: u32, vocab: u32) -> Vec<u32> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x % vocab
        })
        .collect()
}

fn propose(p: &mut SuffixProposer, row: usize, new: &[u32], k: usize) -> Vec<u32> {
    let mut out = Vec::new();
    let n = p.step(row, new, 0, 0, k, &mut out).unwrap();
    assert_eq!(n, out.len());
    out
}

/// Every substring of length <= depth, counted: the trie's content by definition.
fn substrings(seqs: &[&[u32]], depth: usize) -> std::collections::BTreeMap<Vec<u32>, u32> {
    let mut out = std::collections::BTreeMap::new();
    for s in seqs {
        for i in 0..s.len() {
            for j in i + 1..=(i + depth).min(s.len()) {
                *out.entry(s[i..j].to_vec()).or_insert(0) += 1;
            }
        }
    }
    out
}

#[test]
fn trie_holds_every_short_substring_with_its_count() {
    let a = seq(300, 1, 7);
    let b = seq(200, 2, 7);
    let mut t = SuffixTrie::new(5);
    t.insert(&a);
    t.insert(&b);
    assert_eq!(t.strings(), substrings(&[&a, &b], 5));
    t.remove(&a);
    assert_eq!(t.strings(), substrings(&[&b], 5));
    t.remove(&b);
    assert!(t.strings().is_empty());
    assert_eq!(t.num_nodes(), 1);
}

#[test]
fn proposes_the_most_frequent_continuation() {
    let mut p = SuffixProposer::new(1, config(8, 0, 0)).unwrap();
    // "1 2" is followed by "3 4" twice and by "9" once
    p.add(0, 0, &[1, 2, 3, 4, 7, 1, 2, 3, 4, 8, 1, 2, 9, 5, 1], 15)
        .unwrap();
    assert_eq!(propose(&mut p, 0, &[2], 4), vec![3, 4]);
    // no earlier occurrence of "6": nothing to propose
    assert!(propose(&mut p, 0, &[6], 4).is_empty());
}

#[test]
fn draft_length_adapts_to_match_length_and_frequency() {
    let mut t = SuffixTrie::new(16);
    let text: Vec<u32> = (0..10).chain(0..10).collect();
    let cursor = t.insert(&text[..13]); // ... 0 1 2: a 3-token match
    let limits = |factor: f32, prob: f32| DraftLimits {
        max_tokens: 8,
        max_spec_factor: factor,
        min_token_prob: prob,
    };
    // the match "0 1 2" occurs twice (the earlier one continues): p = 1/2
    let d = t.best_draft_at(&cursor, &limits(1.0, 0.1));
    assert_eq!(d.tokens, vec![3, 4, 5]); // capped at 1.0 x 3 matched tokens
    let d = t.best_draft_at(&cursor, &limits(2.0, 0.1));
    assert_eq!(d.tokens, vec![3, 4, 5, 6, 7, 8]);
    assert!(t
        .best_draft_at(&cursor, &limits(2.0, 0.6))
        .tokens
        .is_empty());
}

#[test]
fn incremental_equals_rebuilt_from_scratch() {
    let text = seq(600, 3, 11);
    let cfg = config(6, 4, 10_000);
    let mut a = SuffixProposer::new(1, cfg).unwrap();
    a.add(0, 7, &text[..20], 10).unwrap();
    for i in 20..text.len() {
        let got = propose(&mut a, 0, &text[i..=i], 5);
        let mut b = SuffixProposer::new(1, cfg).unwrap();
        b.add(0, 7, &text[..=i], 10).unwrap();
        assert_eq!(got, propose(&mut b, 0, &[], 5), "at {i}");
        assert_eq!(
            a.global_trie().unwrap().strings(),
            b.global_trie().unwrap().strings()
        );
    }
}

#[test]
fn a_repeated_answer_is_drafted_from_other_requests() {
    let answer = seq(40, 9, 1000);
    let mut p = SuffixProposer::new(2, config(12, 10, 10_000)).unwrap();
    p.add(0, 1, &[5000, 5001], 2).unwrap();
    propose(&mut p, 0, &answer, 4);
    p.remove(0);
    // another request, another prompt, the same answer begins
    p.add(1, 2, &[6000, 6001, 6002], 3).unwrap();
    assert_eq!(propose(&mut p, 1, &answer[..6], 4), answer[6..10].to_vec());
    // without sharing, nothing to copy
    let mut q = SuffixProposer::new(2, config(12, 0, 0)).unwrap();
    q.add(1, 2, &[6000, 6001, 6002], 3).unwrap();
    assert!(propose(&mut q, 1, &answer[..6], 4).is_empty());
}

#[test]
fn eviction_bounds_memory_oldest_first() {
    let depth = 8;
    let mut p = SuffixProposer::new(2, config(depth, 3, 500)).unwrap();
    let outputs: Vec<Vec<u32>> = (0..50).map(|i| seq(100 + i, i as u32, 50)).collect();
    let mut slots = Vec::new();
    for (i, out) in outputs.iter().enumerate() {
        p.add(i % 2, i as u64, &[1, 2, 3], 3).unwrap();
        propose(&mut p, i % 2, out, 4);
        p.remove(i % 2);
        assert!(p.num_cached_requests() <= 3);
        assert!(p.num_global_tokens() <= 500);
        slots.push(p.global_trie().unwrap().num_slots());
        // the newest three (fewer when over 500 tokens) are what is left
        let kept: Vec<&[u32]> = outputs[..=i]
            .iter()
            .rev()
            .take(p.num_cached_requests())
            .map(Vec::as_slice)
            .collect();
        assert_eq!(p.global_trie().unwrap().strings(), substrings(&kept, depth));
    }
    // freed slots are reused: the arena holds what at most 500 kept tokens and
    // one running output (< 150) need, far from the 50 outputs' ~6,200 tokens
    assert!(slots[49] <= (500 + 150) * depth + 1, "{}", slots[49]);
}

#[test]
fn a_resumed_request_replaces_its_copy() {
    let mut p = SuffixProposer::new(1, config(6, 10, 10_000)).unwrap();
    let out = seq(30, 4, 20);
    p.add(0, 42, &[1, 2], 2).unwrap();
    propose(&mut p, 0, &out[..20], 3);
    p.remove(0); // preempted
    let mut tokens = vec![1, 2];
    tokens.extend_from_slice(&out[..20]);
    p.add(0, 42, &tokens, 2).unwrap();
    propose(&mut p, 0, &out[20..], 3);
    assert_eq!(p.num_global_tokens(), 30);
    assert_eq!(p.num_cached_requests(), 0);
    assert_eq!(p.global_trie().unwrap().strings(), substrings(&[&out], 6));
}

#[test]
fn errors_name_the_problem() {
    let bad = |c: SuffixConfig| SuffixProposer::new(1, c).err();
    assert_eq!(bad(config(1, 0, 0)), Some(SuffixError::BadDepth(1)));
    let mut c = config(4, 0, 0);
    c.min_token_prob = 1.5;
    assert_eq!(bad(c), Some(SuffixError::BadProb(1.5)));
    c.min_token_prob = 0.1;
    c.max_spec_factor = 0.0;
    assert_eq!(bad(c), Some(SuffixError::BadFactor(0.0)));
    let mut p = SuffixProposer::new(1, config(4, 1, 10)).unwrap();
    assert!(matches!(
        p.add(1, 0, &[1], 1),
        Err(SuffixError::BadRow { .. })
    ));
    assert!(matches!(
        p.add(0, 0, &[1], 2),
        Err(SuffixError::BadPrompt { .. })
    ));
    let mut out = Vec::new();
    assert_eq!(
        p.step(0, &[1], 0, 0, 1, &mut out).err(),
        Some(SuffixError::NoRow(0))
    );
}

#[test]
fn a_row_whose_drafts_are_rejected_stops_proposing_for_a_while() {
    let mut p = SuffixProposer::new(1, config(8, 0, 0)).unwrap();
    p.add(0, 0, &[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 10).unwrap();
    let mut out = Vec::new();
    assert_eq!(p.step(0, &[], 0, 0, 2, &mut out).unwrap(), 2);
    // rejected outright: the next step proposes nothing, the one after again
    assert_eq!(p.step(0, &[], 2, 0, 2, &mut out).unwrap(), 0);
    assert_eq!(p.step(0, &[], 0, 0, 2, &mut out).unwrap(), 2);
    // an accepted token keeps it proposing
    assert_eq!(p.step(0, &[], 2, 1, 2, &mut out).unwrap(), 2);
}
