//! Algorithm names (lb_common::Algorithm) on the command line and in config files.

use lb_common::Algorithm;

/// Every algorithm, in `Algorithm`'s numeric order (for parsing and help).
pub const ALL: [Algorithm; 6] = [
    Algorithm::P2cEwma,
    Algorithm::RoundRobin,
    Algorithm::WeightedRoundRobin,
    Algorithm::Random,
    Algorithm::LeastConn,
    Algorithm::Maglev,
];

pub fn parse_algorithm(text: &str) -> Result<Algorithm, String> {
    ALL.into_iter().find(|a| a.name() == text).ok_or_else(|| {
        let names: Vec<_> = ALL.iter().map(|a| a.name()).collect();
        format!(
            "unknown algorithm '{text}' (expected one of {})",
            names.join(", ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_round_trips_and_matches_from_u8() {
        for (i, a) in ALL.into_iter().enumerate() {
            assert_eq!(parse_algorithm(a.name()), Ok(a));
            assert_eq!(Algorithm::from_u8(i as u8), Some(a));
        }
        assert!(parse_algorithm("p2c").unwrap_err().contains("p2c-ewma"));
    }
}
