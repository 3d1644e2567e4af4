//! Bad input to the forward pass gives clear errors, never a panic.

mod common;

use rustorch_llm::{Batch, KvCacheError, ModelError, Runtime};

const SMOL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

#[test]
fn empty_batch_is_an_error() {
    let Some(model) = common::load_model(SMOL) else {
        return;
    };
    let err = model
        .forward(&Batch::new(), &mut model.new_cache(16), &Runtime::new(1))
        .unwrap_err();
    assert!(matches!(err, ModelError::EmptyBatch), "{err}");
}

#[test]
fn token_out_of_vocabulary_is_an_error() {
    let Some(model) = common::load_model(SMOL) else {
        return;
    };
    let nv = model.hparams().n_vocab as u32;
    let batch = Batch::from_prompt(&[1, 2, nv], 0, 0, false);
    let err = model
        .forward(&batch, &mut model.new_cache(16), &Runtime::new(1))
        .unwrap_err();
    assert!(
        matches!(err, ModelError::TokenOutOfRange { token, index: 2, n_vocab } if token == nv && n_vocab == nv as usize),
        "{err}"
    );
    assert!(err.to_string().contains("49152"), "{err}");
}

#[test]
fn context_overflow_is_an_error() {
    let Some(model) = common::load_model(SMOL) else {
        return;
    };
    let rt = Runtime::new(1);
    let mut cache = model.new_cache(8);
    let err = model
        .forward(&Batch::from_prompt(&[1; 9], 0, 0, false), &mut cache, &rt)
        .unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::Cache(KvCacheError::Full {
                n_ctx: 8,
                used: 0,
                needed: 9
            })
        ),
        "{err}"
    );
    // filling exactly, then one more
    model
        .forward(&Batch::from_prompt(&[1; 8], 0, 0, false), &mut cache, &rt)
        .expect("fits");
    let mut b = Batch::new();
    b.push(1, 8, 0, true);
    let err = model.forward(&b, &mut cache, &rt).unwrap_err();
    assert!(err.to_string().contains("context is full"), "{err}");
}

#[test]
fn malformed_batch_is_an_error() {
    let Some(model) = common::load_model(SMOL) else {
        return;
    };
    let mut b = Batch::from_prompt(&[1, 2], 0, 0, false);
    b.positions.pop();
    let err = model
        .forward(&b, &mut model.new_cache(16), &Runtime::new(1))
        .unwrap_err();
    assert!(matches!(err, ModelError::MalformedBatch), "{err}");
}
