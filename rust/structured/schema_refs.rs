//! `$ref` cycles in a JSON schema that consume nothing: `a` refers to `b`,
//! which refers back to `a`, with no object, array or value between them. Such
//! a schema describes no JSON at all; llguidance compiled it to a grammar that
//! only allows ending, and the request finished with an empty completion.
//! Recursion through a property or an item (a tree of nodes) is legitimate and
//! is not a cycle here: the nested value consumes input.
//!
//! A schema's "same-instance" references are its `$ref` and those of its
//! `allOf` / `anyOf` / `oneOf` members (applied to the same value); a cycle in
//! that graph, over local references (`#` and `#/...` JSON pointers), is the
//! error.

use std::collections::HashSet;

use serde_json::Value;

/// The first cycle of local references that consume nothing, as the pointers
/// along it (`#/$defs/a -> #/$defs/b -> #/$defs/a`), or None. Starts from the
/// root and from every local `$ref` anywhere in the document.
pub fn ref_cycle(root: &Value) -> Option<String> {
    let mut path: Vec<String> = Vec::new();
    let mut done: HashSet<String> = HashSet::new();
    let mut starts = vec!["#".to_string()];
    let mut stack = vec![root];
    while let Some(v) = stack.pop() {
        match v {
            Value::Object(map) => {
                if let Some(Value::String(r)) = map.get("$ref") {
                    if r == "#" || r.starts_with("#/") {
                        starts.push(r.clone());
                    }
                }
                stack.extend(map.values());
            }
            Value::Array(items) => stack.extend(items.iter()),
            _ => {}
        }
    }
    for start in starts {
        if let Some(node) = resolve(root, &start) {
            if let Some(cycle) = find(root, node, &start, &mut path, &mut done) {
                return Some(cycle);
            }
        }
    }
    None
}

/// Depth-first over same-instance references from `node` (at `pointer`).
/// `path`: the pointers being visited; `done`: those known to reach no cycle.
fn find(
    root: &Value,
    node: &Value,
    pointer: &str,
    path: &mut Vec<String>,
    done: &mut HashSet<String>,
) -> Option<String> {
    if let Some(at) = path.iter().position(|p| p == pointer) {
        let mut cycle = path[at..].to_vec();
        cycle.push(pointer.to_string());
        return Some(cycle.join(" -> "));
    }
    if done.contains(pointer) {
        return None;
    }
    path.push(pointer.to_string());
    for target in same_instance_refs(node) {
        if let Some(next) = resolve(root, &target) {
            if let Some(cycle) = find(root, next, &target, path, done) {
                return Some(cycle);
            }
        }
    }
    path.pop();
    done.insert(pointer.to_string());
    None
}

/// The local `$ref`s that apply to the same value as `node`.
fn same_instance_refs(node: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![node];
    while let Some(n) = stack.pop() {
        let Value::Object(map) = n else { continue };
        if let Some(Value::String(r)) = map.get("$ref") {
            if r == "#" || r.starts_with("#/") {
                out.push(r.clone());
            }
        }
        for key in ["allOf", "anyOf", "oneOf"] {
            if let Some(Value::Array(members)) = map.get(key) {
                stack.extend(members.iter());
            }
        }
    }
    out
}

/// The schema at a local reference (`#` or a `#/...` JSON pointer).
fn resolve<'a>(root: &'a Value, reference: &str) -> Option<&'a Value> {
    let pointer = reference.strip_prefix('#')?;
    root.pointer(pointer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_ref_to_itself_is_a_cycle() {
        let s = json!({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}});
        assert_eq!(ref_cycle(&s).as_deref(), Some("#/$defs/a -> #/$defs/a"));
    }

    #[test]
    fn a_cycle_through_all_of_is_found() {
        let s = json!({
            "$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
            "$ref": "#/$defs/a"
        });
        assert_eq!(
            ref_cycle(&s).as_deref(),
            Some("#/$defs/a -> #/$defs/b -> #/$defs/a")
        );
    }

    #[test]
    fn a_cycle_under_a_property_is_found() {
        let s = json!({
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/a"}},
            "$defs": {"a": {"$ref": "#/$defs/a"}}
        });
        assert!(ref_cycle(&s).is_some());
    }

    #[test]
    fn the_root_referring_to_itself_is_a_cycle() {
        assert!(ref_cycle(&json!({"$ref": "#"})).is_some());
    }

    #[test]
    fn recursion_through_a_property_is_not_a_cycle() {
        let tree = json!({
            "type": "object",
            "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}
        });
        assert_eq!(ref_cycle(&tree), None);
        let shared = json!({
            "$defs": {"n": {"type": "integer"}},
            "properties": {"a": {"$ref": "#/$defs/n"}, "b": {"$ref": "#/$defs/n"}}
        });
        assert_eq!(ref_cycle(&shared), None);
    }
}
