//! How deep a grammar nests, measured before llguidance sees it.
//!
//! llguidance compiles grammars recursively: a JSON Schema's nested subschemas and `$ref`
//! targets, and a Lark grammar's rule references, each take a stack frame of a few KiB (measured
//! on llguidance 1.9.1: 3.1 KiB per rule of a Lark chain `r0: r1`, 3.3 KiB per `$ref` of a chain
//! of references, at most 5 KiB per level of JSON nesting). A grammar that nests deep enough
//! therefore overflows any stack, which aborts the process. So before compiling, this module
//! bounds the depth of the grammar from above:
//!
//! - JSON Schema: [`json_text_depth`] bounds the nesting of the JSON text itself (so that
//!   parsing it cannot recurse deeper than that), then [`schema_depth`] bounds the longest
//!   chain of nested objects and arrays, where a `$ref` continues the chain into every node it
//!   may refer to (a JSON pointer from the document root and from the enclosing `$id`
//!   resource, an `$anchor` / `$dynamicAnchor` / draft-7 `"$id": "#name"` anywhere in the
//!   document, an `$id` whose last path segment equals the reference's).
//! - Lark: [`lark_depth`] bounds the longest chain of rule and terminal references (every
//!   identifier in a definition's body that names a definition is a reference), adding the
//!   [`schema_depth`] of the deepest `%json { ... }` schema embedded in a definition.
//!
//! Cycles (recursive grammars, a JSON Schema `$ref` back to an enclosing schema) are normal and
//! llguidance compiles each referenced definition once, so a chain visits a definition at most
//! once; a cycle counts as the sum of the nodes in its strongly connected component
//! ([`longest_path_bound`]). Every bound over-approximates the recursion llguidance can perform
//! (an identifier or a reference may be counted where llguidance would not follow it), never
//! under-approximates it. All walks here are iterative: no input can make them recurse.

use std::collections::HashMap;

use serde_json::Value;

/// The deepest grammar nucleus-grammar compiles: JSON nesting plus `$ref` chains of a JSON
/// Schema ([`schema_depth`]), rule-reference chains of a Lark grammar ([`lark_depth`]).
/// Deeper grammars are refused with [`crate::GrammarError::TooDeep`] before llguidance is
/// called.
///
/// Compilation runs on a thread with a stack of `COMPILE_STACK_BYTES` (64 MiB), which holds
/// about 12 times the deepest recursion measured per level (5 KiB) at this depth.
pub const MAX_GRAMMAR_DEPTH: usize = 1000;

/// The stack of the thread that compiles a grammar. Only the pages a compilation touches are
/// committed; the rest is address space.
pub(crate) const COMPILE_STACK_BYTES: usize = 64 << 20;

/// The least stack a matcher operation (mask, commit, validation, rollback) runs with: if the
/// caller's thread has less left, the operation runs on a fresh stack of
/// `MATCHER_STACK_BYTES`. Matcher operations on grammars within [`MAX_GRAMMAR_DEPTH`] were
/// measured to need less than 64 KiB (the Earley parser and the lexer are iterative; regular
/// expressions nest at most 250 levels, regex-syntax's limit).
pub(crate) const MATCHER_RED_ZONE_BYTES: usize = 1 << 20;
/// See [`MATCHER_RED_ZONE_BYTES`].
pub(crate) const MATCHER_STACK_BYTES: usize = 8 << 20;

/// A directed graph with a weight per node, for [`longest_path_bound`].
#[derive(Default)]
pub(crate) struct Graph {
    weight: Vec<u64>,
    edges: Vec<Vec<u32>>,
}

impl Graph {
    /// Adds a node of `weight` and returns its index.
    pub(crate) fn add_node(&mut self, weight: u64) -> u32 {
        self.weight.push(weight);
        self.edges.push(Vec::new());
        (self.weight.len() - 1) as u32
    }

    /// Adds an edge `from -> to`.
    pub(crate) fn add_edge(&mut self, from: u32, to: u32) {
        self.edges[from as usize].push(to);
    }

    pub(crate) fn len(&self) -> usize {
        self.weight.len()
    }
}

