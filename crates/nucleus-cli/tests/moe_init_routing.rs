//! `nucleus moe-init-routing` as a user runs it: JSON lines and safetensors in, one JSON answer
//! per call out, error answers, exit statuses. Expected values are the worked cases of
//! spec/moe_routing.md (spelled exactly as the command writes them) or the library's own
//! answer for the same call.

mod common;

use common::{
    answers, bf16_bytes, f16_bytes, f32_bytes, i32_bytes, i64_bytes, run_subcommand, temp_dir,
    text, write_tensors, TensorSpec,
};
use std::path::Path;
use std::process::Output;

use nucleus_moe::{
    moe_init_routing, DropPadMode, ExpandedX, ExpertTokensNumType, MoeInitRoutingAttrs,
    MoeInitRoutingInput, QuantMode, RowIdxType,
};
use safetensors::Dtype;
use serde_json::{json, Value};

/// Runs `nucleus moe-init-routing ARGS` with `stdin` as its standard input.
fn run(args: &[&str], stdin: &str) -> Output {
    run_subcommand("moe-init-routing", args, stdin)
}

/// The raw output lines for these input lines (one call each), after a successful run.
fn raw_lines(lines: &[&str]) -> Vec<String> {
    let input: String = lines.iter().map(|l| format!("{l}\n")).collect();
    let out = run(&[], &input);
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status,
        text(&out.stderr)
    );
    text(&out.stdout).lines().map(str::to_owned).collect()
}

fn calls(lines: &[Value]) -> Vec<Value> {
    let input: String = lines.iter().map(|l| format!("{l}\n")).collect();
    answers(&run(&[], &input))
}

fn error_of(answer: &Value) -> (String, String) {
    let e = &answer["error"];
    (
        e["kind"]
            .as_str()
            .unwrap_or_else(|| panic!("not an error: {answer}"))
            .to_owned(),
        e["message"].as_str().unwrap().to_owned(),
    )
}

// ---- The spec's worked cases through the CLI, spelled exactly ----

/// The common inputs of the spec's worked cases: N=3, K=2, H=2, E=4.
const COMMON: &str =
    r#""x": [[1, 10], [2, 20], [3, 30]], "expert_idx": [[2, 0], [1, 2], [0, 1]], "expert_num": 4"#;

