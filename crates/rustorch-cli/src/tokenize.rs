//! `rustorch tokenize`

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model whose vocabulary is used
    #[arg(short = 'm', long = "model")]
    pub model: std::path::PathBuf,
}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("tokenize is not implemented yet")
}
