//! Stored responses: a bounded in-memory map from `resp_...` IDs to what `GET
//! /v1/responses/{id}` returns and what `previous_response_id` continues.
//!
//! Each entry keeps only what its own request added (its input and its output, in Harmony
//! form) and the ID it continued, so a long chain costs memory linear in its length; the
//! conversation is rebuilt by walking the chain back. The map holds at most
//! [`MAX_STORED_RESPONSES`] entries and [`MAX_STORED_BYTES`] bytes of text; beyond either the
//! oldest entries are dropped, and a response that continued a dropped one can no longer be
//! continued (the request is refused, naming the missing ID).

use std::collections::{HashMap, VecDeque};

use serde_json::Value;

use crate::chat::Message;

/// The most responses kept.
pub(crate) const MAX_STORED_RESPONSES: usize = 1024;

/// The most bytes of text (messages and response objects) kept: 256 MiB.
pub(crate) const MAX_STORED_BYTES: usize = 256 << 20;

/// One stored response.
#[derive(Debug, Clone)]
pub(crate) struct Stored {
    /// The response object, as returned.
    pub response: Value,
    /// The response this one continued.
    pub previous: Option<String>,
    /// Instructions given by `system`/`developer` input items (the request's `instructions`
    /// are not carried over, as OpenAI defines).
    pub input_instructions: Vec<String>,
    /// The request's new input and the generated output, in Harmony form.
    pub messages: Vec<Message>,
    /// Call ID -> recipient (`functions.NAME`) of every function call in `messages`.
    pub calls: Vec<(String, String)>,
    /// The request's input items, as `GET /v1/responses/{id}/input_items` lists them.
    pub input_items: Vec<Value>,
}

impl Stored {
    /// Roughly the bytes this entry holds.
    fn bytes(&self) -> usize {
        let texts: usize = self.messages.iter().map(|m| m.text().len().saturating_add(64)).sum();
        let calls: usize = self.calls.iter().map(|(a, b)| a.len() + b.len()).sum();
        let instructions: usize = self.input_instructions.iter().map(String::len).sum();
        let items: usize = self.input_items.iter().map(|i| i.to_string().len()).sum();
        texts
            .saturating_add(calls)
            .saturating_add(instructions)
            .saturating_add(items)
            .saturating_add(self.response.to_string().len())
    }
}

/// What a chain of stored responses says, oldest first.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct History {
    /// Instructions from `system`/`developer` input items, in order.
    pub instructions: Vec<String>,
    /// The conversation's messages, in order.
    pub messages: Vec<Message>,
    /// Call ID -> recipient of every call in the chain.
    pub calls: Vec<(String, String)>,
}

/// The map, bounded in entries and bytes.
#[derive(Debug, Default)]
pub(crate) struct Store {
    entries: HashMap<String, (Stored, usize)>,
    /// IDs in insertion order, for eviction (deleted IDs are skipped when met).
    order: VecDeque<String>,
    bytes: usize,
}

impl Store {
    /// Keeps `stored` under `id`, dropping the oldest entries while either bound is passed.
    /// An entry bigger than the byte bound alone is not kept.
    pub fn insert(&mut self, id: String, stored: Stored) {
        let size = stored.bytes();
        if size > MAX_STORED_BYTES {
            tracing::warn!("response {id} is not stored: {size} bytes is over the store's bound");
            return;
        }
        self.remove(&id);
        while self.entries.len() >= MAX_STORED_RESPONSES || self.bytes.saturating_add(size) > MAX_STORED_BYTES
        {
            let Some(oldest) = self.order.pop_front() else { break };
            if let Some((_, n)) = self.entries.remove(&oldest) {
                self.bytes = self.bytes.saturating_sub(n);
                tracing::debug!("stored response {oldest} dropped: the store is full");
            }
        }
        self.bytes = self.bytes.saturating_add(size);
        self.order.push_back(id.clone());
        self.entries.insert(id, (stored, size));
    }

