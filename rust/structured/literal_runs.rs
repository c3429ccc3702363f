//! The longest literal a regex spells out once its repetitions are expanded.
//!
//! Why: llguidance's lexer (derivre) turns a repetition of a literal into one
//! byte string — `a{1000001}` into a million `a`s — and every lexer state it
//! reaches holds its own copy of the rest of that string. Computing one mask
//! for `a{1000001}` took 0.5 s and kept ~100 MB; `(a{1000}){1000}` 1 s and
//! 150 MB. None of it is charged to llguidance's fuel (it counts expressions
//! built, not their bytes), so this bound is checked on the pattern before it
//! compiles. Repetitions of classes or alternations (`[ab]{100000}`,
//! `.{0,50000}`) stay compact in the lexer and are not counted.

use regex_syntax::hir::{Hir, HirKind};

/// The most bytes one expanded literal run may have.
pub const MAX_LITERAL_BYTES: u64 = 10_000;

/// The longest literal run of `pattern` (see the module), or None if it does
/// not parse here (llguidance then says what is wrong with it).
pub fn longest_literal(pattern: &str) -> Option<u64> {
    let hir = regex_syntax::ParserBuilder::new()
        .build()
        .parse(pattern)
        .ok()?;
    Some(walk(&hir).longest)
}

/// A sub-pattern's literal runs: `exact`, its length if it is a literal of
/// one fixed length; `longest`, its longest run anywhere inside.
struct Runs {
    exact: Option<u64>,
    longest: u64,
}

fn walk(hir: &Hir) -> Runs {
    match hir.kind() {
        HirKind::Empty => Runs {
            exact: Some(0),
            longest: 0,
        },
        HirKind::Literal(lit) => {
            let n = lit.0.len() as u64;
            Runs {
                exact: Some(n),
                longest: n,
            }
        }
        HirKind::Class(_) | HirKind::Look(_) => Runs {
            exact: None,
            longest: 0,
        },
        HirKind::Capture(c) => walk(&c.sub),
        HirKind::Repetition(r) => {
            let inner = walk(&r.sub);
            let count = u64::from(r.max.unwrap_or(r.min).max(r.min));
            let expanded = inner.exact.map_or(0, |n| n.saturating_mul(count));
            Runs {
                exact: inner
                    .exact
                    .filter(|_| r.max == Some(r.min))
                    .map(|n| n.saturating_mul(u64::from(r.min))),
                longest: inner.longest.max(expanded),
            }
        }
        HirKind::Concat(parts) => {
            // adjacent fixed literals join into one run
            let (mut run, mut longest, mut all_exact) = (0u64, 0u64, true);
            for part in parts {
                let p = walk(part);
                longest = longest.max(p.longest);
                match p.exact {
                    Some(n) => run = run.saturating_add(n),
                    None => {
                        all_exact = false;
                        run = 0;
                    }
                }
                longest = longest.max(run);
            }
            Runs {
                exact: all_exact.then_some(run),
                longest,
            }
        }
        HirKind::Alternation(alts) => Runs {
            exact: None,
            longest: alts.iter().map(|a| walk(a).longest).max().unwrap_or(0),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repetitions_of_literals_are_expanded() {
        assert_eq!(longest_literal("a{1000001}"), Some(1_000_001));
        assert_eq!(longest_literal("(a{1000}){1000}"), Some(1_000_000));
        assert_eq!(longest_literal("(ab){100000}"), Some(200_000));
        assert_eq!(longest_literal("a{100000,}"), Some(100_000));
        assert_eq!(longest_literal("x(ab){3}y"), Some(8));
    }

    #[test]
    fn repetitions_of_classes_are_not_literal() {
        assert_eq!(longest_literal("[ab]{100000}"), Some(0));
        assert_eq!(longest_literal(".{0,50000}"), Some(0));
        assert_eq!(longest_literal("(abc|def){30000}"), Some(3));
        assert_eq!(longest_literal("[0-9]{3}-[0-9]{4}"), Some(1));
    }

    #[test]
    fn an_unparsable_pattern_is_left_to_llguidance() {
        assert_eq!(longest_literal("a{"), None);
    }
}
