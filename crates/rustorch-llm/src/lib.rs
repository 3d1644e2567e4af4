//! rustorch-llm
