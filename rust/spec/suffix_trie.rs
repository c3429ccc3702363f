//! A suffix trie bounded in depth, with occurrence counts: the structure of
//! SuffixDecoding (Arctic Inference; arXiv 2411.04975).
//!
//! A sequence inserted into the trie adds, for every start position `j`, the
//! path of its tokens `j .. j + depth` (cut at the sequence's end). Invariant:
//! a node's `count` is the number of inserted paths through it, i.e. how often
//! the string it spells occurs in the inserted sequences; so a node's count is
//! at least the sum of its children's, and the trie holds every substring of
//! length `<= depth` of what was inserted, and nothing else.
//!
//! Sequences grow one token at a time through a `Cursor` (the nodes of the
//! sequence's current suffixes, one per start still shorter than `depth`), so
//! an append costs O(depth) child look-ups, never a rescan. Removing a sequence
//! walks its paths again, decrementing; a node whose count reaches zero is
//! unlinked and its slot reused, so the arena never outgrows the live strings.

use std::collections::{BTreeMap, VecDeque};

type NodeId = u32;
const ROOT: NodeId = 0;

#[derive(Default)]
struct Node {
    count: u32,
    /// (token, child), sorted by token.
    children: Vec<(u32, NodeId)>,
}

/// The nodes of a growing sequence's suffixes shorter than the trie's depth,
/// longest first (its last `min(len, depth)` starts).
#[derive(Default, Clone)]
pub struct Cursor {
    active: VecDeque<NodeId>,
}

impl Cursor {
    /// The node of the sequence's suffix of length `len - i` for `i` in
    /// `0..n`, longest first, with that length.
    fn suffixes(&self) -> impl Iterator<Item = (NodeId, usize)> + '_ {
        let n = self.active.len();
        self.active
            .iter()
            .enumerate()
            .map(move |(i, &id)| (id, n - i))
    }
}

pub struct SuffixTrie {
    depth: usize,
    nodes: Vec<Node>,
    free: Vec<NodeId>,
}

impl SuffixTrie {
    /// An empty trie whose paths are at most `depth` (>= 1) tokens long.
    pub fn new(depth: usize) -> Self {
        SuffixTrie {
            depth: depth.max(1),
            nodes: vec![Node::default()],
            free: Vec::new(),
        }
    }

    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Nodes in use (the root included).
    pub fn num_nodes(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    /// Slots the arena holds (in use or free): what its memory grows with.
    pub fn num_slots(&self) -> usize {
        self.nodes.len()
    }

    fn child(&self, node: NodeId, token: u32) -> Option<NodeId> {
        let kids = &self.nodes[node as usize].children;
        kids.binary_search_by_key(&token, |&(t, _)| t)
            .ok()
            .map(|i| kids[i].1)
    }

    fn child_or_new(&mut self, node: NodeId, token: u32) -> NodeId {
        let at = match self.nodes[node as usize]
            .children
            .binary_search_by_key(&token, |&(t, _)| t)
        {
            Ok(i) => return self.nodes[node as usize].children[i].1,
            Err(at) => at,
        };
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                self.nodes.push(Node::default());
                (self.nodes.len() - 1) as NodeId
            }
        };
        let kids = &mut self.nodes[node as usize].children;
        if kids.capacity() == 0 {
            kids.reserve_exact(1); // most nodes keep one child
        }
        kids.insert(at, (token, id));
        id
    }

    /// Append `token` to the sequence `cursor` follows: every suffix shorter
    /// than the depth grows by it, and a new one-token suffix starts.
    pub fn append(&mut self, cursor: &mut Cursor, token: u32) {
        if cursor.active.len() == self.depth {
            cursor.active.pop_front(); // that start has reached the depth
        }
        self.nodes[ROOT as usize].count += 1;
        cursor.active.push_back(ROOT);
        for i in 0..cursor.active.len() {
            let next = self.child_or_new(cursor.active[i], token);
            self.nodes[next as usize].count += 1;
            cursor.active[i] = next;
        }
    }

    /// Insert a whole sequence (what appending its tokens one by one does).
    pub fn insert(&mut self, tokens: &[u32]) -> Cursor {
        let mut cursor = Cursor::default();
        for &t in tokens {
            self.append(&mut cursor, t);
        }
        cursor
    }

    /// Take back a sequence inserted earlier (the exact tokens, in full).
    pub fn remove(&mut self, tokens: &[u32]) {
        for start in 0..tokens.len() {
            let end = (start + self.depth).min(tokens.len());
            self.remove_path(&tokens[start..end]);
        }
    }

    fn remove_path(&mut self, path: &[u32]) {
        let mut parent = ROOT;
        self.nodes[ROOT as usize].count -= 1;
        for &token in path {
            let Some(node) = self.child(parent, token) else {
                debug_assert!(false, "removing a path that was never inserted");
                return;
            };
            let count = &mut self.nodes[node as usize].count;
            *count -= 1;
            if *count == 0 {
                // the rest of the path hangs below `node` alone: drop it all
                let kids = &mut self.nodes[parent as usize].children;
                if let Ok(i) = kids.binary_search_by_key(&token, |&(t, _)| t) {
                    kids.remove(i);
                }
                self.release(node);
                return;
            }
            parent = node;
        }
    }

    fn release(&mut self, node: NodeId) {
        let mut stack = vec![node];
        while let Some(id) = stack.pop() {
            let n = &mut self.nodes[id as usize];
            stack.extend(n.children.drain(..).map(|(_, c)| c));
            n.children = Vec::new();
            n.count = 0;
            self.free.push(id);
        }
    }

    /// The node spelling `tokens`, if they occur.
    fn find(&self, tokens: &[u32]) -> Option<NodeId> {
        tokens.iter().try_fold(ROOT, |node, &t| self.child(node, t))
    }

    /// From `node`, follow the most frequent continuation while the product of
    /// the steps' frequencies (child count / node count) stays at least
    /// `min_prob`, writing at most `max` tokens into `out`. Returns the draft's
    /// score: the sum of those products (its expected accepted length).
    fn draft(&self, mut node: NodeId, max: usize, min_prob: f32, out: &mut Vec<u32>) -> f32 {
        let (mut prob, mut score) = (1.0f32, 0.0f32);
        for _ in 0..max {
            let n = &self.nodes[node as usize];
            // the most frequent child; the smallest token on a tie
            let Some(&(token, child)) = n.children.iter().reduce(|a, b| {
                if self.count(b.1) > self.count(a.1) {
                    b
                } else {
                    a
                }
            }) else {
                break;
            };
            prob *= self.count(child) as f32 / n.count as f32;
            if prob < min_prob {
                break;
            }
            out.push(token);
            score += prob;
            node = child;
        }
        score
    }

    fn count(&self, node: NodeId) -> u32 {
        self.nodes[node as usize].count
    }

    /// Every string in the trie with its count: the trie's content, whatever
    /// its node layout (tests compare tries with it).
    pub fn strings(&self) -> BTreeMap<Vec<u32>, u32> {
        let mut out = BTreeMap::new();
        let mut stack = vec![(ROOT, Vec::new())];
        while let Some((id, path)) = stack.pop() {
            for &(t, c) in &self.nodes[id as usize].children {
                let mut p = path.clone();
                p.push(t);
                out.insert(p.clone(), self.count(c));
                stack.push((c, p));
            }
        }
        out
    }
}

