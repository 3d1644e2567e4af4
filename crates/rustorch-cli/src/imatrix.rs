//! `rustorch imatrix`: the importance matrix of a model over a text, as llama.cpp's
//! `llama-imatrix` computes it (see [`file`] for the formats).

pub mod file;
