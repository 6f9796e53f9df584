//! Relaxed JSON Schema compilation ([`crate::JsonSchemaMode::Relaxed`]): the rewrites of the
//! schema JSON that make llguidance accept a schema it refuses, and the names of the keyword
//! families relaxed.
//!
//! Every rewrite here only ever widens the language: the rewritten schema accepts every
//! instance the original accepts (each rewrite's docs say why). The walks are iterative (an
//! explicit stack), so no schema can make them recurse.

use std::collections::BTreeSet;

use serde_json::{Map, Value};

/// Keywords whose values are data, never subschemas: the walk does not enter them.
const DATA_KEYWORDS: [&str; 8] = [
    "const",
    "enum",
    "default",
    "examples",
    "required",
    "type",
    "x-guidance",
    "dependentRequired",
];

/// Keywords whose value is a map from names to subschemas (the names are not keywords).
const MAP_KEYWORDS: [&str; 6] = [
    "properties",
    "patternProperties",
    "$defs",
    "definitions",
    "dependentSchemas",
    "dependencies",
];

/// Keywords that assert something about the instance (directly or through subschemas). Dropping
/// any of them from a schema object removes a conjunct of its meaning, so it only widens.
const ASSERTIONS: [&str; 42] = [
    "type",
    "enum",
    "const",
    "properties",
    "patternProperties",
    "additionalProperties",
    "required",
    "minProperties",
    "maxProperties",
    "propertyNames",
    "dependencies",
    "dependentRequired",
    "dependentSchemas",
    "unevaluatedProperties",
    "items",
    "prefixItems",
    "additionalItems",
    "contains",
    "minContains",
    "maxContains",
    "minItems",
    "maxItems",
    "uniqueItems",
    "unevaluatedItems",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
    "$dynamicRef",
    "$recursiveRef",
];

/// Calls `f` on every schema object of `schema` (the root, and every value that may be a
/// subschema: the values of schema-valued keywords, of map keywords such as `properties`, the
/// items of array keywords, and the values of unknown keywords, which a `$ref` may point
/// into), parents before children. `f` may change the object; the walk then enters the
/// changed object's values.
fn for_each_schema_object(schema: &mut Value, mut f: impl FnMut(&mut Map<String, Value>)) {
    let mut stack: Vec<&mut Value> = vec![schema];
    while let Some(value) = stack.pop() {
        match value {
            Value::Object(object) => {
                f(object);
                for (key, child) in object.iter_mut() {
                    let key = key.as_str();
                    if DATA_KEYWORDS.contains(&key) {
                        continue;
                    }
                    if MAP_KEYWORDS.contains(&key) {
                        if let Value::Object(map) = child {
                            stack.extend(map.values_mut());
                        }
                        continue;
                    }
                    stack.push(child);
                }
            }
            // Arrays of subschemas (allOf, anyOf, oneOf, prefixItems, items in old drafts).
            Value::Array(items) => stack.extend(items.iter_mut()),
            _ => {}
        }
    }
}

/// Whether the draft named by the root's `$schema` has `if`/`then`/`else` (draft-07 and later;
/// a schema without `$schema` is 2020-12, as for llguidance and `jsonschema`). In drafts 4 and
/// 6 they are unknown keywords, which constrain nothing.
fn has_conditionals(schema: &Value) -> bool {
    match schema.get("$schema").and_then(Value::as_str) {
        Some(uri) => !["draft-03", "draft-04", "draft-06"]
            .iter()
            .any(|d| uri.contains(d)),
        None => true,
    }
}