/// How to turn a match into a draft.
#[derive(Debug, Clone, Copy)]
pub struct DraftLimits {
    /// At most this many tokens.
    pub max_tokens: usize,
    /// At most `max_spec_factor` times the match length.
    pub max_spec_factor: f32,
    /// Stop where the continuation's frequency falls below this.
    pub min_token_prob: f32,
}

impl DraftLimits {
    fn cap(&self, match_len: usize) -> usize {
        let by_match = (self.max_spec_factor * match_len as f32 + 1e-6) as usize;
        self.max_tokens.min(by_match)
    }
}

/// A proposal and its score (the sum of its tokens' path frequencies).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Draft {
    pub tokens: Vec<u32>,
    pub score: f32,
}

impl Draft {
    /// Keep `other` if it scores higher (ties keep the earlier, longer match).
    fn keep_better(&mut self, other: Draft) {
        if other.score > self.score {
            *self = other;
        }
    }
}

impl SuffixTrie {
    /// The best draft over every suffix of a sequence `cursor` follows in this
    /// trie (its own earlier occurrences: the current one has no continuation).
    pub fn best_draft_at(&self, cursor: &Cursor, limits: &DraftLimits) -> Draft {
        let mut best = Draft::default();
        let mut buf = Vec::new();
        for (node, len) in cursor.suffixes() {
            self.try_draft(node, len, limits, &mut buf, &mut best);
        }
        best
    }

    /// The best draft over every suffix of `context` shorter than the depth
    /// that occurs in this trie (walked from the root: `context` need not be
    /// in the trie).
    pub fn best_draft_for(&self, context: &[u32], limits: &DraftLimits) -> Draft {
        let mut best = Draft::default();
        let mut buf = Vec::new();
        let longest = context.len().min(self.depth - 1);
        // a suffix absent means every longer one is too: stop at the first
        let found: Vec<NodeId> = (1..=longest)
            .map_while(|len| self.find(&context[context.len() - len..]))
            .collect();
        for (i, &node) in found.iter().enumerate().rev() {
            self.try_draft(node, i + 1, limits, &mut buf, &mut best);
        }
        best
    }

    fn try_draft(
        &self,
        node: NodeId,
        len: usize,
        limits: &DraftLimits,
        buf: &mut Vec<u32>,
        best: &mut Draft,
    ) {
        let cap = limits.cap(len).min(self.depth - len.min(self.depth));
        if cap == 0 || self.nodes[node as usize].children.is_empty() {
            return;
        }
        buf.clear();
        let score = self.draft(node, cap, limits.min_token_prob, buf);
        if !buf.is_empty() {
            best.keep_better(Draft {
                tokens: buf.clone(),
                score,
            });
        }
    }
}
