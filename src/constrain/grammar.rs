//! Grammars over a whole Harmony assistant turn, in llguidance's Lark dialect, built from
//! what a request asks for: the form of the final answer ([`AnswerFormat`]) and which
//! tool calls may or must be made ([`ToolRule`]).
//!
//! The grammar covers every token the engine generates after the prompt's
//! `<|start|>assistant`, so one constraint sees the whole turn. Reasoning stays free: any
//! number of `analysis` messages of any text come first. What follows is structured:
//!
//! ```text
//! turn     := (analysis | preamble)* (final | call)
//! analysis := <|channel|>analysis<|message|> TEXT <|end|><|start|>assistant
//! preamble := <|channel|>commentary<|message|> TEXT <|end|><|start|>assistant
//! final    := <|channel|>final<|message|> ANSWER <|return|>
//! call     := <|channel|>commentary to=functions.NAME <|constrain|>json<|message|> ARGS <|call|>
//!           | ␣to=functions.NAME<|channel|>commentary <|constrain|>json<|message|> ARGS <|call|>
//! ```
//!
//! `ANSWER` is free text or JSON (an object, or valid against a schema); a call exists
//! only for the allowed functions (`NAME` is one of them), and its `ARGS` are free text
//! when the call is optional and JSON valid against the function's parameters when it is
//! required. A preamble (text for the user before a call) is allowed only where tool calls
//! are and the answer is free text, so a JSON answer is exactly the final message. The
//! call's header takes either of Harmony's placements of the recipient: in the channel part
//! (the form OpenAI's Harmony documentation shows the model writing) or after the role (the
//! form a rendered conversation shows); the Harmony parser reads both as a call.
//! Special tokens are written by ID (`<[200006]>`), which text can never match.

use serde_json::Value;

use crate::chat::tokenizer::special;

/// What the final answer (the `final` channel) must be.
#[derive(Clone, Debug, PartialEq)]
pub enum AnswerFormat {
    /// Any text.
    Text,
    /// A JSON object.
    JsonObject,
    /// JSON valid against `schema`. With `strict`, a schema keyword the grammar engine
    /// cannot enforce is an error; without, it is ignored (the output may then break that
    /// keyword, as OpenAI's non-strict mode allows).
    JsonSchema {
        /// The JSON schema.
        schema: Value,
        /// Refuse keywords that cannot be enforced.
        strict: bool,
    },
}

/// A function a required call may address, with the schema of its arguments.
#[derive(Clone, Debug, PartialEq)]
pub struct FunctionRule {
    /// The bare name (`get_weather` for `functions.get_weather`).
    pub name: String,
    /// The JSON schema of the arguments; `None` means any JSON object.
    pub parameters: Option<Value>,
    /// Refuse schema keywords that cannot be enforced (see [`AnswerFormat::JsonSchema`]).
    pub strict: bool,
}

/// Which tool calls the turn may or must make.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolRule {
    /// No message can be addressed to a tool: the turn ends in a final answer.
    Forbidden,
    /// The turn ends in a final answer or a call of one of these functions (bare names),
    /// with arguments of any text (the model's own JSON, parsed by the client).
    Optional(Vec<String>),
    /// The turn ends in a call of one of these functions, with arguments valid against
    /// its schema. Never empty.
    Required(Vec<FunctionRule>),
}

/// What a turn's grammar enforces.
#[derive(Clone, Debug, PartialEq)]
pub struct TurnSpec {
    /// The form of the final answer.
    pub answer: AnswerFormat,
    /// The tool calls allowed or required.
    pub tools: ToolRule,
}

/// The Lark rule of any text of a message body (no special tokens).
const TEXT: &str = "TEXT: /(.|\\n)*/";

/// `<[ID]>`: a special token by ID, in llguidance's Lark.
fn tok(id: u32) -> String {
    format!("<[{id}]>")
}

/// `%json {...}` for `schema`, compact (no whitespace between items, so output cannot
/// grow by whitespace alone) and, unless `strict`, ignoring keywords it cannot enforce.
pub(crate) fn json_rule(schema: &Value, strict: bool) -> String {
    let mut schema = schema.clone();
    if let Value::Object(map) = &mut schema {
        map.insert(
            "x-guidance".into(),
            serde_json::json!({"whitespace_flexible": false, "lenient": !strict}),
        );
    }
    format!("%json {schema}")
}