/// `if`/`then`/`else` as the union of the branches: in every schema object with both `then`
/// and `else`, the three keywords are replaced by `{"anyOf": [then, else]}` appended to its
/// `allOf`. Why it only widens: an instance valid under the conditional satisfies `then` (if it
/// matches `if`) or `else` (if it does not), so it satisfies the union. Where `then` or `else`
/// is missing, its branch is `true` and the union accepts everything: the conditional is left
/// for llguidance's lenient mode to drop (the same language, simpler). Returns whether
/// anything was rewritten.
pub(crate) fn conditionals_as_union(schema: &mut Value) -> bool {
    if !has_conditionals(schema) {
        return false;
    }
    let mut changed = false;
    for_each_schema_object(schema, |object| {
        if !(object.contains_key("then") && object.contains_key("else")) {
            return;
        }
        let then = object.shift_remove("then").unwrap_or(Value::Bool(true));
        let otherwise = object.shift_remove("else").unwrap_or(Value::Bool(true));
        object.shift_remove("if");
        let union = serde_json::json!({ "anyOf": [then, otherwise] });
        match object.get_mut("allOf") {
            Some(Value::Array(all)) => all.push(union),
            Some(_) => {
                // A malformed allOf: nest it, so that the schema stays as malformed as it was.
                let all = object.shift_remove("allOf").unwrap_or(Value::Null);
                object.insert("allOf".to_string(), Value::Array(vec![all, union]));
            }
            None => {
                object.insert("allOf".to_string(), Value::Array(vec![union]));
            }
        }
        changed = true;
    });
    changed
}

/// Overlapping `patternProperties`, narrow form: in every schema object with two or more
/// patterns, they become one pattern `(?:p1)|(?:p2)|...` whose schema is
/// `{"anyOf": [s1, s2, ...]}`. Why it only widens: the union pattern matches exactly the names
/// some pattern matched (so `additionalProperties` applies to the same names), and a value
/// that satisfied every schema of the patterns its name matches satisfies one of them. Returns
/// whether anything was rewritten.
pub(crate) fn merge_pattern_properties(schema: &mut Value) -> bool {
    let mut changed = false;
    for_each_schema_object(schema, |object| {
        let Some(Value::Object(patterns)) = object.get("patternProperties") else {
            return;
        };
        if patterns.len() < 2 {
            return;
        }
        let regex = patterns
            .keys()
            .map(|p| format!("(?:{p})"))
            .collect::<Vec<_>>()
            .join("|");
        let schemas: Vec<Value> = patterns.values().cloned().collect();
        let mut merged = Map::new();
        merged.insert(regex, serde_json::json!({ "anyOf": schemas }));
        object.insert("patternProperties".to_string(), Value::Object(merged));
        changed = true;
    });
    changed
}

/// Overlapping `patternProperties`, wide form (when the narrow form still overlaps, e.g.
/// across the branches of an `allOf`): `patternProperties` and `additionalProperties` are
/// dropped from every schema object that has `patternProperties`. Why it only widens: two
/// assertions are dropped, nothing is added. Returns whether anything was rewritten.
pub(crate) fn drop_pattern_properties(schema: &mut Value) -> bool {
    let mut changed = false;
    for_each_schema_object(schema, |object| {
        if object.shift_remove("patternProperties").is_some() {
            object.shift_remove("additionalProperties");
            changed = true;
        }
    });
    changed
}

/// `pattern`s llguidance cannot compile (look-around, backreferences: its regular
/// expressions are the `regex` crate's syntax, which has neither): with `all` false, the
/// `pattern` keyword is dropped from every schema object where `regex_syntax` refuses its
/// value; with `all`, from every schema object. Why it only widens: an assertion is dropped,
/// nothing is added. Returns whether anything was rewritten.
pub(crate) fn drop_patterns(schema: &mut Value, all: bool) -> bool {
    let mut changed = false;
    for_each_schema_object(schema, |object| {
        let drop = match object.get("pattern") {
            Some(Value::String(p)) => all || regex_syntax::Parser::new().parse(p).is_err(),
            Some(_) => all,
            None => false,
        };
        if drop {
            object.shift_remove("pattern");
            changed = true;
        }
    });
    changed
}

/// The bounds named in llguidance's `Failed to generate regex for float range: min=Some(a),
/// max=Some(b)` (it cannot write a number range with a bound near 1e20 or beyond as a regular
/// expression) or `... for integer range: ...` (bounds from about 1e18, as llguidance sees
/// them: rounded to integers and saturated to the i64 range).
pub(crate) fn range_bounds(message: &str) -> Vec<f64> {
    let Some(at) = [FLOAT_RANGE, INTEGER_RANGE]
        .iter()
        .find_map(|p| message.find(p).map(|at| at + p.len()))
    else {
        return Vec::new();
    };
    message[at..]
        .split("Some(")
        .skip(1)
        .filter_map(|rest| rest.split(')').next()?.trim().parse::<f64>().ok())
        .collect()
}

