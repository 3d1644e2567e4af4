//! `rustorch bench`

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model
    #[arg(short = 'm', long = "model")]
    pub model: Option<std::path::PathBuf>,
}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`rustorch bench` is not available in this build yet")
}
