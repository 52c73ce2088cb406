//! A JSON value that keeps the order of object keys as written.
//!
//! Tool parameter schemas are rendered property by property, in the order the caller wrote
//! them (the official library builds `serde_json` with `preserve_order`). This type keeps the
//! order whatever `serde_json`'s features are. (The `llguidance` dependency turns
//! `preserve_order` on for the whole build, and the output grammars rely on it: a schema
//! turned into a `serde_json::Value` keeps its property order, so forced arguments and
//! structured answers are written in the order the schema lists; see `serve::http::convert`'s
//! tests.)

use std::fmt;
use std::str::FromStr;

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};

use crate::error::{Error, Result};

/// A JSON value whose objects keep their keys in insertion order.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum JsonValue {
    /// `null`
    #[default]
    Null,
    /// `true` or `false`
    Bool(bool),
    /// A number, formatted as `serde_json` formats it.
    Number(serde_json::Number),
    /// A string.
    String(String),
    /// An array.
    Array(Vec<JsonValue>),
    /// An object; a repeated key keeps its first position and its last value.
    Object(Vec<(String, JsonValue)>),
}

impl JsonValue {
    /// The member `key` of an object; `None` for a missing key or a non-object.
    pub fn get(&self, key: &str) -> Option<&JsonValue> {
        match self {
            JsonValue::Object(members) => members.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            JsonValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The boolean, if this is one.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            JsonValue::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// The elements, if this is an array.
    pub fn as_array(&self) -> Option<&[JsonValue]> {
        match self {
            JsonValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The members in order, if this is an object.
    pub fn as_object(&self) -> Option<&[(String, JsonValue)]> {
        match self {
            JsonValue::Object(o) => Some(o),
            _ => None,
        }
    }

    /// Whether this is a string.
    pub fn is_string(&self) -> bool {
        matches!(self, JsonValue::String(_))
    }
}

/// Compact JSON, exactly as `serde_json` writes a value.
impl fmt::Display for JsonValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = serde_json::to_string(self).map_err(|_| fmt::Error)?;
        f.write_str(&text)
    }
}

/// Parses JSON text, keeping key order.
impl FromStr for JsonValue {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        serde_json::from_str(s).map_err(|e| Error::invalid(format!("invalid JSON: {e}")))
    }
}

/// Converts a `serde_json` value. Its objects come in `serde_json`'s own key order (sorted,
/// as this crate builds it); parse JSON text with `str::parse` to keep the written order.
impl From<serde_json::Value> for JsonValue {
    fn from(v: serde_json::Value) -> Self {
        match v {
            serde_json::Value::Null => JsonValue::Null,
            serde_json::Value::Bool(b) => JsonValue::Bool(b),
            serde_json::Value::Number(n) => JsonValue::Number(n),
            serde_json::Value::String(s) => JsonValue::String(s),
            serde_json::Value::Array(a) => JsonValue::Array(a.into_iter().map(Into::into).collect()),
            serde_json::Value::Object(o) => {
                JsonValue::Object(o.into_iter().map(|(k, v)| (k, v.into())).collect())
            }
        }
    }
}

impl Serialize for JsonValue {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            JsonValue::Null => s.serialize_unit(),
            JsonValue::Bool(b) => s.serialize_bool(*b),
            JsonValue::Number(n) => n.serialize(s),
            JsonValue::String(v) => s.serialize_str(v),
            JsonValue::Array(a) => {
                let mut seq = s.serialize_seq(Some(a.len()))?;
                for v in a {
                    seq.serialize_element(v)?;
                }
                seq.end()
            }
            JsonValue::Object(o) => {
                let mut map = s.serialize_map(Some(o.len()))?;
                for (k, v) in o {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = JsonValue;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> std::result::Result<JsonValue, E> {
        Ok(JsonValue::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> std::result::Result<JsonValue, E> {
        Ok(JsonValue::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> std::result::Result<JsonValue, E> {
        Ok(JsonValue::Number(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> std::result::Result<JsonValue, E> {
        Ok(serde_json::Number::from_f64(v).map_or(JsonValue::Null, JsonValue::Number))
    }

    fn visit_str<E>(self, v: &str) -> std::result::Result<JsonValue, E> {
        Ok(JsonValue::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> std::result::Result<JsonValue, E> {
        Ok(JsonValue::String(v))
    }

    fn visit_unit<E>(self) -> std::result::Result<JsonValue, E> {
        Ok(JsonValue::Null)
    }

    fn visit_none<E>(self) -> std::result::Result<JsonValue, E> {
        Ok(JsonValue::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> std::result::Result<JsonValue, D::Error> {
        JsonValue::deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<JsonValue, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element()? {
            out.push(v);
        }
        Ok(JsonValue::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<JsonValue, A::Error> {
        let mut out: Vec<(String, JsonValue)> = Vec::new();
        while let Some((k, v)) = map.next_entry::<String, JsonValue>()? {
            match out.iter_mut().find(|(key, _)| *key == k) {
                Some(slot) => slot.1 = v,
                None => out.push((k, v)),
            }
        }
        Ok(JsonValue::Object(out))
    }
}

impl<'de> Deserialize<'de> for JsonValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_any(ValueVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_key_order_and_formats_like_serde_json() {
        let text = r#"{"z": 1, "a": [true, null, 0.5, -3, "x\"y"], "m": {"b": 1e3, "a": {}}}"#;
        let v: JsonValue = text.parse().unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["z", "a", "m"]);
        assert_eq!(v.to_string(), r#"{"z":1,"a":[true,null,0.5,-3,"x\"y"],"m":{"b":1000.0,"a":{}}}"#);
        let sj: serde_json::Value = serde_json::from_str(r#"[0.5, -3, 1e3, 10, "é"]"#).unwrap();
        assert_eq!(JsonValue::from(sj.clone()).to_string(), sj.to_string());
    }

    #[test]
    fn repeated_key_keeps_first_position_last_value() {
        let v: JsonValue = r#"{"a": 1, "b": 2, "a": 3}"#.parse().unwrap();
        assert_eq!(v.to_string(), r#"{"a":3,"b":2}"#);
        assert!("{".parse::<JsonValue>().is_err());
    }
}