/// The start of llguidance's message for a number range it cannot compile.
pub(crate) const FLOAT_RANGE: &str = "Failed to generate regex for float range";
/// The start of llguidance's message for an integer range it cannot compile.
pub(crate) const INTEGER_RANGE: &str = "Failed to generate regex for integer range";
/// llguidance's internal check that fails on an integer bound at or below -2^63.
pub(crate) const NEGATE_OVERFLOW: &str = "attempt to negate with overflow";
/// llguidance's internal check that fails on a tiny `multipleOf` (1e-10).
pub(crate) const MULTIPLY_OVERFLOW: &str = "attempt to multiply with overflow";

/// The bound keywords of a number or integer schema.
const BOUNDS: [&str; 4] = ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"];

/// Whether the schema's bound `value` is the `named` one of llguidance's message, which may
/// have rounded it to an integer, moved it by one (exclusive bounds) and saturated it to the
/// i64 range.
fn same_bound(value: f64, named: f64) -> bool {
    let close = |seen: f64| (seen - named).abs() <= (named.abs() * 1e-9).max(1.0);
    close(value) || close(value.clamp(i64::MIN as f64, i64::MAX as f64))
}

/// Number bounds llguidance cannot compile: `minimum`, `maximum`, `exclusiveMinimum` and
/// `exclusiveMaximum` whose value is one of `bounds` (as [`same_bound`] compares them) are
/// dropped from every schema object. Why it only widens: assertions are dropped, nothing is
/// added. Returns whether anything was rewritten.
pub(crate) fn drop_number_bounds(schema: &mut Value, bounds: &[f64]) -> bool {
    drop_bounds_where(schema, |v| bounds.iter().any(|&b| same_bound(v, b)))
}

/// Bounds at or beyond 2^63 in magnitude (llguidance's internal check fails on an integer
/// bound at or below -2^63): dropped from every schema object. Only widens.
pub(crate) fn drop_bounds_beyond_i64(schema: &mut Value) -> bool {
    drop_bounds_where(schema, |v| v.abs() >= -(i64::MIN as f64))
}

fn drop_bounds_where(schema: &mut Value, drop: impl Fn(f64) -> bool) -> bool {
    let mut changed = false;
    for_each_schema_object(schema, |object| {
        for key in BOUNDS {
            if object.get(key).and_then(Value::as_f64).is_some_and(&drop) {
                object.shift_remove(key);
                changed = true;
            }
        }
    });
    changed
}

/// `multipleOf` with a value that is not a whole number (llguidance's internal check fails on
/// a tiny one, 1e-10): dropped from every schema object. Only widens.
pub(crate) fn drop_fractional_multiple_of(schema: &mut Value) -> bool {
    let mut changed = false;
    for_each_schema_object(schema, |object| {
        if object
            .get("multipleOf")
            .and_then(Value::as_f64)
            .is_some_and(|v| v.fract() != 0.0)
        {
            object.shift_remove("multipleOf");
            changed = true;
        }
    });
    changed
}

/// Whether the `$ref` value `reference` may name the normalised URI `uri` that llguidance
/// reports (same fragment, and the reference's base, if any, ends the URI's base).
fn reference_names(reference: &str, uri: &str) -> bool {
    let (ref_base, ref_fragment) = reference.split_once('#').unwrap_or((reference, ""));
    let (uri_base, uri_fragment) = uri.split_once('#').unwrap_or((uri, ""));
    ref_fragment.trim_start_matches('/') == uri_fragment.trim_start_matches('/')
        && uri_base.ends_with(ref_base)
}