#[test]
fn worked_cases_give_the_spec_answers_spelled_exactly() {
    let cases: Vec<(String, &str)> = vec![
        // Dropless, gather, count.
        (
            format!(r#"{{{COMMON}, "expert_tokens_num_type": 1, "expert_tokens_num_flag": true}}"#),
            r#"{"expanded_x":[[1.0,10.0],[3.0,30.0],[2.0,20.0],[3.0,30.0],[1.0,10.0],[2.0,20.0]],"expanded_x_dtype":"f32","expanded_row_idx":[4,0,2,5,1,3],"expert_tokens":[2,2,2,0],"expanded_scale":null,"valid_rows":6}"#,
        ),
        // Scatter + cumsum.
        (
            format!(r#"{{{COMMON}, "row_idx_type": 1, "expert_tokens_num_type": 0, "expert_tokens_num_flag": true}}"#),
            r#"{"expanded_x":[[1.0,10.0],[3.0,30.0],[2.0,20.0],[3.0,30.0],[1.0,10.0],[2.0,20.0]],"expanded_x_dtype":"f32","expanded_row_idx":[1,4,2,5,0,3],"expert_tokens":[2,4,6,6],"expanded_scale":null,"valid_rows":6}"#,
        ),
        // Key-value with a per-row scale.
        (
            format!(r#"{{{COMMON}, "scale": [0.5, 0.25, 0.125], "expert_tokens_num_type": 2, "expert_tokens_num_flag": true}}"#),
            r#"{"expanded_x":[[1.0,10.0],[3.0,30.0],[2.0,20.0],[3.0,30.0],[1.0,10.0],[2.0,20.0]],"expanded_x_dtype":"f32","expanded_row_idx":[4,0,2,5,1,3],"expert_tokens":[[0,2],[1,2],[2,2],[0,0]],"expanded_scale":[0.5,0.125,0.25,0.125,0.5,0.25],"valid_rows":6}"#,
        ),
        // Active, active_num 4.
        (
            format!(r#"{{{COMMON}, "active_num": 4, "expert_tokens_num_type": 1, "expert_tokens_num_flag": true}}"#),
            r#"{"expanded_x":[[1.0,10.0],[3.0,30.0],[2.0,20.0],[3.0,30.0]],"expanded_x_dtype":"f32","expanded_row_idx":[4,0,2,5,1,3],"expert_tokens":[2,2,2,0],"expanded_scale":null,"valid_rows":4}"#,
        ),
        // Range [1, 3): the rows past A = 4 are zeros.
        (
            r#"{"x": [[1, 1.5], [2, 2.5], [3, 3.5], [4, 4.5]], "expert_idx": [[0, 3], [1, 2], [3, 1], [2, 0]], "expert_num": 4, "active_expert_range": [1, 3], "expert_tokens_num_type": 1, "expert_tokens_num_flag": true}"#.to_owned(),
            r#"{"expanded_x":[[2.0,2.5],[3.0,3.5],[2.0,2.5],[4.0,4.5],[0.0,0.0],[0.0,0.0],[0.0,0.0],[0.0,0.0]],"expanded_x_dtype":"f32","expanded_row_idx":[-1,-1,0,2,-1,1,3,-1],"expert_tokens":[2,2],"expanded_scale":null,"valid_rows":4}"#,
        ),
        // Drop/pad, C = 2: [E, C, H].
        (
            r#"{"x": [[1, -1], [2, -2], [3, -3], [4, -4]], "expert_idx": [[0, 1], [0, 2], [1, 0], [0, 2]], "scale": [1, 2, 3, 4], "expert_num": 4, "expert_capacity": 2, "drop_pad_mode": 1, "expert_tokens_num_type": 1, "expert_tokens_num_flag": true}"#.to_owned(),
            r#"{"expanded_x":[[[1.0,-1.0],[2.0,-2.0]],[[1.0,-1.0],[3.0,-3.0]],[[2.0,-2.0],[4.0,-4.0]],[[0.0,0.0],[0.0,0.0]]],"expanded_x_dtype":"f32","expanded_row_idx":[0,2,1,4,3,-1,-1,5],"expert_tokens":[4,2,2,0],"expanded_scale":[1.0,2.0,1.0,3.0,2.0,4.0,0.0,0.0],"valid_rows":8}"#,
        ),
        // Dynamic int8.
        (
            r#"{"x": [[254, 5, -3], [-127, 62.5, 0.5]], "expert_idx": [[1], [0]], "expert_num": 2, "quant_mode": 1}"#.to_owned(),
            r#"{"expanded_x":[[-127,62,0],[127,2,-2]],"expanded_x_dtype":"i8","expanded_row_idx":[1,0],"expert_tokens":null,"expanded_scale":[1.0,2.0],"valid_rows":2}"#,
        ),
        // Static int8.
        (
            r#"{"x": [[0.25, 1, 100, -70], [-0.75, 0, -1.25, 63]], "expert_idx": [[1], [0]], "scale": [2], "offset": [0.5], "expert_num": 2, "quant_mode": 0}"#.to_owned(),
            r#"{"expanded_x":[[-1,0,-2,126],[1,2,127,-128]],"expanded_x_dtype":"i8","expanded_row_idx":[1,0],"expert_tokens":null,"expanded_scale":null,"valid_rows":2}"#,
        ),
        // Sentinel -1: an invalid route, not placed.
        (
            r#"{"x": [[1], [2]], "expert_idx": [[0, -1], [2, 0]], "expert_num": 3, "expert_tokens_num_type": 1, "expert_tokens_num_flag": true}"#.to_owned(),
            r#"{"expanded_x":[[1.0],[2.0],[2.0],[0.0]],"expanded_x_dtype":"f32","expanded_row_idx":[0,-1,2,1],"expert_tokens":[2,0,1],"expanded_scale":null,"valid_rows":3}"#,
        ),
    ];
    let lines: Vec<&str> = cases.iter().map(|c| c.0.as_str()).collect();
    let got = raw_lines(&lines);
    assert_eq!(got.len(), cases.len());
    for ((line, want), got) in cases.iter().zip(&got) {
        assert_eq!(got, want, "{line}");
    }
}

#[test]
fn dynamic_smooth_scales_are_taken_nested_or_flat() {
    // Range [0, 2) of E = 2, H = 2: a [2, 2] smooth scale, per expert; and a [1, 2] one.
    let base =
        r#""x": [[1, 2], [4, -8]], "expert_idx": [[1], [0]], "expert_num": 2, "quant_mode": 1"#;
    let nested = format!(r#"{{{base}, "scale": [[1, 0.5], [2, 1]]}}"#);
    let flat = format!(r#"{{{base}, "scale": [1, 0.5, 2, 1]}}"#);
    let one_nested = format!(r#"{{{base}, "scale": [[2, 1]]}}"#);
    let one_flat = format!(r#"{{{base}, "scale": [2, 1]}}"#);
    let got = raw_lines(&[&nested, &flat, &one_nested, &one_flat]);
    // Row 1 (4, -8) goes to expert 0 (smooth [1, 0.5]: 4, -4), row 0 (1, 2) to expert 1
    // (smooth [2, 1]: 2, 2); s = max|v| / 127.
    let per_expert = r#"{"expanded_x":[[127,-127],[127,127]],"expanded_x_dtype":"i8","expanded_row_idx":[1,0],"expert_tokens":null,"expanded_scale":[0.031496063,0.015748031],"valid_rows":2}"#;
    // One smooth [2, 1] for both: row 1 -> (8, -8), row 0 -> (2, 2).
    let shared = r#"{"expanded_x":[[127,-127],[127,127]],"expanded_x_dtype":"i8","expanded_row_idx":[1,0],"expert_tokens":null,"expanded_scale":[0.062992126,0.015748031],"valid_rows":2}"#;
    assert_eq!(got, vec![per_expert, per_expert, shared, shared]);
}

// ---- Element types of x ----

#[test]
fn f16_bf16_and_i8_x_are_rounded_to_their_type_and_written_exactly() {
    // 1 + 2^-11 + 2^-40 is just above the midpoint of 1 and the next f16 (1 + 2^-10): it
    // rounds up when rounded once from the JSON number (through f32 it would tie to 1).
    let above_f16_midpoint = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
    let above_bf16_midpoint = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
    let f16_line = format!(
        r#"{{"x": [[0.1, {above_f16_midpoint:?}, 65519, -0.0], [1e-8, 3e-8, "-inf", 2]], "x_dtype": "f16", "expert_idx": [[1], [0]], "expert_num": 2}}"#
    );
    let bf16_line = format!(
        r#"{{"x": [[0.1, {above_bf16_midpoint:?}, 1.00390625, 1.01171875]], "x_dtype": "bf16", "expert_idx": [[0]], "expert_num": 1}}"#
    );
    let i8_line = r#"{"x": [[1, -128, 127.0], [0, 5, -7]], "x_dtype": "i8", "expert_idx": [[1], [0]], "expert_num": 2, "scale": [0.5, 2]}"#;
    let got = raw_lines(&[&f16_line, &bf16_line, i8_line]);
    assert_eq!(
        got,
        vec![
            // f16(0.1) = 0.0999755859375, shortest f32 spelling 0.099975586; 65519 -> 65504;
            // 1e-8 -> 0 (below half the smallest subnormal), 3e-8 -> 2^-24.
            r#"{"expanded_x":[[0.0,5.9604645e-8,"-inf",2.0],[0.099975586,1.0009766,65504.0,-0.0]],"expanded_x_dtype":"f16","expanded_row_idx":[1,0],"expert_tokens":null,"expanded_scale":null,"valid_rows":2}"#,
            // 1.00390625 = 1 + 2^-8 ties to even (1), 1.01171875 = 1 + 3 * 2^-8 ties to
            // 1 + 2^-6.
            r#"{"expanded_x":[[0.100097656,1.0078125,1.0,1.015625]],"expanded_x_dtype":"bf16","expanded_row_idx":[0],"expert_tokens":null,"expanded_scale":null,"valid_rows":1}"#,
            r#"{"expanded_x":[[0,5,-7],[1,-128,127]],"expanded_x_dtype":"i8","expanded_row_idx":[1,0],"expert_tokens":null,"expanded_scale":[2.0,0.5],"valid_rows":2}"#,
        ]
    );
}

#[test]
fn values_outside_x_dtype_are_errors_naming_their_place() {
    let line = |x: &str, dtype: &str| {
        json!({"x": serde_json::from_str::<Value>(x).unwrap(), "x_dtype": dtype,
               "expert_idx": [[0]], "expert_num": 1})
    };
    let cases = [
        (
            line("[[1, 1e39]]", "f32"),
            "x[0][1] = 1e39 is outside the f32 range",
        ),
        (
            line("[[65520, 1]]", "f16"),
            "x[0][0] = 6.552e4 is outside the f16 range",
        ),
        (
            line("[[-3.4e38]]", "bf16"),
            "x[0][0] = -3.4e38 is outside the bf16 range",
        ),
        (line("[[1, 1.5]]", "i8"), "x[0][1] = 1.5 is not an i8"),
        (line("[[128]]", "i8"), "x[0][0] = 128 is not an i8"),
        (line("[[\"nan\"]]", "i8"), "x[0][0] = NaN is not an i8"),
    ];
    let lines: Vec<Value> = cases.iter().map(|c| c.0.clone()).collect();
    let got = calls(&lines);
    for ((line, needle), answer) in cases.iter().zip(&got) {
        let (kind, message) = error_of(answer);
        assert_eq!(kind, "invalid_call", "{line}");
        assert!(message.contains(needle), "{needle:?} not in {message:?}");
    }
    // Within range at the edges: accepted.
    let got = calls(&[
        line("[[65519, -65504]]", "f16"),
        line("[[-128, 127]]", "i8"),
    ]);
    assert_eq!(got[0]["expanded_x"], json!([[65504.0, -65504.0]]));
    assert_eq!(got[1]["expanded_x"], json!([[-128, 127]]));
}

// ---- Answers equal the library's ----

/// The library's answer for a JSON call with f32 `x`, as the command writes it.
fn library_answer(call: &Value) -> Value {
    let rows: Vec<Vec<f32>> = serde_json::from_value(call["x"].clone()).unwrap();
    let ids: Vec<Vec<i32>> = serde_json::from_value(call["expert_idx"].clone()).unwrap();
    let x = rows.concat();
    let expert_idx = ids.concat();
    let scale: Option<Vec<f32>> = match &call["scale"] {
        Value::Null => None,
        Value::Array(a) if a.first().is_some_and(Value::is_array) => Some(
            serde_json::from_value::<Vec<Vec<f32>>>(call["scale"].clone())
                .unwrap()
                .concat(),
        ),
        s => Some(serde_json::from_value(s.clone()).unwrap()),
    };
    let offset: Option<Vec<f32>> = serde_json::from_value(call["offset"].clone()).unwrap();
    let int = |name: &str, default: i64| call[name].as_i64().unwrap_or(default);
    let range: Vec<i64> =
        serde_json::from_value(call["active_expert_range"].clone()).unwrap_or_default();
    let attrs = MoeInitRoutingAttrs {
        active_num: int("active_num", -1),
        expert_capacity: int("expert_capacity", -1),
        expert_num: int("expert_num", 0),
        drop_pad_mode: DropPadMode::try_from(int("drop_pad_mode", 0)).unwrap(),
        expert_tokens_num_type: ExpertTokensNumType::try_from(int("expert_tokens_num_type", 0))
            .unwrap(),
        expert_tokens_num_flag: call["expert_tokens_num_flag"] == json!(true),
        quant_mode: QuantMode::try_from(int("quant_mode", -1)).unwrap(),
        active_expert_range: (range.len() == 2).then(|| [range[0], range[1]]),
        row_idx_type: RowIdxType::try_from(int("row_idx_type", 0)).unwrap(),
    };
    let input = MoeInitRoutingInput {
        x: &x,
        num_rows: rows.len(),
        hidden_size: rows[0].len(),
        expert_idx: &expert_idx,
        k: ids[0].len(),
        scale: scale.as_deref(),
        offset: offset.as_deref(),
    };
    let out = match moe_init_routing(&input, &attrs) {
        Ok(out) => out,
        Err(e) => return json!({"error": {"kind": e.kind(), "message": e.to_string()}}),
    };
    // An f32 as serde_json spells it (shortest form), read back.
    let cell = |v: f32| serde_json::from_str::<Value>(&serde_json::to_string(&v).unwrap()).unwrap();
    let (flat, dtype): (Vec<Value>, &str) = match &out.expanded_x {
        ExpandedX::Unquantized(v) => (v.iter().map(|&v| cell(v)).collect(), "f32"),
        ExpandedX::Int8(v) => (v.iter().map(|&v| json!(v)).collect(), "i8"),
    };
    let shape = &out.expanded_x_shape;
    let h = *shape.last().unwrap();
    let rows: Vec<Value> = flat.chunks(h).map(|r| json!(r)).collect();
    let expanded_x = if shape.len() == 3 {
        json!(rows.chunks(shape[1]).map(|c| json!(c)).collect::<Vec<_>>())
    } else {
        json!(rows)
    };
    let key_value = attrs.expert_tokens_num_type == ExpertTokensNumType::KeyValue;
    json!({
        "expanded_x": expanded_x,
        "expanded_x_dtype": dtype,
        "expanded_row_idx": out.expanded_row_idx,
        "expert_tokens": out.expert_tokens.map(|t| if key_value {
            json!(t.chunks(2).map(|p| json!(p)).collect::<Vec<_>>())
        } else {
            json!(t)
        }),
        "expanded_scale": out.expanded_scale.map(|s| s.iter().map(|&v| cell(v)).collect::<Vec<_>>()),
        "valid_rows": out.valid_rows,
    })
}

#[test]
fn answers_equal_the_librarys_for_every_mode() {
    let mut s = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move |n: u64| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s % n
    };
    let mut lines = Vec::new();
    for i in 0..80 {
        let n = 1 + next(6) as usize;
        let k = 1 + next(3) as usize;
        let h = 1 + next(5) as usize;
        let e = 1 + next(6) as i64;
        let x: Vec<Vec<f32>> = (0..n)
            .map(|_| (0..h).map(|_| (next(2001) as f32 - 1000.0) / 8.0).collect())
            .collect();
        // Ids in -1..=E: invalid routes included.
        let ids: Vec<Vec<i32>> = (0..n)
            .map(|_| (0..k).map(|_| next(e as u64 + 2) as i32 - 1).collect())
            .collect();
        let mut call = json!({"x": x, "expert_idx": ids, "expert_num": e});
        let quant = [-1, -1, 0, 1][next(4) as usize];
        call["quant_mode"] = json!(quant);
        let drop_pad = i % 5 == 4;
        if drop_pad {
            call["drop_pad_mode"] = json!(1);
            call["expert_capacity"] = json!(1 + next(n as u64));
            call["expert_tokens_num_type"] = json!(1);
        } else {
            call["expert_tokens_num_type"] = json!(next(3));
            call["row_idx_type"] = json!(next(2));
            if next(3) == 0 {
                call["active_num"] = json!(next((n * k) as u64 + 2));
            }
            if next(3) == 0 {
                let start = next(e as u64) as i64;
                let end = start + 1 + next((e - start) as u64) as i64;
                call["active_expert_range"] = json!([start, end]);
            }
        }
        call["expert_tokens_num_flag"] = json!(next(2) == 0);
        match quant {
            -1 if next(2) == 0 => {
                call["scale"] = json!((0..n).map(|r| 0.25 * r as f32).collect::<Vec<_>>())
            }
            0 => {
                call["scale"] = json!([0.5 + next(4) as f32 / 4.0]);
                call["offset"] = json!([next(5) as f32 / 2.0 - 1.0]);
            }
            1 if next(2) == 0 => {
                let range = match call["active_expert_range"].as_array() {
                    Some(r) => r[1].as_i64().unwrap() - r[0].as_i64().unwrap(),
                    None => e,
                };
                let rows = if next(2) == 0 { 1 } else { range as usize };
                let smooth: Vec<Vec<f32>> = (0..rows)
                    .map(|_| (0..h).map(|_| 0.5 + next(8) as f32 / 4.0).collect())
                    .collect();
                call["scale"] = if next(2) == 0 {
                    json!(smooth)
                } else {
                    json!(smooth.concat())
                };
            }
            _ => {}
        }
        lines.push(call);
    }
    let got = calls(&lines);
    assert_eq!(got.len(), lines.len());
    let mut errors = 0;
    for (call, answer) in lines.iter().zip(&got) {
        assert_eq!(answer, &library_answer(call), "{call}");
        errors += answer.get("error").is_some() as usize;
    }
    assert!(errors < lines.len() / 4, "{errors} error answers");
}

// ---- Errors ----

#[test]
fn bad_calls_get_error_answers_naming_the_rule_and_the_next_lines_are_answered() {
    let ok = format!("{{{COMMON}}}");
    let cases: Vec<(String, &str, &str)> = vec![
        // Not JSON, or JSON of the wrong shape.
        (r#"{"x": [[1, 2"#.to_owned(), "invalid_json", "not valid JSON"),
        ("[1, 2]".to_owned(), "invalid_call", "a JSON object"),
        (
            r#"{"x": [[1]], "expert_idx": [[0]]}"#.to_owned(),
            "invalid_call",
            "missing field `expert_num`",
        ),
        (
            format!(r#"{{{COMMON}, "expert_nums": 4}}"#),
            "invalid_call",
            "unknown field `expert_nums`",
        ),
        (
            format!(r#"{{{COMMON}, "x_dtype": "f64"}}"#),
            "invalid_call",
            "x_dtype: unknown variant `f64`",
        ),
        // Row counts.
        (
            r#"{"x": [[1], [2]], "expert_idx": [[0], [1], [0]], "expert_num": 2}"#.to_owned(),
            "shape",
            "x has 2 rows but expert_idx has 3",
        ),
        (
            r#"{"x": [], "expert_idx": [], "expert_num": 2}"#.to_owned(),
            "shape",
            "x has no rows",
        ),
        // Attribute values.
        (
            format!(r#"{{{COMMON}, "drop_pad_mode": 2}}"#),
            "attribute",
            "drop_pad_mode must be 0 (dropless) or 1 (drop/pad)",
        ),
        (
            format!(r#"{{{COMMON}, "quant_mode": 2}}"#),
            "attribute",
            "quant_mode must be -1 (none), 0 (static int8) or 1 (dynamic int8)",
        ),
        (
            format!(r#"{{{COMMON}, "row_idx_type": -1}}"#),
            "attribute",
            "row_idx_type must be 0 (gather) or 1 (scatter)",
        ),
        (
            format!(r#"{{{COMMON}, "expert_tokens_num_type": 3}}"#),
            "attribute",
            "expert_tokens_num_type must be 0 (cumsum), 1 (count) or 2 (key-value)",
        ),
        (
            format!(r#"{{{COMMON}, "active_expert_range": [1]}}"#),
            "attribute",
            "active_expert_range must be [] or [start, end]",
        ),
        (
            format!(r#"{{{COMMON}, "active_expert_range": [2, 2]}}"#),
            "attribute",
            "0 <= start < end <= expert_num",
        ),
        (
            r#"{"x": [[1]], "expert_idx": [[0]], "expert_num": 0}"#.to_owned(),
            "attribute",
            "1 <= expert_num <= 10240",
        ),
        (
            r#"{"x": [[1]], "expert_idx": [[0]], "expert_num": 5121, "expert_tokens_num_type": 2}"#
                .to_owned(),
            "attribute",
            "1 <= expert_num <= 5120 when expert_tokens_num_type is 2",
        ),
        (
            format!(r#"{{{COMMON}, "active_num": -2}}"#),
            "attribute",
            "active_num must be -1 or 0",
        ),
        (
            format!(
                r#"{{{COMMON}, "drop_pad_mode": 1, "expert_capacity": 4, "expert_tokens_num_type": 1}}"#
            ),
            "attribute",
            "drop/pad mode requires 1 <= expert_capacity <= N",
        ),
        // Combinations.
        (
            format!(
                r#"{{{COMMON}, "drop_pad_mode": 1, "expert_capacity": 2, "expert_tokens_num_type": 0}}"#
            ),
            "combination",
            "drop/pad mode requires expert_tokens_num_type 1 (count)",
        ),
        (
            format!(
                r#"{{{COMMON}, "drop_pad_mode": 1, "expert_capacity": 2, "expert_tokens_num_type": 1, "row_idx_type": 1}}"#
            ),
            "combination",
            "drop/pad mode requires row_idx_type 0 (gather)",
        ),
        (
            format!(
                r#"{{{COMMON}, "drop_pad_mode": 1, "expert_capacity": 2, "expert_tokens_num_type": 1, "active_expert_range": [0, 2]}}"#
            ),
            "combination",
            "drop/pad mode requires active_expert_range = [0, expert_num)",
        ),
        (
            r#"{"x": [[1]], "x_dtype": "i8", "expert_idx": [[0]], "expert_num": 1, "quant_mode": 1}"#
                .to_owned(),
            "combination",
            "i8 x cannot be quantised",
        ),
        // Shapes.
        (
            r#"{"x": [[1, 2], [3]], "expert_idx": [[0], [0]], "expert_num": 1}"#.to_owned(),
            "shape",
            "x: row 1 has 1 values, but row 0 has 2",
        ),
        (
            r#"{"x": [[1], [2]], "expert_idx": [[0, 1], [0]], "expert_num": 2}"#.to_owned(),
            "shape",
            "expert_idx: row 1 has 1 values, but row 0 has 2",
        ),
        (
            r#"{"x": [[1], [2]], "expert_idx": [[0]], "expert_num": 1}"#.to_owned(),
            "shape",
            "x has 2 rows but expert_idx has 1",
        ),
        (
            format!(r#"{{{COMMON}, "scale": [1, 2]}}"#),
            "shape",
            "without quantisation scale must be [N] = [3]",
        ),
        (
            format!(r#"{{{COMMON}, "quant_mode": 0, "scale": [1]}}"#),
            "shape",
            "offset: static quantisation (quant_mode 0) requires it",
        ),
        (
            format!(r#"{{{COMMON}, "quant_mode": 1, "scale": [[1, 2], [3]]}}"#),
            "shape",
            "scale: row 1 has 1 values, but row 0 has 2",
        ),
        (
            format!(r#"{{{COMMON}, "quant_mode": 1, "scale": [1, 2, 3]}}"#),
            "shape",
            "dynamic quantisation takes a smooth scale [1, H] = [1, 2] or [end - start, H] = [4, 2]",
        ),
        (
            format!(r#"{{{COMMON}, "offset": [0]}}"#),
            "shape",
            "offset is only taken with static quantisation",
        ),
        // Non-finite values that cannot be quantised.
        (
            format!(r#"{{{COMMON}, "quant_mode": 0, "scale": ["inf"], "offset": [0]}}"#),
            "non_finite",
            "static quantisation parameters must be finite",
        ),
        (
            r#"{"x": [[1, "nan"]], "expert_idx": [[0]], "expert_num": 1, "quant_mode": 1}"#
                .to_owned(),
            "non_finite",
            "dynamic quantisation needs every x * smooth scale to be finite",
        ),
    ];
    let input: String = cases
        .iter()
        .flat_map(|c| [c.0.as_str(), ok.as_str()])
        .map(|l| format!("{l}\n"))
        .collect();
    let out = run(&[], &input);
    // Every call got an answer: exit 0.
    let got = answers(&out);
    assert_eq!(got.len(), 2 * cases.len());
    for (i, (line, kind, needle)) in cases.iter().enumerate() {
        let (k, m) = error_of(&got[2 * i]);
        assert_eq!(k, *kind, "{line}: {m}");
        assert!(m.contains(needle), "{line}: {needle:?} not in {m:?}");
        assert_eq!(got[2 * i + 1]["valid_rows"], json!(6), "after {line}");
    }
}

#[test]
fn wrong_json_types_name_the_field_path() {
    let cases = [
        (
            r#""x": [[1, true]]"#,
            "x[0][1]: invalid type: boolean `true`",
        ),
        (
            r#""x": [1, 2]"#,
            "x[0]: invalid type: integer `1`, expected a sequence",
        ),
        (
            r#""x": [[1]], "expert_idx": [[0.5]]"#,
            "expert_idx[0][0]: invalid type: floating point",
        ),
        (
            r#""x": [[1]], "expert_idx": [[3000000000]]"#,
            "expert_idx[0][0]: invalid value: integer `3000000000`",
        ),
        (
            r#""x": [[1]], "expert_tokens_num_flag": 1"#,
            "expert_tokens_num_flag: invalid type: integer `1`, expected a boolean",
        ),
        (
            r#""x": [[1]], "active_num": "4""#,
            "active_num: invalid type: string \"4\"",
        ),
        (
            r#""x": [[1]], "active_expert_range": [0, "2"]"#,
            "active_expert_range[1]: invalid type: string \"2\"",
        ),
        (
            r#""x": [[1]], "scale": [1, true]"#,
            "scale[1]: invalid type: boolean `true`",
        ),
        (
            r#""x": [[1]], "scale": [[1], [true]]"#,
            "scale[1][0]: invalid type: boolean `true`",
        ),
        (
            r#""x": [[1]], "scale": [1, [2]]"#,
            "scale: element 1 is a list but element 0 is a number",
        ),
        (
            r#""x": [[1]], "offset": 0.5"#,
            "offset: invalid type: floating point `0.5`, expected a list",
        ),
        (
            r#""x": [[1]], "x_dtype": 8"#,
            "x_dtype: invalid type: integer `8`, expected a string",
        ),
    ];
    let lines: Vec<Value> = cases
        .iter()
        .map(|(fields, _)| {
            let mut call: Value = serde_json::from_str(&format!("{{{fields}}}")).unwrap();
            let obj = call.as_object_mut().unwrap();
            obj.entry("expert_idx").or_insert(json!([[0]]));
            obj.insert("expert_num".into(), json!(1));
            call
        })
        .collect();
    let got = calls(&lines);
    for ((fields, needle), answer) in cases.iter().zip(&got) {
        let (kind, message) = error_of(answer);
        assert_eq!(kind, "invalid_call", "{fields}");
        assert!(
            message.starts_with(needle),
            "{needle:?} does not start {message:?}"
        );
    }
}

#[test]
fn nulls_are_defaults_and_blank_lines_are_skipped() {
    let line = format!(
        r#"{{{COMMON}, "scale": null, "offset": null, "x_dtype": null, "active_num": null, "active_expert_range": [], "row_idx_type": null}}"#
    );
    let input = format!("\u{feff}{line}\n\n  \t\r\n{line}\r\n");
    let got = answers(&run(&[], &input));
    assert_eq!(got.len(), 2);
    assert_eq!(got[0]["expanded_row_idx"], json!([4, 0, 2, 5, 1, 3]));
    assert_eq!(got[0]["expert_tokens"], Value::Null);
}

#[test]
fn input_files_and_exit_statuses() {
    let dir = temp_dir("input");
    let file = dir.join("calls.jsonl");
    std::fs::write(&file, format!("{{{COMMON}}}\n")).unwrap();
    let got = answers(&run(&["--input", file.to_str().unwrap()], ""));
    assert_eq!(got[0]["valid_rows"], json!(6));
    // An unreadable input is a failure at run time: exit 1 with one error line.
    for path in [dir.join("missing.jsonl"), dir.clone()] {
        let out = run(&["--input", path.to_str().unwrap()], "");
        assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
        assert!(text(&out.stderr).starts_with("error: cannot open"));
        assert_eq!(text(&out.stderr).lines().count(), 1);
    }
    // Bad flags: clap's usage message, exit 2 (--tensors needs --attrs, and --attrs needs
    // --tensors).
    for args in [
        &["--attrs", "{}"][..],
        &["--tensors", "t.safetensors"],
        &["--bogus"],
        &["--input", "x", "--tensors", "y", "--attrs", "{}"],
    ] {
        let out = run(args, "");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
    }
}

// ---- Safetensors ----

fn run_tensors(path: &Path, attrs: &str) -> Output {
    run(&["--tensors", path.to_str().unwrap(), "--attrs", attrs], "")
}

const COMMON_X: [f32; 6] = [1.0, 10.0, 2.0, 20.0, 3.0, 30.0];
const COMMON_IDS: [i32; 6] = [2, 0, 1, 2, 0, 1];

#[test]
fn safetensors_calls_give_the_json_calls_answers() {
    let dir = temp_dir("tensors");
    let count = r#"{"expert_num": 4, "expert_tokens_num_type": 1, "expert_tokens_num_flag": true}"#;
    let json_answer = |extra: &str| {
        raw_lines(&[&format!(
            r#"{{{COMMON}, "expert_tokens_num_type": 1, "expert_tokens_num_flag": true{extra}}}"#
        )])
        .remove(0)
    };
    let x_forms = [
        (Dtype::F32, f32_bytes(&COMMON_X), "f32"),
        (Dtype::F16, f16_bytes(&COMMON_X), "f16"),
        (Dtype::BF16, bf16_bytes(&COMMON_X), "bf16"),
        (
            Dtype::I8,
            COMMON_X.iter().map(|&v| v as i8 as u8).collect(),
            "i8",
        ),
    ];
    let ids_forms = [
        (Dtype::I32, i32_bytes(&COMMON_IDS)),
        (Dtype::I64, i64_bytes(&COMMON_IDS.map(i64::from))),
    ];
    for (x_dtype, x_bytes, name) in &x_forms {
        for (ids_dtype, ids_bytes) in &ids_forms {
            let path = dir.join(format!("{name}-{ids_dtype:?}.safetensors"));
            write_tensors(
                &path,
                &[
                    ("x", *x_dtype, vec![3, 2], x_bytes.clone()),
                    ("expert_idx", *ids_dtype, vec![3, 2], ids_bytes.clone()),
                    ("scale", Dtype::F32, vec![3], f32_bytes(&[0.5, 0.25, 0.125])),
                ],
            );
            let out = run_tensors(&path, count);
            assert!(out.status.success(), "{}", text(&out.stderr));
            let want = json_answer(&format!(
                r#", "x_dtype": "{name}", "scale": [0.5, 0.25, 0.125]"#
            ));
            assert_eq!(
                text(&out.stdout),
                format!("{want}\n"),
                "{name} {ids_dtype:?}"
            );
        }
    }
    // Static int8 with scale and offset, attributes from a file.
    let path = dir.join("static.safetensors");
    write_tensors(
        &path,
        &[
            (
                "x",
                Dtype::F32,
                vec![2, 4],
                f32_bytes(&[0.25, 1.0, 100.0, -70.0, -0.75, 0.0, -1.25, 63.0]),
            ),
            ("expert_idx", Dtype::I32, vec![2, 1], i32_bytes(&[1, 0])),
            ("scale", Dtype::F32, vec![1], f32_bytes(&[2.0])),
            ("offset", Dtype::F32, vec![1], f32_bytes(&[0.5])),
        ],
    );
    let attrs = dir.join("attrs.json");
    std::fs::write(&attrs, r#"{"expert_num": 2, "quant_mode": 0}"#).unwrap();
    let out = run_tensors(&path, attrs.to_str().unwrap());
    assert_eq!(
        text(&out.stdout),
        "{\"expanded_x\":[[-1,0,-2,126],[1,2,127,-128]],\"expanded_x_dtype\":\"i8\",\"expanded_row_idx\":[1,0],\"expert_tokens\":null,\"expanded_scale\":null,\"valid_rows\":2}\n"
    );
    // Dynamic int8 with a [E, H] smooth scale of rank 2.
    let path = dir.join("dynamic.safetensors");
    write_tensors(
        &path,
        &[
            (
                "x",
                Dtype::F32,
                vec![2, 2],
                f32_bytes(&[1.0, 2.0, 4.0, -8.0]),
            ),
            ("expert_idx", Dtype::I32, vec![2, 1], i32_bytes(&[1, 0])),
            (
                "scale",
                Dtype::F32,
                vec![2, 2],
                f32_bytes(&[1.0, 0.5, 2.0, 1.0]),
            ),
        ],
    );
    let got = answers(&run_tensors(&path, r#"{"expert_num": 2, "quant_mode": 1}"#));
    assert_eq!(got[0]["expanded_x"], json!([[127, -127], [127, 127]]));
}

#[test]
fn safetensors_call_errors_are_answers_and_unusable_inputs_exit_1() {
    let dir = temp_dir("tensor-errors");
    let base = || {
        vec![
            ("x", Dtype::F32, vec![3, 2], f32_bytes(&COMMON_X)),
            ("expert_idx", Dtype::I32, vec![3, 2], i32_bytes(&COMMON_IDS)),
        ]
    };
    let attrs = r#"{"expert_num": 4}"#;
    let mut cases: Vec<(Vec<TensorSpec<'_>>, &str, &str, &str)> = Vec::new();
    let mut c = base();
    c.remove(1);
    cases.push((c, attrs, "invalid_call", "no tensor named `expert_idx`"));
    let mut c = base();
    c.push(("bias", Dtype::F32, vec![1], f32_bytes(&[0.0])));
    cases.push((c, attrs, "invalid_call", "unknown tensor `bias`"));
    let mut c = base();
    c[0] = ("x", Dtype::F64, vec![3, 2], vec![0; 48]);
    cases.push((
        c,
        attrs,
        "dtype",
        "tensor `x` is F64: expected F32, F16, BF16 or I8",
    ));
    let mut c = base();
    c[1] = ("expert_idx", Dtype::U8, vec![3, 2], vec![0; 6]);
    cases.push((c, attrs, "dtype", "tensor `expert_idx` is U8"));
    let mut c = base();
    c[1] = (
        "expert_idx",
        Dtype::I64,
        vec![3, 2],
        i64_bytes(&[0, 1, 1 << 32, 0, 1, 2]),
    );
    cases.push((c, attrs, "invalid_call", "expert ids must fit in i32"));
    let mut c = base();
    c.push(("scale", Dtype::F16, vec![3], f16_bytes(&[1.0; 3])));
    cases.push((c, attrs, "dtype", "tensor `scale` is F16: expected F32"));
    let mut c = base();
    c[0] = ("x", Dtype::F32, vec![6], f32_bytes(&COMMON_X));
    cases.push((
        c,
        attrs,
        "shape",
        "tensor `x` has shape [6]: expected rank 2",
    ));
    let mut c = base();
    c[1] = ("expert_idx", Dtype::I32, vec![2, 3], i32_bytes(&COMMON_IDS));
    cases.push((c, attrs, "shape", "x has 3 rows but expert_idx has 2"));
    // Attribute values are answered, as on a JSON line.
    cases.push((
        base(),
        r#"{"expert_num": 4, "drop_pad_mode": 7}"#,
        "attribute",
        "drop_pad_mode must be 0 (dropless) or 1 (drop/pad)",
    ));
    cases.push((
        base(),
        r#"{"expert_num": 4, "quant_mode": 0}"#,
        "shape",
        "scale: static quantisation (quant_mode 0) requires it",
    ));
    for (i, (tensors, attrs, kind, needle)) in cases.into_iter().enumerate() {
        let path = dir.join(format!("case{i}.safetensors"));
        write_tensors(&path, &tensors);
        let got = answers(&run_tensors(&path, attrs));
        let (k, m) = error_of(&got[0]);
        assert_eq!(k, kind, "case {i}: {m}");
        assert!(m.contains(needle), "case {i}: {needle:?} not in {m:?}");
    }
    // Exit 1: not a file, not safetensors, a bad --attrs file; exit 2: a bad inline --attrs.
    let bad_attrs_file = dir.join("bad-attrs.json");
    std::fs::write(&bad_attrs_file, r#"{"expert_num": 4,"#).unwrap();
    let good = dir.join("good.safetensors");
    write_tensors(&good, &base());
    let junk = dir.join("junk.safetensors");
    std::fs::write(&junk, b"not a safetensors file").unwrap();
    for (path, attrs, status, needle) in [
        (
            dir.join("missing.safetensors"),
            attrs,
            1,
            "cannot read --tensors",
        ),
        (junk, attrs, 1, "not a safetensors file"),
        (good.clone(), "{}", 2, "--attrs: missing field `expert_num`"),
        (
            good.clone(),
            r#"{"expert_num": 4, "x_dtype": "f16"}"#,
            2,
            "--attrs: x_dtype: unknown field `x_dtype`",
        ),
        (
            good.clone(),
            r#"{"expert_num": "4"}"#,
            2,
            "--attrs: expert_num: invalid type",
        ),
        (
            good.clone(),
            "nonsense",
            1,
            "neither a readable file nor a JSON object",
        ),
        (
            good.clone(),
            "{\"expert_num\": 4,",
            2,
            "neither a readable file nor a JSON object",
        ),
        (
            good,
            bad_attrs_file.to_str().unwrap(),
            1,
            "bad-attrs.json: invalid JSON",
        ),
    ] {
        let out = run_tensors(&path, attrs);
        assert_eq!(out.status.code(), Some(status), "{path:?} {attrs:?}");
        let err = text(&out.stderr);
        assert!(err.starts_with("error: ") && err.contains(needle), "{err}");
        assert!(out.stdout.is_empty());
    }
}

/// An output larger than memory is an `allocation` error answer, and the next line is still
/// answered (the address space is capped at 3 GB so the outcome does not depend on the
/// machine: N = 1, K = H = 100,000 asks for a 40 GB expanded_x).
#[cfg(unix)]
#[test]
fn an_output_larger_than_memory_is_an_error_answer() {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let n = 100_000;
    let ones = vec!["1"; n].join(",");
    let zeros = vec!["0"; n].join(",");
    let input = format!(
        "{{\"x\": [[{ones}]], \"expert_idx\": [[{zeros}]], \"expert_num\": 1}}\n{{{COMMON}}}\n"
    );
    let mut child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 3000000 && exec \"$0\" moe-init-routing")
        .arg(env!("CARGO_BIN_EXE_nucleus"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run nucleus under sh");
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    let got = answers(&out);
    assert_eq!(got.len(), 2, "{}", text(&out.stderr));
    let (kind, message) = error_of(&got[0]);
    assert_eq!(kind, "allocation", "{message}");
    assert!(
        message.contains("expanded_x") && message.contains("40000000000 bytes"),
        "{message}"
    );
    assert_eq!(got[1]["valid_rows"], 6);
}

/// An `expanded_x` that fits in memory once but not twice (400 MB of f32 under a 1 GB
/// address space) is answered in full, written straight from the operator's output, and the
/// next line is still answered. Before, the answer copied `expanded_x` (and then serialised
/// it into a third buffer) and the run aborted: "memory allocation of 536870912 bytes failed".
#[cfg(unix)]
#[test]
fn an_expanded_x_that_fits_once_but_not_twice_is_answered() {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::process::{Command, Stdio};
    let (h, k) = (10_000, 10_000);
    let zeros = |n: usize| vec!["0"; n].join(",");
    let input = format!(
        "{{\"x\": [[{}]], \"expert_idx\": [[{}]], \"expert_num\": 1}}\n{{{COMMON}}}\n",
        zeros(h),
        zeros(k)
    );
    let mut child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 1000000 && exec \"$0\" moe-init-routing")
        .arg(env!("CARGO_BIN_EXE_nucleus"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run nucleus under sh");
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let mut stdout = BufReader::with_capacity(1 << 20, child.stdout.take().unwrap());
    // The first answer, 400 MB, read in pieces: its start, its length, its end.
    let mut head = vec![0u8; 32];
    stdout.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"{\"expanded_x\":[[0.0,0.0,0.0,0.0,");
    let mut len = head.len();
    let mut tail = Vec::new();
    loop {
        let buf = stdout.fill_buf().unwrap();
        assert!(!buf.is_empty(), "the first answer ends early");
        match buf.iter().position(|&b| b == b'\n') {
            Some(i) => {
                tail.extend_from_slice(&buf[..i]);
                len += i;
                stdout.consume(i + 1);
                break;
            }
            None => {
                let n = buf.len();
                tail.extend_from_slice(buf);
                tail.drain(..tail.len().saturating_sub(200));
                len += n;
                stdout.consume(n);
            }
        }
    }
    let tail = String::from_utf8_lossy(&tail[tail.len().saturating_sub(120)..]).into_owned();
    assert!(
        tail.ends_with(
            r#"9998,9999],"expert_tokens":null,"expanded_scale":null,"valid_rows":10000}"#
        ),
        "{tail}"
    );
    // [K rows][H values] of "0.0", and the row indices 0..K.
    let row_idx: usize = (0..k).map(|i| i.to_string().len() + 1).sum();
    assert!(len > 4 * h * k + row_idx, "{len} bytes");
    let mut second = String::new();
    stdout.read_line(&mut second).unwrap();
    let second: Value = serde_json::from_str(&second).unwrap();
    assert_eq!(second["valid_rows"], 6);
    let status = child.wait().unwrap();
    writer.join().unwrap().unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(status.success(), "{err}");
}
