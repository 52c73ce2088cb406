//! Tool definitions as the TypeScript-like text the model was trained on:
//!
//! ```text
//! ## functions
//!
//! namespace functions {
//!
//! // Gets the current weather in the provided location.
//! type get_current_weather = (_: {
//! // The city and state, e.g. San Francisco, CA
//! location: string,
//! format?: "celsius" | "fahrenheit", // default: celsius
//! }) => any;
//!
//! } // namespace functions
//! ```
//!
//! A line-by-line port of `json_schema_to_typescript` and `template_tools_section` of the
//! official library (openai/harmony 0.0.8, `src/encoding.rs`, Apache-2.0), quirks included:
//! the output must be byte-identical to what the model saw in training.

use std::collections::{BTreeMap, HashSet};

use super::json::JsonValue;
use super::message::ToolNamespace;

fn is_enum(schema: &JsonValue) -> bool {
    schema.get("enum").and_then(JsonValue::as_array).is_some_and(|a| !a.is_empty())
}

fn is_nullable(schema: &JsonValue) -> bool {
    schema.get("nullable").and_then(JsonValue::as_bool).unwrap_or(false)
}

/// `default: ...` as a trailing or standalone comment body.
fn default_comment(schema: &JsonValue, default: &JsonValue) -> String {
    match default.as_str() {
        Some(s) if !is_enum(schema) => format!("default: \"{s}\""),
        Some(s) => format!("default: {s}"),
        None => format!("default: {default}"),
    }
}

/// With `| null` appended when the schema is nullable and the type does not mention null.
fn with_null(schema: &JsonValue, ty: String) -> String {
    if is_nullable(schema) && !ty.contains("null") { format!("{ty} | null") } else { ty }
}

/// The TypeScript type of a JSON schema.
pub(crate) fn json_schema_to_typescript(schema: &JsonValue, indent: &str) -> String {
    if let Some(variants) = schema.get("oneOf").and_then(JsonValue::as_array) {
        let mut out = String::new();
        for (i, variant) in variants.iter().enumerate() {
            if i > 0 {
                out.push('\n');
                out.push_str(&format!("{indent} | "));
            } else {
                out.push_str(&format!("\n{indent} | "));
            }
            let ty = json_schema_to_typescript(variant, &format!("{indent}   "));
            out.push_str(&with_null(variant, ty));
            let mut trailing = Vec::new();
            if let Some(desc) = variant.get("description").and_then(JsonValue::as_str) {
                trailing.push(desc.to_string());
            }
            if let Some(default) = variant.get("default") {
                // The official top-level branch quotes string defaults only for non-enums and
                // otherwise prints JSON (quoted) even for enums.
                trailing.push(match default.as_str() {
                    Some(s) if !is_enum(variant) => format!("default: \"{s}\""),
                    _ => format!("default: {default}"),
                });
            }
            if !trailing.is_empty() {
                out.push_str(&format!(" // {}", trailing.join(" ")));
            }
        }
        return out;
    }
    if let Some(types) = schema.get("type").and_then(JsonValue::as_array) {
        let names: Vec<&str> = types
            .iter()
            .filter_map(JsonValue::as_str)
            .map(|t| if t == "integer" { "number" } else { t })
            .collect();
        if !names.is_empty() {
            return names.join(" | ");
        }
    }
    match schema.get("type").and_then(JsonValue::as_str) {
        Some("object") => object_to_typescript(schema, indent),
        Some("string") => {
            let enums: Vec<String> = schema
                .get("enum")
                .and_then(JsonValue::as_array)
                .unwrap_or_default()
                .iter()
                .filter_map(|v| v.as_str().map(|s| format!("\"{s}\"")))
                .collect();
            if enums.is_empty() { "string".to_string() } else { enums.join(" | ") }
        }
        Some("number") | Some("integer") => "number".to_string(),
        Some("boolean") => "boolean".to_string(),
        Some("array") => match schema.get("items") {
            Some(items) => format!("{}[]", json_schema_to_typescript(items, indent)),
            None => "Array<any>".to_string(),
        },
        _ => "any".to_string(),
    }
}

