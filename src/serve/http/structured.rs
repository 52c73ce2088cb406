//! Structured output and forced tool calls: a request's `response_format` (Chat
//! Completions) or `text.format` (Responses) and `tool_choice`, turned into the grammar of
//! the assistant turn ([`crate::constrain`]). Both APIs' spellings are read here, so the
//! two endpoints enforce the same things the same way; every error is a 400 naming the
//! parameter at fault.

use std::sync::Arc;

use serde_json::Value;

use super::error::ApiError;
use crate::chat::ToolDescription;
use crate::constrain::{AnswerFormat, FunctionRule, Grammar, GrammarPart, ToolRule, TurnSpec, Vocabulary};

/// How the request lets the model use its tools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ToolChoice {
    /// `auto` (or absent): the model decides.
    Auto,
    /// `none`: no tool calls.
    None,
    /// `required`: the turn ends in a call of one of the tools.
    Required,
    /// A named function: the turn ends in a call of it.
    Named(String),
}

/// Reads `tool_choice`: `"auto"`, `"none"`, `"required"`, or a named function in either
/// API's spelling (`{"type": "function", "function": {"name": N}}` or
/// `{"type": "function", "name": N}`).
pub(crate) fn tool_choice(value: Option<&Value>) -> Result<ToolChoice, ApiError> {
    let bad = || {
        ApiError::invalid(
            Some("tool_choice"),
            "tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", ...} naming a \
             function",
        )
    };
    match value {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" => Ok(ToolChoice::Required),
            _ => Err(bad()),
        },
        Some(Value::Object(o)) => {
            match o.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(other) => {
                    return Err(ApiError::unsupported(
                        "tool_choice.type",
                        format!("only function tools can be chosen, got type {other:?}"),
                    ));
                }
                None => return Err(bad()),
            }
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| o.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::invalid(Some("tool_choice"), "tool_choice needs the function's `name`")
                })?;
            Ok(ToolChoice::Named(name.to_string()))
        }
        Some(_) => Err(bad()),
    }
}

/// Where the answer's format is in a request, and how it is spelled.
#[derive(Clone, Copy, Debug)]
pub(crate) enum FormatSpelling {
    /// Chat Completions: `response_format: {"type": "json_schema", "json_schema": {"name",
    /// "schema", "strict"}}`.
    ResponseFormat,
    /// Responses: `text.format: {"type": "json_schema", "name", "schema", "strict"}`.
    TextFormat,
}

impl FormatSpelling {
    fn param(self) -> &'static str {
        match self {
            FormatSpelling::ResponseFormat => "response_format",
            FormatSpelling::TextFormat => "text.format",
        }
    }

    /// The parameter of the schema itself.
    fn schema_param(self) -> &'static str {
        match self {
            FormatSpelling::ResponseFormat => "response_format.json_schema.schema",
            FormatSpelling::TextFormat => "text.format.schema",
        }
    }
}

/// A `json_schema` answer format: its name (for the model's instructions) and the format.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct NamedFormat {
    /// `name` of the format (`response` when absent).
    pub name: String,
    /// The format.
    pub format: AnswerFormat,
}

/// Reads the answer's format: `text` (or absent), `json_object` or `json_schema`.
pub(crate) fn answer_format(
    value: Option<&Value>,
    spelling: FormatSpelling,
) -> Result<NamedFormat, ApiError> {
    let param = spelling.param();
    let text = NamedFormat { name: String::new(), format: AnswerFormat::Text };
    let Some(value) = value.filter(|v| !v.is_null()) else { return Ok(text) };
    let kind_param = format!("{param}.type");
    let kind = value
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid(Some(&kind_param), format!("{param} needs a string `type`")))?;
    match kind {
        "text" => Ok(text),
        "json_object" => Ok(NamedFormat { name: String::new(), format: AnswerFormat::JsonObject }),
        "json_schema" => {
            let body = match spelling {
                FormatSpelling::ResponseFormat => value.get("json_schema").ok_or_else(|| {
                    ApiError::invalid(
                        Some("response_format.json_schema"),
                        "a json_schema format needs `json_schema`",
                    )
                })?,
                FormatSpelling::TextFormat => value,
            };
            let schema_param = spelling.schema_param();
            let schema = match body.get("schema") {
                Some(s @ Value::Object(_)) => s.clone(),
                // OpenAI treats a missing schema as any JSON object.
                None | Some(Value::Null) => serde_json::json!({"type": "object"}),
                Some(_) => {
                    return Err(ApiError::invalid(Some(schema_param), "the schema must be a JSON object"));
                }
            };
            let strict = match body.get("strict") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    let p = schema_param.replace(".schema", ".strict");
                    return Err(ApiError::invalid(Some(&p), "strict must be a boolean"));
                }
            };
            let name = body.get("name").and_then(Value::as_str).unwrap_or("response").to_string();
            Ok(NamedFormat { name, format: AnswerFormat::JsonSchema { schema, strict } })
        }
        other => Err(ApiError::invalid(
            Some(&kind_param),
            format!("{param}.type must be \"text\", \"json_object\" or \"json_schema\", got {other:?}"),
        )),
    }
}

