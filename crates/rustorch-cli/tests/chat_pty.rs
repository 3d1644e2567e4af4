//! `rustorch chat` driven through a pseudo-terminal, as a person would use it: two turns
//! where the second depends on the first, `/clear` forgetting it, and Ctrl-C stopping a
//! long reply without leaving the REPL.

use std::path::PathBuf;

use rexpect::session::spawn_command;

fn model() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/qwen2.5-coder-0.5b-instruct-q4km.gguf");
    if p.exists() {
        Some(p)
    } else {
        eprintln!(
            "SKIPPED: {} is absent (run scripts/fetch-models.sh --all)",
            p.display()
        );
        None
    }
}

#[test]
fn repl_remembers_clears_and_interrupts() -> Result<(), rexpect::error::Error> {
    let Some(model) = model() else {
        return Ok(());
    };
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rustorch"));
    cmd.args(["chat", "--temp", "0", "-c", "2048", "-m"])
        .arg(&model);
    let mut p = spawn_command(cmd, Some(180_000))?;
    p.exp_string("/help for commands")?;
    p.exp_string("> ")?;

    // turn 1 and turn 2: the second refers to the first
    p.send_line("My name is Alice. Please remember it.")?;
    p.exp_string("> ")?;
    p.send_line("What is my name?")?;
    let reply = p.exp_string("> ")?;
    assert!(
        reply.contains("Alice"),
        "second turn did not recall the first: {reply:?}"
    );

    // /clear forgets
    p.send_line("/clear")?;
    p.exp_string("[conversation cleared]")?;
    p.exp_string("> ")?;
    p.send_line("What is my name?")?;
    let reply = p.exp_string("> ")?;
    assert!(!reply.contains("Alice"), "/clear did not forget: {reply:?}");

    // Ctrl-C stops a long reply and the REPL goes on
    p.send_line("Count from 1 to 1000, one number per line.")?;
    // a line of the reply (not the "1000" of the echoed prompt: a Ctrl-C sent before the
    // reply starts may reach the line editor instead)
    p.exp_string("\r\n12\r\n")?;
    p.send_control('c')?;
    p.exp_string("[reply interrupted]")?;
    p.exp_string("> ")?;
    p.send_line("/stats")?;
    p.exp_string("tokens used")?;
    p.exp_string("> ")?;
    p.send_line("/exit")?;
    p.exp_eof()?;
    Ok(())
}