    /// The stored response object of `id`.
    pub fn get(&self, id: &str) -> Option<&Value> {
        self.entries.get(id).map(|(s, _)| &s.response)
    }

    /// The input items of the stored response `id`, in order.
    pub fn input_items(&self, id: &str) -> Option<&[Value]> {
        self.entries.get(id).map(|(s, _)| s.input_items.as_slice())
    }

    /// Drops `id`; whether it was there.
    pub fn remove(&mut self, id: &str) -> bool {
        match self.entries.remove(id) {
            Some((_, n)) => {
                self.bytes = self.bytes.saturating_sub(n);
                if let Some(i) = self.order.iter().position(|x| x == id) {
                    self.order.remove(i);
                }
                true
            }
            None => false,
        }
    }

    /// How many responses are stored.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The conversation up to and including `id`: the chain of responses it continued,
    /// oldest first. `Err` names the first ID of the chain that is not stored (`id` itself,
    /// or an ancestor that was deleted or dropped).
    pub fn history(&self, id: &str) -> Result<History, String> {
        let mut chain = Vec::new();
        let mut next = Some(id);
        while let Some(current) = next {
            let (stored, _) = self.entries.get(current).ok_or_else(|| current.to_string())?;
            chain.push(stored);
            // Every link was stored before its child, so the walk cannot loop; the bound is
            // a guard all the same.
            if chain.len() > MAX_STORED_RESPONSES {
                return Err(current.to_string());
            }
            next = stored.previous.as_deref();
        }
        let mut history = History::default();
        for stored in chain.into_iter().rev() {
            history.instructions.extend(stored.input_instructions.iter().cloned());
            history.messages.extend(stored.messages.iter().cloned());
            history.calls.extend(stored.calls.iter().cloned());
        }
        Ok(history)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(previous: Option<&str>, text: &str) -> Stored {
        Stored {
            response: serde_json::json!({"id": text}),
            previous: previous.map(str::to_string),
            input_instructions: vec![format!("i-{text}")],
            messages: vec![Message::user(text)],
            calls: vec![(format!("call_{text}"), "functions.f".into())],
            input_items: vec![serde_json::json!({"id": format!("msg_{text}")})],
        }
    }

    #[test]
    fn a_chain_is_rebuilt_oldest_first() {
        let mut store = Store::default();
        store.insert("a".into(), entry(None, "a"));
        store.insert("b".into(), entry(Some("a"), "b"));
        store.insert("c".into(), entry(Some("b"), "c"));
        let h = store.history("c").unwrap();
        assert_eq!(h.messages, [Message::user("a"), Message::user("b"), Message::user("c")]);
        assert_eq!(h.instructions, ["i-a", "i-b", "i-c"]);
        assert_eq!(h.calls.len(), 3);
        assert_eq!(store.get("b").unwrap()["id"], "b");
        assert!(store.remove("b"));
        assert!(!store.remove("b"));
        assert_eq!(store.history("c").unwrap_err(), "b", "the missing link is named");
        assert_eq!(store.history("zzz").unwrap_err(), "zzz");
    }

    #[test]
    fn the_oldest_entries_go_first() {
        let mut store = Store::default();
        for i in 0..MAX_STORED_RESPONSES + 5 {
            store.insert(format!("r{i}"), entry(None, "x"));
        }
        assert_eq!(store.len(), MAX_STORED_RESPONSES);
        assert!(store.get("r0").is_none() && store.get("r4").is_none());
        assert!(store.get("r5").is_some());
        let big = Stored { messages: vec![Message::user("y".repeat(MAX_STORED_BYTES))], ..entry(None, "y") };
        store.insert("big".into(), big);
        assert!(store.get("big").is_none(), "an entry over the bound alone is not kept");
        assert_eq!(store.len(), MAX_STORED_RESPONSES, "and it evicts nothing");
    }
}