fn object_to_typescript(schema: &JsonValue, indent: &str) -> String {
    let mut out = String::new();
    if let Some(desc) = schema.get("description").and_then(JsonValue::as_str) {
        out.push_str(&format!("{indent}// {desc}\n"));
    }
    out.push_str("{\n");
    if let Some(props) = schema.get("properties").and_then(JsonValue::as_object) {
        let required: HashSet<&str> = schema
            .get("required")
            .and_then(JsonValue::as_array)
            .unwrap_or_default()
            .iter()
            .filter_map(JsonValue::as_str)
            .collect();
        for (key, val) in props {
            let optional = if required.contains(key.as_str()) { "" } else { "?" };
            if let Some(title) = val.get("title").and_then(JsonValue::as_str) {
                out.push_str(&format!("{indent}// {title}\n{indent}//\n"));
            }
            if val.get("oneOf").is_none()
                && let Some(desc) = val.get("description").and_then(JsonValue::as_str)
            {
                out.push_str(&format!("{indent}// {desc}\n"));
            }
            if let Some(examples) = val.get("examples").and_then(JsonValue::as_array)
                && !examples.is_empty()
            {
                out.push_str(&format!("{indent}// Examples:\n"));
                for ex in examples.iter().filter_map(JsonValue::as_str) {
                    out.push_str(&format!("{indent}// - \"{ex}\"\n"));
                }
            }
            if let Some(variants) = val.get("oneOf").and_then(JsonValue::as_array) {
                one_of_property(&mut out, key, optional, val, variants, indent);
                continue;
            }
            out.push_str(&format!("{indent}{key}{optional}: "));
            let ty = json_schema_to_typescript(val, &format!("{indent}    "));
            out.push_str(&with_null(val, ty));
            out.push(',');
            // A non-array `oneOf` still suppresses the default comment, as upstream.
            if val.get("oneOf").is_none()
                && let Some(default) = val.get("default")
            {
                out.push_str(&format!(" // {}", default_comment(val, default)));
            }
            out.push('\n');
        }
    }
    out.push_str(&format!("{indent}}}"));
    out
}

/// A property whose schema is a `oneOf`: comments above, then one `| type` line per variant.
fn one_of_property(
    out: &mut String,
    key: &str,
    optional: &str,
    val: &JsonValue,
    variants: &[JsonValue],
    indent: &str,
) {
    let property_desc = val.get("description").and_then(JsonValue::as_str);
    let first_desc = variants.first().and_then(|v| v.get("description")).and_then(JsonValue::as_str);
    let skip_property_desc = property_desc.is_some() && property_desc == first_desc;
    let mut desc_above = false;
    if !skip_property_desc && let Some(desc) = property_desc {
        out.push_str(&format!("{indent}// {desc}\n"));
        desc_above = true;
    }
    if let Some(default) = val.get("default") {
        out.push_str(&format!("{indent}// {}\n", default_comment(val, default)));
    }
    out.push_str(&format!("{indent}{key}{optional}:\n"));
    for (i, variant) in variants.iter().enumerate() {
        out.push_str(&format!("{indent} | "));
        let ty = json_schema_to_typescript(variant, &format!("{indent}   "));
        out.push_str(&with_null(variant, ty));
        let mut trailing = Vec::new();
        if !(i == 0 && desc_above)
            && let Some(desc) = variant.get("description").and_then(JsonValue::as_str)
            && Some(desc) != property_desc
        {
            trailing.push(desc.to_string());
        }
        if let Some(default) = variant.get("default") {
            trailing.push(default_comment(variant, default));
        }
        if !trailing.is_empty() {
            out.push_str(&format!(" // {}", trailing.join(" ")));
        }
        out.push('\n');
    }
    out.push_str(&format!("{indent},\n"));
}

/// The `# Tools` section of a system or developer message.
pub(crate) fn tools_section(tools: &BTreeMap<String, ToolNamespace>) -> String {
    let mut sections = vec!["# Tools".to_string()];
    for ns in tools.values() {
        let mut lines = vec![format!("## {}\n", ns.name)];
        if let Some(desc) = &ns.description {
            for line in desc.lines() {
                lines.push(if ns.tools.is_empty() { line.to_string() } else { format!("// {line}") });
            }
        }
        if !ns.tools.is_empty() {
            lines.push(format!("namespace {} {{\n", ns.name));
            for tool in &ns.tools {
                for line in tool.description.lines() {
                    lines.push(format!("// {line}"));
                }
                match &tool.parameters {
                    Some(params) => lines.push(format!(
                        "type {} = (_: {}) => any;\n",
                        tool.name,
                        json_schema_to_typescript(params, "")
                    )),
                    None => lines.push(format!("type {} = () => any;\n", tool.name)),
                }
            }
            lines.push(format!("}} // namespace {}", ns.name));
        }
        sections.push(lines.join("\n"));
    }
    sections.join("\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(schema: &str) -> String {
        json_schema_to_typescript(&schema.parse().unwrap(), "")
    }

    #[test]
    fn basic_types() {
        assert_eq!(ts(r#"{"type": "integer"}"#), "number");
        assert_eq!(ts(r#"{"type": ["integer", "null"]}"#), "number | null");
        assert_eq!(ts(r#"{"type": "array"}"#), "Array<any>");
        assert_eq!(ts(r#"{"type": "array", "items": {"type": "boolean"}}"#), "boolean[]");
        assert_eq!(ts(r#"{"type": "string", "enum": ["a", 1, "b"]}"#), r#""a" | "b""#);
        assert_eq!(ts(r#"{}"#), "any");
        assert_eq!(ts(r#"[1, 2]"#), "any");
    }

    #[test]
    fn object_with_defaults() {
        let out = ts(r#"{"type": "object", "properties": {
            "b": {"type": "string", "default": "x"},
            "a": {"type": "number", "default": 0.5, "description": "A"}}, "required": ["a"]}"#);
        assert_eq!(out, "{\nb?: string, // default: \"x\"\n// A\na: number, // default: 0.5\n}");
    }
}