impl TurnSpec {
    /// Whether this spec leaves the turn exactly as an unconstrained one (free answer, and
    /// no tools to police), so no grammar is needed.
    pub fn is_free(&self) -> bool {
        self.answer == AnswerFormat::Text && matches!(&self.tools, ToolRule::Optional(f) if f.is_empty())
    }

    /// The Lark grammar of the whole assistant turn after `<|start|>assistant`.
    pub fn lark(&self) -> String {
        let (channel, message, end, start) =
            (tok(special::CHANNEL), tok(special::MESSAGE), tok(special::END), tok(special::START));
        let mut g = String::new();
        let next = format!("{end} {start} \"assistant\"");
        let preamble_allowed =
            self.answer == AnswerFormat::Text && !matches!(self.tools, ToolRule::Forbidden);
        let mut before = vec![format!("{channel} \"analysis\" {message} TEXT {next}")];
        if preamble_allowed {
            before.push(format!("{channel} \"commentary\" {message} TEXT {next}"));
        }
        let final_msg = format!("{channel} \"final\" {message} answer {}", tok(special::RETURN));
        // Either placement of the recipient Harmony allows: in the channel part (as the
        // model writes it) or after the role (as a rendered conversation shows it).
        let call_head = |name: &str| {
            let constrain = tok(special::CONSTRAIN);
            let in_channel =
                format!("{channel} \"commentary to=functions.{name} \" {constrain} \"json\" {message}");
            let after_role =
                format!("\" to=functions.{name}\" {channel} \"commentary \" {constrain} \"json\" {message}");
            format!("({in_channel} | {after_role})")
        };
        let call = tok(special::CALL);
        let mut endings = Vec::new();
        let mut rules = Vec::new();
        match &self.tools {
            ToolRule::Forbidden => endings.push(final_msg),
            ToolRule::Optional(names) => {
                endings.push(final_msg);
                endings.extend(names.iter().map(|n| format!("{} TEXT {call}", call_head(n))));
            }
            ToolRule::Required(functions) => {
                for (i, f) in functions.iter().enumerate() {
                    endings.push(format!("{} args_{i} {call}", call_head(&f.name)));
                    let schema =
                        f.parameters.clone().unwrap_or_else(|| serde_json::json!({"type": "object"}));
                    rules.push(format!("args_{i}: {}", json_rule(&schema, f.strict)));
                }
            }
        }
        let answer = match &self.answer {
            AnswerFormat::Text => "TEXT".to_string(),
            AnswerFormat::JsonObject => json_rule(&serde_json::json!({"type": "object"}), true),
            AnswerFormat::JsonSchema { schema, strict } => json_rule(schema, *strict),
        };
        g.push_str("start: before* ending\n");
        g.push_str(&format!("before: {}\n", before.join("\n  | ")));
        g.push_str(&format!("ending: {}\n", endings.join("\n  | ")));
        g.push_str(&format!("answer: {answer}\n"));
        for r in rules {
            g.push_str(&r);
            g.push('\n');
        }
        g.push_str(TEXT);
        g.push('\n');
        g
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_specs_need_no_grammar() {
        let free = TurnSpec { answer: AnswerFormat::Text, tools: ToolRule::Optional(vec![]) };
        assert!(free.is_free());
        assert!(!TurnSpec { tools: ToolRule::Forbidden, ..free.clone() }.is_free());
        assert!(!TurnSpec { answer: AnswerFormat::JsonObject, ..free }.is_free());
    }

    #[test]
    fn forced_call_names_only_the_allowed_functions() {
        let spec = TurnSpec {
            answer: AnswerFormat::Text,
            tools: ToolRule::Required(vec![FunctionRule {
                name: "get_weather".into(),
                parameters: Some(
                    serde_json::json!({"type": "object", "properties": {"city": {"type": "string"}}}),
                ),
                strict: true,
            }]),
        };
        let g = spec.lark();
        for head in [
            "<[200005]> \"commentary to=functions.get_weather \" <[200003]> \"json\" <[200008]>",
            "\" to=functions.get_weather\" <[200005]> \"commentary \" <[200003]> \"json\" <[200008]>",
        ] {
            assert!(g.contains(head), "{head} in {g}");
        }
        assert!(g.contains("<[200008]>) args_0 <[200012]>"), "{g}");
        assert!(!g.contains("\"final\""), "a required call leaves no final answer: {g}");
        assert!(g.contains("\"lenient\":false") && g.contains("\"whitespace_flexible\":false"), "{g}");
    }
}
