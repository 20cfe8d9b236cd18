//! Lab backend server; see `lb_lab::server`.

use clap::Parser;
use lb_lab::server::{ServerConfig, run};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let config = ServerConfig::parse();
    if let Err(error) = run(config).await {
        eprintln!("lb-backend: error: {error:#}");
        std::process::exit(1);
    }
}