/// An upper bound on the weight of the heaviest path of `graph` that visits no node twice: the
/// heaviest path through the graph's condensation, each strongly connected component weighing
/// the sum of its nodes (a simple path can visit each of them at most once). 0 for an empty
/// graph. Iterative Tarjan; O(nodes + edges).
pub(crate) fn longest_path_bound(graph: &Graph) -> u64 {
    const UNVISITED: u32 = u32::MAX;
    let n = graph.len();
    let mut index = vec![UNVISITED; n];
    let mut low = vec![0u32; n];
    let mut on_stack = vec![false; n];
    let mut component = vec![UNVISITED; n];
    // Heaviest path starting in each component, by component number.
    let mut height: Vec<u64> = Vec::new();
    let mut stack: Vec<u32> = Vec::new();
    // The DFS: (node, next edge to look at).
    let mut dfs: Vec<(u32, usize)> = Vec::new();
    let mut next_index = 0u32;
    let mut best = 0u64;
    for root in 0..n as u32 {
        if index[root as usize] != UNVISITED {
            continue;
        }
        dfs.push((root, 0));
        index[root as usize] = next_index;
        low[root as usize] = next_index;
        next_index += 1;
        stack.push(root);
        on_stack[root as usize] = true;
        while let Some(&mut (v, ref mut edge)) = dfs.last_mut() {
            let vi = v as usize;
            if let Some(&w) = graph.edges[vi].get(*edge) {
                *edge += 1;
                let wi = w as usize;
                if index[wi] == UNVISITED {
                    index[wi] = next_index;
                    low[wi] = next_index;
                    next_index += 1;
                    stack.push(w);
                    on_stack[wi] = true;
                    dfs.push((w, 0));
                } else if on_stack[wi] {
                    low[vi] = low[vi].min(index[wi]);
                }
                continue;
            }
            dfs.pop();
            if let Some(&(parent, _)) = dfs.last() {
                let pi = parent as usize;
                low[pi] = low[pi].min(low[vi]);
            }
            if low[vi] != index[vi] {
                continue;
            }
            // v is the root of a component: pop it. Every edge leaving the component goes to
            // a component already finished (Tarjan emits components in reverse topological
            // order), whose height is known.
            let c = height.len() as u32;
            let mut members = Vec::new();
            loop {
                let w = stack.pop().expect("v is on the stack");
                on_stack[w as usize] = false;
                component[w as usize] = c;
                members.push(w);
                if w == v {
                    break;
                }
            }
            let mut weight = 0u64;
            let mut below = 0u64;
            for &m in &members {
                weight = weight.saturating_add(graph.weight[m as usize]);
                for &w in &graph.edges[m as usize] {
                    let cw = component[w as usize];
                    if cw != c {
                        below = below.max(height[cw as usize]);
                    }
                }
            }
            let h = weight.saturating_add(below);
            height.push(h);
            best = best.max(h);
        }
    }
    best
}