/// The "# Response Formats" block of the developer instructions for a `json_schema`
/// format (how Harmony tells gpt-oss about one), if it is one.
pub(crate) fn format_instructions(format: &NamedFormat) -> Option<String> {
    match &format.format {
        AnswerFormat::JsonSchema { schema, .. } => {
            Some(format!("# Response Formats\n\n## {}\n\n{schema}", format.name))
        }
        AnswerFormat::Text | AnswerFormat::JsonObject => None,
    }
}

/// The grammar a request asks for, with the request parameters its parts came from.
#[derive(Clone, Debug)]
pub(crate) struct Structured {
    /// What the turn must follow.
    pub spec: TurnSpec,
    /// Parameter of the answer's schema.
    answer_param: &'static str,
    /// Parameter of each required function's schema, by name.
    parameters_params: Vec<(String, String)>,
}

/// The declared function tools of a request with their `strict` flags and the parameter of
/// each one's schema (`tools[0].function.parameters`).
pub(crate) struct DeclaredTool<'a> {
    /// The tool.
    pub tool: &'a ToolDescription,
    /// Its `strict` flag.
    pub strict: bool,
    /// The request parameter of its schema.
    pub parameters_param: String,
}

/// What a request's format and tool choice constrain, or `None` when the turn is free (no
/// format, and no tools to police). `tools` are the declared ones, whatever the choice.
pub(crate) fn structure(
    format: &NamedFormat,
    choice: &ToolChoice,
    tools: &[DeclaredTool<'_>],
    spelling: FormatSpelling,
) -> Result<Option<Structured>, ApiError> {
    // The key order of a schema is kept (it is the order the arguments are written in).
    let rule = |t: &DeclaredTool<'_>| FunctionRule {
        name: t.tool.name.clone(),
        parameters: t.tool.parameters.as_ref().and_then(|p| serde_json::to_value(p).ok()),
        strict: t.strict,
    };
    let (rules, required): (Vec<&DeclaredTool<'_>>, bool) = match choice {
        ToolChoice::Auto => (tools.iter().collect(), false),
        ToolChoice::None => (Vec::new(), false),
        ToolChoice::Required => {
            if tools.is_empty() {
                return Err(ApiError::invalid(
                    Some("tool_choice"),
                    "tool_choice \"required\" needs at least one function in `tools`",
                ));
            }
            (tools.iter().collect(), true)
        }
        ToolChoice::Named(name) => match tools.iter().find(|t| t.tool.name == *name) {
            Some(t) => (vec![t], true),
            None => {
                return Err(ApiError::invalid(
                    Some("tool_choice"),
                    format!("tool_choice names {name:?}, which is not one of the declared `tools`"),
                ));
            }
        },
    };
    let tools_rule = if required {
        ToolRule::Required(rules.iter().map(|t| rule(t)).collect())
    } else if rules.is_empty() && !tools.is_empty() {
        ToolRule::Forbidden
    } else {
        ToolRule::Optional(rules.iter().map(|t| t.tool.name.clone()).collect())
    };
    let spec = TurnSpec { answer: format.format.clone(), tools: tools_rule };
    if spec.is_free() {
        return Ok(None);
    }
    Ok(Some(Structured {
        spec,
        answer_param: spelling.schema_param(),
        parameters_params: rules.iter().map(|t| (t.tool.name.clone(), t.parameters_param.clone())).collect(),
    }))
}

impl Structured {
    /// Whether all this grammar does is hold tool calls to the declared functions (or
    /// forbid them): a free-text answer with `tool_choice` `auto` or `none`.
    pub fn only_polices_tools(&self) -> bool {
        self.spec.answer == AnswerFormat::Text && !matches!(self.spec.tools, ToolRule::Required(_))
    }

