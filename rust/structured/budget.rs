//! What compiling one constraint may cost, and the errors that name the bound a
//! constraint went past.
//!
//! llguidance counts work in "fuel" and Earley items rather than in clock time
//! (so a limit trips the same way on every machine) and bounds its lexer's
//! automaton by states. Its defaults let one regex such as `a{1000001}` hold
//! ~100 MB for as long as it is cached; these are tighter. Memory is bounded
//! once more after the fact: what a compiled grammar holds is measured
//! (`alloc_count`) and a grammar over `MAX_GRAMMAR_BYTES` is refused.

use llguidance::api::ParserLimits;

/// The most heap one compiled grammar may hold.
pub const MAX_GRAMMAR_BYTES: u64 = 32 << 20;

/// After a compile that held this much at its peak, or when a grammar that
/// holds this much is dropped, free pages go back to the system.
pub const RELEASE_OVER_BYTES: u64 = 4 << 20;

/// Bounds on what compiling one constraint and computing one mask may cost.
pub fn limits() -> ParserLimits {
    ParserLimits {
        // symbols in the grammar's productions: a few MB of JSON schema
        max_grammar_size: 200_000,
        // regex AST nodes built for the lexer at compile time (~20 ms)
        initial_lexer_fuel: 1_000_000,
        // per mask: lexer work (~15 ms) and Earley items (~2.5 ms)
        step_lexer_fuel: 200_000,
        step_max_items: 50_000,
        // states of the lexer's automaton, ~1-2 kB each
        max_lexer_states: 50_000,
        // errors name the problem, not the whole grammar and parser state
        verbose_errors: false,
        ..ParserLimits::default()
    }
}

/// The `ParserLimits` field (with its value) that llguidance's error `msg`
/// reports as exceeded, if it is one of them.
pub fn exceeded_limit(msg: &str) -> Option<String> {
    let l = limits();
    let named = [
        ("initial_lexer_fuel", "initial lexer", l.initial_lexer_fuel),
        (
            "initial_lexer_fuel",
            "relevance of lexemes",
            l.initial_lexer_fuel,
        ),
        (
            "initial_lexer_fuel",
            "lexer precomputation",
            l.initial_lexer_fuel,
        ),
        (
            "max_grammar_size",
            "grammar size",
            l.max_grammar_size as u64,
        ),
        ("max_lexer_states", "states", l.max_lexer_states as u64),
        ("step_lexer_fuel", "lexer fuel", l.step_lexer_fuel),
        (
            "max_items_in_row",
            "items in a row",
            l.max_items_in_row as u64,
        ),
        ("step_max_items", "too many items", l.step_max_items as u64),
    ];
    named
        .iter()
        .find(|(_, text, _)| msg.contains(text))
        .map(|(name, _, value)| format!("{name}={value}"))
}