/// The deepest nesting of arrays and objects in the JSON text `text`, counted outside string
/// literals (1 for `{}` or `[1, 2]`, 0 for a scalar). Reads the bytes once, without parsing:
/// text that is not JSON gets some number, and the parser reports the syntax error.
pub fn json_text_depth(text: &[u8]) -> usize {
    let mut depth = 0usize;
    let mut deepest = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for &b in text {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// An upper bound on how deep llguidance's compilation of the JSON Schema `schema` can recurse,
/// in levels: the heaviest chain of nested arrays and objects (each weighs 1), where an object's
/// `$ref` leads on to every node the reference may resolve to (see the module docs). A scalar or
/// boolean schema is 0, `{"type": "string"}` is 1.
pub fn schema_depth(schema: &Value) -> u64 {
    SchemaGraph::build(schema).depth()
}

/// The graph of a JSON Schema document: one node (weight 1) per object and array, an edge from
/// each to its containers, and from each object with a `$ref` to the nodes it may resolve to;
/// anchors and `$id` segments are weight-0 nodes with an edge to every node carrying them.
struct SchemaGraph<'a> {
    graph: Graph,
    /// The document value of each graph node (`None` for anchor and `$id` nodes).
    values: Vec<Option<&'a Value>>,
    /// The nearest enclosing node (itself included) with a non-fragment `$id`, else the root.
    resource: Vec<u32>,
    anchors: HashMap<&'a str, u32>,
    ids: HashMap<&'a str, u32>,
}

impl<'a> SchemaGraph<'a> {
    fn build(root: &'a Value) -> Self {
        let mut g = SchemaGraph {
            graph: Graph::default(),
            values: Vec::new(),
            resource: Vec::new(),
            anchors: HashMap::new(),
            ids: HashMap::new(),
        };
        if !is_container(root) {
            return g;
        }
        // Objects with a `$ref`, resolved once every node is known.
        let mut refs: Vec<(u32, &'a str)> = Vec::new();
        let mut by_address: HashMap<*const Value, u32> = HashMap::new();
        // Iterative walk: (value, parent node, parent's resource).
        let mut todo: Vec<(&'a Value, Option<u32>, u32)> = vec![(root, None, 0)];
        while let Some((value, parent, parent_resource)) = todo.pop() {
            let me = g.node(1, Some(value), parent_resource);
            by_address.insert(value as *const Value, me);
            match parent {
                Some(p) => g.graph.add_edge(p, me),
                None => g.resource[me as usize] = me,
            }
            let children: Box<dyn Iterator<Item = &'a Value>> = match value {
                Value::Object(map) => {
                    for key in ["$id", "id"] {
                        if let Some(Value::String(id)) = map.get(key) {
                            match id.strip_prefix('#') {
                                Some(name) => g.tag(true, name, me),
                                None => {
                                    g.resource[me as usize] = me;
                                    g.tag(false, last_segment(id), me);
                                }
                            }
                        }
                    }
                    for key in ["$anchor", "$dynamicAnchor"] {
                        if let Some(Value::String(name)) = map.get(key) {
                            g.tag(true, name, me);
                        }
                    }
                    for key in ["$ref", "$dynamicRef", "$recursiveRef"] {
                        if let Some(Value::String(r)) = map.get(key) {
                            refs.push((me, r));
                        }
                    }
                    Box::new(map.values())
                }
                Value::Array(items) => Box::new(items.iter()),
                _ => unreachable!("only containers are walked"),
            };
            let resource = g.resource[me as usize];
            for child in children.filter(|v| is_container(v)) {
                todo.push((child, Some(me), resource));
            }
        }
        let mut edges = Vec::new();
        for (from, reference) in refs {
            let (uri, fragment) = reference.split_once('#').unwrap_or((reference, ""));
            if !fragment.is_empty() && !fragment.starts_with('/') {
                if let Some(&k) = g.anchors.get(fragment) {
                    edges.push((from, k));
                }
                continue;
            }
            let bases: Vec<u32> = if uri.is_empty() {
                vec![0, g.resource[from as usize]]
            } else if let Some(&k) = g.ids.get(last_segment(uri)) {
                if fragment.is_empty() {
                    edges.push((from, k));
                    continue;
                }
                g.graph.edges[k as usize].clone()
            } else {
                Vec::new()
            };
            for base in bases {
                let target = g.values[base as usize]
                    .and_then(|v| json_pointer(v, fragment))
                    .and_then(|v| by_address.get(&(v as *const Value)));
                if let Some(&target) = target {
                    edges.push((from, target));
                }
            }
        }
        for (from, to) in edges {
            g.graph.add_edge(from, to);
        }
        g
    }

    /// A new node of `weight`.
    fn node(&mut self, weight: u64, value: Option<&'a Value>, resource: u32) -> u32 {
        self.values.push(value);
        self.resource.push(resource);
        self.graph.add_node(weight)
    }

    /// Marks `node` as carrying the anchor (`anchor`) or `$id` segment `name`.
    fn tag(&mut self, anchor: bool, name: &'a str, node: u32) {
        let existing = match anchor {
            true => self.anchors.get(name),
            false => self.ids.get(name),
        };
        let key = match existing {
            Some(&k) => k,
            None => {
                let k = self.node(0, None, 0);
                match anchor {
                    true => self.anchors.insert(name, k),
                    false => self.ids.insert(name, k),
                };
                k
            }
        };
        self.graph.add_edge(key, node);
    }

    fn depth(&self) -> u64 {
        longest_path_bound(&self.graph)
    }
}

fn is_container(v: &Value) -> bool {
    matches!(v, Value::Object(_) | Value::Array(_))
}

/// The last path segment of a URI reference without its fragment (`http://x/a/b.json#` ->
/// `b.json`; `d1` -> `d1`), trailing slashes ignored.
fn last_segment(uri: &str) -> &str {
    let uri = uri.split('#').next().unwrap_or("");
    let uri = uri.trim_end_matches('/');
    uri.rsplit('/').next().unwrap_or(uri)
}

/// The value at the JSON pointer `pointer` (RFC 6901, as a URI fragment: `%XX` decoded) from
/// `base`; `""` is `base` itself.
fn json_pointer<'a>(base: &'a Value, pointer: &str) -> Option<&'a Value> {
    if pointer.is_empty() {
        return Some(base);
    }
    let mut at = base;
    for token in pointer.strip_prefix('/')?.split('/') {
        let token = percent_decode(token).replace("~1", "/").replace("~0", "~");
        at = match at {
            Value::Object(map) => map.get(&token)?,
            Value::Array(items) => items.get(token.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(at)
}

/// `%XX` escapes decoded (invalid ones kept as written).
fn percent_decode(s: &str) -> String {
    if !s.contains('%') {
        return s.to_string();
    }
    let hex = |b: u8| (b as char).to_digit(16);
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if let (b'%', Some(&h), Some(&l)) = (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            if let (Some(h), Some(l)) = (hex(h), hex(l)) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// An upper bound on how deep llguidance's compilation of the Lark grammar `text` can recurse,
/// in levels: the heaviest chain of references between its definitions (rules `name: ...` and
/// terminals `NAME: ...`, each weighing 1 plus the [`schema_depth`] of the deepest `%json`
/// schema in its body), cycles counted as in [`longest_path_bound`].
///
/// The text is scanned as llguidance's Lark lexer does (`#` and `//` comments, JSON-style
/// `"strings"`, `/regexes/`, `<special tokens>`, the JSON value after `%json`, `%regex` and
/// `%llguidance`); a definition is an identifier followed by `:` (after an optional `.N`
/// priority), and its body runs to the next definition. Text that is not a valid grammar gets
/// some bound; llguidance then reports the syntax error.
pub fn lark_depth(text: &str) -> u64 {
    let bytes = text.as_bytes();
    let mut names: HashMap<&str, u32> = HashMap::new();
    let mut graph = Graph::default();
    // (definition node, identifiers of its body)
    let mut bodies: Vec<(u32, Vec<&str>)> = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match b {
            b'#' => i = line_end(bytes, i),
            b'/' if bytes.get(i + 1) == Some(&b'/') => i = line_end(bytes, i),
            b'"' => i = string_end(bytes, i),
            b'/' => i = regex_end(bytes, i),
            b'<' => {
                // `<[^<>\s]+>` is one special token; a lone `<` is a single character.
                let end = bytes[i + 1..]
                    .iter()
                    .position(|&c| c == b'<' || c == b'>' || c.is_ascii_whitespace())
                    .map(|p| i + 1 + p);
                i = match end {
                    Some(e) if bytes[e] == b'>' && e > i + 1 => e + 1,
                    _ => i + 1,
                };
            }
            b'%' => {
                let start = i + 1;
                let mut end = start;
                while end < bytes.len() && bytes[end].is_ascii_alphabetic() {
                    end += 1;
                }
                let keyword = &text[start..end];
                i = end;
                if matches!(keyword, "json" | "regex" | "llguidance") {
                    let rest = &bytes[i..];
                    let mut values =
                        serde_json::Deserializer::from_slice(rest).into_iter::<Value>();
                    match values.next() {
                        Some(Ok(value)) => {
                            if keyword == "json" {
                                // Each `%json` is a grammar of its own, compiled after the
                                // Lark one: the deepest counts, not their sum.
                                if let Some((node, _)) = bodies.last() {
                                    let extra = schema_depth(&value);
                                    let w = &mut graph.weight[*node as usize];
                                    *w = (*w).max(1 + extra);
                                }
                            }
                            i += values.byte_offset();
                        }
                        // Not JSON: llguidance reports it; scan on, over-counting is safe.
                        _ => i += 1,
                    }
                }
            }
            c if c.is_ascii_alphabetic() || c == b'_' || c == b'!' || c == b'?' => {
                // `!?` prefixes belong to definitions; after the first letter, a `?` is an operator.
                while i < bytes.len() && matches!(bytes[i], b'!' | b'?') {
                    i += 1;
                }
                let start = i;
                while i < bytes.len()
                    && (bytes[i].is_ascii_alphanumeric() || matches!(bytes[i], b'_' | b'-'))
                {
                    i += 1;
                }
                let name = &text[start..i];
                if name.is_empty() {
                    continue;
                }
                if is_definition(bytes, i) {
                    let node = *names.entry(name).or_insert_with(|| graph.add_node(1));
                    bodies.push((node, Vec::new()));
                } else if let Some((_, body)) = bodies.last_mut() {
                    body.push(name);
                }
            }
            _ => i += 1,
        }
    }
    for (node, body) in &bodies {
        for name in body {
            if let Some(&target) = names.get(name) {
                graph.add_edge(*node, target);
            }
        }
    }
    longest_path_bound(&graph)
}

/// Whether the identifier ending at `i` is defined here: followed by `:` (not `::`), after
/// spaces and an optional `.N` priority.
fn is_definition(bytes: &[u8], mut i: usize) -> bool {
    let skip_spaces = |i: &mut usize| {
        while *i < bytes.len() && (bytes[*i] == b' ' || bytes[*i] == b'\t') {
            *i += 1;
        }
    };
    skip_spaces(&mut i);
    if bytes.get(i) == Some(&b'.') {
        i += 1;
        if bytes.get(i) == Some(&b'-') {
            i += 1;
        }
        let digits = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        if i == digits {
            return false;
        }
        skip_spaces(&mut i);
    }
    bytes.get(i) == Some(&b':') && bytes.get(i + 1) != Some(&b':')
}

/// The index after the line that `i` is on (its `\n` excluded).
fn line_end(bytes: &[u8], i: usize) -> usize {
    bytes[i..]
        .iter()
        .position(|&c| c == b'\n')
        .map_or(bytes.len(), |p| i + p)
}

/// The index after the string literal that starts at `i` (a `"`), backslash escapes skipped;
/// an unterminated string runs to the end of its line.
fn string_end(bytes: &[u8], i: usize) -> usize {
    let mut j = i + 1;
    while j < bytes.len() {
        match bytes[j] {
            b'\\' => j += 2,
            b'"' => return j + 1,
            b'\n' => return j,
            _ => j += 1,
        }
    }
    bytes.len()
}

/// The index after the regex literal that starts at `i` (a `/`), backslash escapes skipped,
/// flags included; an unterminated one runs to the end of its line.
fn regex_end(bytes: &[u8], i: usize) -> usize {
    let mut j = i + 1;
    while j < bytes.len() {
        match bytes[j] {
            b'\\' => j += 2,
            b'/' => {
                j += 1;
                while j < bytes.len() && b"imslux".contains(&bytes[j]) {
                    j += 1;
                }
                return j;
            }
            b'\n' => return j,
            _ => j += 1,
        }
    }
    bytes.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn graph(weights: &[u64], edges: &[(u32, u32)]) -> Graph {
        let mut g = Graph::default();
        for &w in weights {
            g.add_node(w);
        }
        for &(a, b) in edges {
            g.add_edge(a, b);
        }
        g
    }

    #[test]
    fn longest_path_bound_of_chains_trees_and_cycles() {
        assert_eq!(longest_path_bound(&Graph::default()), 0);
        assert_eq!(longest_path_bound(&graph(&[1], &[])), 1);
        // 0 -> 1 -> 2 and 0 -> 3: the chain weighs 3.
        assert_eq!(
            longest_path_bound(&graph(&[1, 1, 1, 1], &[(0, 1), (1, 2), (0, 3)])),
            3
        );
        // A self-loop counts its node once.
        assert_eq!(longest_path_bound(&graph(&[1], &[(0, 0)])), 1);
        // 0 -> {1 <-> 2} -> 3: the cycle weighs 2.
        assert_eq!(
            longest_path_bound(&graph(&[1, 1, 1, 1], &[(0, 1), (1, 2), (2, 1), (2, 3)])),
            4
        );
        // The case memoising heights inside a cycle gets wrong: X -> C, C -> A -> B -> C, and
        // A -> D1 -> D2 -> D3. From X: X C A D1 D2 D3 is 6.
        let g = graph(
            &[1, 1, 1, 1, 1, 1, 1],
            // A=0 B=1 C=2 D1=3 D2=4 D3=5 X=6
            &[(0, 1), (1, 2), (2, 0), (0, 3), (3, 4), (4, 5), (6, 2)],
        );
        assert!(longest_path_bound(&g) >= 6);
        // Weights add up.
        assert_eq!(
            longest_path_bound(&graph(&[5, 0, 7], &[(0, 1), (1, 2)])),
            12
        );
    }

    #[test]
    fn json_text_depth_counts_containers_outside_strings() {
        assert_eq!(json_text_depth(b"1"), 0);
        assert_eq!(json_text_depth(b"{}"), 1);
        assert_eq!(json_text_depth(br#"{"a": [1, {"b": []}]}"#), 4);
        assert_eq!(json_text_depth(br#"{"a": "[[[{{{\"[[["}"#), 1);
        assert_eq!(json_text_depth(b"]]]]{"), 1);
    }

    #[test]
    fn schema_depth_follows_refs_pointers_anchors_and_ids() {
        assert_eq!(schema_depth(&json!(true)), 0);
        assert_eq!(schema_depth(&json!({"type": "string"})), 1);
        assert_eq!(
            schema_depth(&json!({"type": "object", "properties": {"a": {"type": "integer"}}})),
            3
        );
        // A chain d0 -> d1 -> d2 through $defs: root, `$defs`, d0 (contained), then d1 and d2
        // (each referred to by the one before).
        let chain = json!({"$ref": "#/$defs/d0", "$defs": {
            "d0": {"$ref": "#/$defs/d1"}, "d1": {"$ref": "#/$defs/d2"}, "d2": {"type": "string"}}});
        assert_eq!(schema_depth(&chain), 5);
        let anchors = json!({"$ref": "#a0", "$defs": {
            "d0": {"$anchor": "a0", "$ref": "#a1"}, "d1": {"$anchor": "a1", "$ref": "#a2"},
            "d2": {"$anchor": "a2", "type": "string"}}});
        assert_eq!(schema_depth(&anchors), 5);
        let ids = json!({"$ref": "d0.json", "$defs": {
            "d0": {"$id": "d0.json", "$ref": "http://example.com/d1.json"},
            "d1": {"$id": "http://example.com/d1.json", "$ref": "d2.json#/properties/x"},
            "d2": {"$id": "d2.json", "properties": {"x": {"type": "string"}}}}});
        // root, `$defs`, d0, d1 (by its $id), d2's x (by $id and pointer).
        assert_eq!(schema_depth(&ids), 5);
        // A pointer relative to the enclosing $id resource.
        // root, `$defs`, r, properties, p, then (relative to r) s, items, items: 8; the
        // pointer does not resolve from the document root, and containment alone gives 7.
        let relative = json!({"$defs": {"r": {"$id": "r.json",
            "properties": {"p": {"$ref": "#/$defs/s"}},
            "$defs": {"s": {"items": {"items": {}}}}}}});
        assert_eq!(schema_depth(&relative), 8);
        // Self reference: a cycle of one node.
        assert_eq!(schema_depth(&json!({"$ref": "#"})), 1);
        // A tree: node -> children -> items -> node.
        let tree = json!({"type": "object", "properties": {"children": {"type": "array",
            "items": {"$ref": "#"}}}});
        assert_eq!(schema_depth(&tree), 4);
        // Pointer escapes.
        // root, properties, p, then (by the pointer) `a/b%`, items, items: 6; without
        // following the reference the deepest is `$defs`' 5.
        let escaped = json!({"properties": {"p": {"$ref": "#/$defs/a~1b%25"}},
            "$defs": {"a/b%": {"items": {"items": {}}}}});
        assert_eq!(schema_depth(&escaped), 6);
    }

    #[test]
    fn lark_depth_follows_rule_and_terminal_references() {
        assert_eq!(lark_depth("start: \"x\"\n"), 1);
        assert_eq!(lark_depth("start: a\na: B\nB: \"x\"\n"), 3);
        // Comments, strings and regexes are not references.
        assert_eq!(
            lark_depth("start: \"a b\" /a|b/i // a b\n# b\na: b\nb: \"x\"\n"),
            2
        );
        // Priorities, ?/! prefixes and continuation lines.
        assert_eq!(lark_depth("?start: a\n    | b\n!a.2: b\nb: \"x\"\n"), 3);
        // Recursion is a cycle.
        assert_eq!(
            lark_depth("start: expr\nexpr: expr \"+\" term | term\nterm: /[0-9]+/\n"),
            3
        );
        // %json adds its schema's depth.
        assert_eq!(
            lark_depth("start: j\nj: %json {\"type\": \"object\", \"properties\": {\"a\": {}}}\n"),
            2 + 3
        );
        // Many %json side by side are as deep as the deepest.
        let flat = format!("start: {}\n", "%json {\"type\": \"integer\"} ".repeat(1200));
        assert_eq!(lark_depth(&flat), 2);
        // A chain.
        let chain: String = (0..50).map(|i| format!("r{i}: r{}\n", i + 1)).collect();
        assert_eq!(lark_depth(&format!("start: r0\n{chain}r50: \"x\"\n")), 52);
    }
}