    /// Compiles the grammar over a model vocabulary of `vocab_size` IDs (the first call
    /// builds the shared vocabulary). Blocking: call it off the async runtime.
    pub fn compile(&self, vocab_size: usize) -> Result<Arc<Grammar>, ApiError> {
        let vocab = Vocabulary::shared(vocab_size)
            .map_err(|e| ApiError::server(format!("the grammar engine cannot start: {e}")))?;
        Grammar::for_turn(&self.spec, &vocab).map(Arc::new).map_err(|e| {
            let param = match &e.part {
                GrammarPart::Answer => Some(self.answer_param.to_string()),
                GrammarPart::Parameters(name) => {
                    self.parameters_params.iter().find(|(n, _)| n == name).map(|(_, p)| p.clone())
                }
                GrammarPart::Turn => None,
            };
            let what = match &e.part {
                GrammarPart::Answer => "the response format's schema".to_string(),
                GrammarPart::Parameters(name) => format!("the parameters schema of {name:?}"),
                GrammarPart::Turn => "the output grammar".to_string(),
            };
            ApiError::invalid(param.as_deref(), format!("{what} cannot be enforced: {}", e.message))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tool_choice_spellings() {
        assert_eq!(tool_choice(None).unwrap(), ToolChoice::Auto);
        assert_eq!(tool_choice(Some(&json!("required"))).unwrap(), ToolChoice::Required);
        let chat = json!({"type": "function", "function": {"name": "f"}});
        let responses = json!({"type": "function", "name": "f"});
        assert_eq!(tool_choice(Some(&chat)).unwrap(), ToolChoice::Named("f".into()));
        assert_eq!(tool_choice(Some(&responses)).unwrap(), ToolChoice::Named("f".into()));
        assert_eq!(tool_choice(Some(&json!("always"))).unwrap_err().param.as_deref(), Some("tool_choice"));
        let e = tool_choice(Some(&json!({"type": "file_search"}))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice.type"));
    }

    #[test]
    fn formats_in_both_spellings() {
        let chat = json!({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": true}});
        let f = answer_format(Some(&chat), FormatSpelling::ResponseFormat).unwrap();
        assert_eq!(f.name, "p");
        assert_eq!(f.format, AnswerFormat::JsonSchema { schema: json!({"type": "object"}), strict: true });
        let flat = json!({"type": "json_schema", "name": "p", "schema": {"type": "object"}});
        let f = answer_format(Some(&flat), FormatSpelling::TextFormat).unwrap();
        assert_eq!(f.format, AnswerFormat::JsonSchema { schema: json!({"type": "object"}), strict: false });
        assert!(format_instructions(&f).unwrap().starts_with("# Response Formats\n\n## p\n\n{"));
        let e = answer_format(Some(&json!({"type": "yaml"})), FormatSpelling::TextFormat).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("text.format.type"));
        let e = answer_format(
            Some(&json!({"type": "json_schema", "json_schema": {"schema": 5}})),
            FormatSpelling::ResponseFormat,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format.json_schema.schema"));
    }

    #[test]
    fn choices_map_to_rules() {
        let t = ToolDescription::new("f", "", None);
        let tools = [DeclaredTool {
            tool: &t,
            strict: false,
            parameters_param: "tools[0].function.parameters".into(),
        }];
        let text = NamedFormat { name: String::new(), format: AnswerFormat::Text };
        let s = |choice: ToolChoice, tools: &[DeclaredTool<'_>]| {
            structure(&text, &choice, tools, FormatSpelling::ResponseFormat).map(|s| s.map(|s| s.spec.tools))
        };
        assert_eq!(s(ToolChoice::Auto, &[]).unwrap(), None, "no tools, no format: free");
        assert_eq!(s(ToolChoice::Auto, &tools).unwrap(), Some(ToolRule::Optional(vec!["f".into()])));
        assert_eq!(s(ToolChoice::None, &tools).unwrap(), Some(ToolRule::Forbidden));
        assert!(
            matches!(s(ToolChoice::Required, &tools).unwrap(), Some(ToolRule::Required(r)) if r.len() == 1)
        );
        assert_eq!(s(ToolChoice::Required, &[]).unwrap_err().param.as_deref(), Some("tool_choice"));
        assert_eq!(
            s(ToolChoice::Named("g".into()), &tools).unwrap_err().param.as_deref(),
            Some("tool_choice")
        );
    }
}