/// Circular `$ref`s with sibling keywords: the assertion keywords beside a `$ref` are dropped
/// (annotations, `$defs` / `definitions` and unknown keys stay, so no reference breaks), in
/// every schema object whose `$ref` may name `target` (a URI from llguidance's message), or in
/// every schema object with a `$ref` when `target` is `None`. Why it only widens: the siblings
/// are conjuncts of the object's meaning (drafts 2019-09 and 2020-12; drafts 4 to 7 ignore
/// them anyway). Returns whether anything was rewritten.
pub(crate) fn drop_ref_siblings(schema: &mut Value, target: Option<&str>) -> bool {
    let mut changed = false;
    for_each_schema_object(schema, |object| {
        let Some(Value::String(reference)) = object.get("$ref") else {
            return;
        };
        if target.is_some_and(|t| !reference_names(reference, t)) {
            return;
        }
        let before = object.len();
        object.retain(|k, _| !ASSERTIONS.contains(&k.as_str()));
        changed |= object.len() != before;
    });
    changed
}

/// Circular `$ref`s that still do not compile once their siblings are dropped (llguidance
/// intersects the target with another schema through an `allOf`, or a named property with a
/// matching `patternProperties` schema, while the target is still being defined): the `$ref`
/// keyword itself is dropped from every schema object whose `$ref` may name `target`. Why it
/// only widens: the reference is a conjunct of the object's meaning. Returns whether anything
/// was rewritten.
pub(crate) fn drop_refs(schema: &mut Value, target: &str) -> bool {
    let mut changed = false;
    for_each_schema_object(schema, |object| {
        if let Some(Value::String(reference)) = object.get("$ref") {
            if reference_names(reference, target) {
                object.shift_remove("$ref");
                changed = true;
            }
        }
    });
    changed
}

/// The start of llguidance's message (an error in strict mode, a warning in lenient mode) for
/// `minProperties` / `maxProperties` it cannot count.
pub(crate) const MIN_MAX_WARNING: &str = "min/maxProperties only supported";

/// `minProperties` / `maxProperties` that llguidance cannot count: dropped from every schema
/// object that has `properties` not all listed in `required` (`everywhere`: from every schema
/// object). Why it only widens: two assertions are dropped, nothing is added. Returns whether
/// anything was rewritten.
pub(crate) fn drop_property_counts(schema: &mut Value, everywhere: bool) -> bool {
    let mut changed = false;
    for_each_schema_object(schema, |object| {
        let optional = match object.get("properties") {
            Some(Value::Object(properties)) => {
                let required: Vec<&str> = match object.get("required") {
                    Some(Value::Array(r)) => r.iter().filter_map(Value::as_str).collect(),
                    _ => Vec::new(),
                };
                properties.keys().any(|k| !required.contains(&k.as_str()))
            }
            _ => false,
        };
        if everywhere || optional {
            let a = object.shift_remove("minProperties").is_some();
            let b = object.shift_remove("maxProperties").is_some();
            changed |= a || b;
        }
    });
    changed
}

/// The keyword families that llguidance's lenient-mode `warnings` say it relaxed:
/// `Unimplemented keys: ["not", "if"]` gives `not` and `if/then/else`, `Unknown format: foo`
/// gives `format:foo`, the `oneOf` fallback gives `oneOf` (and the `min/maxProperties` one,
/// which the compiler does not keep, `min/maxProperties`).
pub(crate) fn families_from_warnings(warnings: &[String], families: &mut BTreeSet<String>) {
    for warning in warnings {
        if let Some(rest) = warning.strip_prefix("Unimplemented keys: ") {
            // Rust's Debug of a list of strings: ["a", "b"], maybe followed by " (N times)".
            let list = rest.split(']').next().unwrap_or("");
            for key in list.split('"').skip(1).step_by(2) {
                families.insert(family_of_key(key).to_string());
            }
        } else if let Some(rest) = warning.strip_prefix("Unknown format: ") {
            let name = match rest.rfind(" (") {
                Some(i) if rest.ends_with(" times)") => &rest[..i],
                _ => rest,
            };
            families.insert(format!("format:{name}"));
        } else if warning.starts_with("oneOf not fully supported") {
            families.insert("oneOf".to_string());
        } else if warning.starts_with(MIN_MAX_WARNING) {
            families.insert("min/maxProperties".to_string());
        }
    }
}

/// The family a keyword is reported under: `if`, `then` and `else` are one.
pub(crate) fn family_of_key(key: &str) -> &str {
    match key {
        "if" | "then" | "else" => "if/then/else",
        k => k,
    }
}
