//! Front-ends that serve a session to other programs: the stdio line protocol
//! (`docs/protocol.md`) and an OpenAI-compatible HTTP server (`docs/http.md`).

pub mod http;
pub mod stdio;
