//! The `stats` document, typed.
