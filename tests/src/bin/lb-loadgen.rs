//! Open-loop load generator; prints a JSON summary on stdout. See `lb_lab::loadgen`.

use clap::Parser;
use lb_lab::loadgen::{LoadConfig, run};

/// Two workers: the lab machines have two cores, shared with everything else.
const WORKER_THREADS: usize = 2;

fn main() {
    let config = LoadConfig::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKER_THREADS)
        .enable_all()
        .build();
    let result = runtime
        .map_err(anyhow::Error::from)
        .and_then(|runtime| runtime.block_on(run(&config)))
        .and_then(|summary| Ok(serde_json::to_string(&summary)?));
    match result {
        Ok(json) => println!("{json}"),
        Err(error) => {
            eprintln!("lb-loadgen: error: {error:#}");
            std::process::exit(1);
        }
    }
}
