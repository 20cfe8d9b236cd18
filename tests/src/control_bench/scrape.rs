//! Reading lb-user's metrics endpoint: the text exposition parsed into
//! samples, and histograms compared between two scrapes.

use std::collections::BTreeMap;

/// One sample line: `name{label="value",...} number`.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Samples of a scrape (an HTTP response or the bare text); comments,
/// headers and anything else that is not a sample are skipped.
pub fn parse(text: &str) -> Vec<Sample> {
    let body = match text.find("\r\n\r\n") {
        Some(at) if text.starts_with("HTTP/") => &text[at + 4..],
        _ => text,
    };
    body.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (series, value) = line.rsplit_once(' ')?;
    let value: f64 = value.parse().ok()?;
    let (name, labels) = match series.split_once('{') {
        Some((name, rest)) => (name, parse_labels(rest.strip_suffix('}')?)?),
        None => (series, BTreeMap::new()),
    };
    let valid = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':');
    valid.then(|| Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// `a="x",b="y"` (values without escaped quotes, which lb-user's labels
/// never contain).
fn parse_labels(text: &str) -> Option<BTreeMap<String, String>> {
    let mut labels = BTreeMap::new();
    let mut rest = text;
    while !rest.is_empty() {
        let (key, after) = rest.split_once("=\"")?;
        let (value, after) = after.split_once('"')?;
        labels.insert(key.trim_start_matches(',').to_string(), value.to_string());
        rest = after.trim_start_matches(',');
    }
    Some(labels)
}

/// The value of the sample `name` whose labels include every one of `labels`.
pub fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| s.name == name && has_labels(s, labels))
        .map(|s| s.value)
}

fn has_labels(sample: &Sample, labels: &[(&str, &str)]) -> bool {
    labels
        .iter()
        .all(|(k, v)| sample.labels.get(*k).is_some_and(|x| x == v))
}

/// A histogram as scraped: cumulative bucket counts by upper bound.
#[derive(Clone, Debug, PartialEq)]
pub struct Histogram {
    /// `(le, cumulative count)`, ascending; the last one is `+Inf`.
    pub buckets: Vec<(f64, f64)>,
    pub count: f64,
    pub sum: f64,
}

impl Histogram {
    /// The histogram `name` (its `_bucket`, `_count` and `_sum` samples)
    /// with `labels`; `None` if the scrape lacks it.
    pub fn from_samples(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<Self> {
        let bucket_name = format!("{name}_bucket");
        let mut buckets: Vec<(f64, f64)> = samples
            .iter()
            .filter(|s| s.name == bucket_name && has_labels(s, labels))
            .filter_map(|s| {
                let le = s.labels.get("le")?;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((le, s.value))
            })
            .collect();
        if buckets.is_empty() {
            return None;
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Some(Self {
            buckets,
            count: value(samples, &format!("{name}_count"), labels)?,
            sum: value(samples, &format!("{name}_sum"), labels)?,
        })
    }

    /// What was recorded after `earlier` (same buckets).
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        let buckets = self
            .buckets
            .iter()
            .map(|&(le, n)| {
                let before = earlier
                    .buckets
                    .iter()
                    .find(|(l, _)| *l == le)
                    .map_or(0.0, |&(_, c)| c);
                (le, (n - before).max(0.0))
            })
            .collect();
        Histogram {
            buckets,
            count: (self.count - earlier.count).max(0.0),
            sum: (self.sum - earlier.sum).max(0.0),
        }
    }

    /// Mean of the recorded values; `None` when nothing was recorded.
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count)
    }

    /// Upper bound of the bucket holding quantile `q`: the value `q` of the
    /// recorded values are at most (an upper bound, never an estimate
    /// below the truth); `None` when empty.
    pub fn quantile_bound(&self, q: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let wanted = (q * self.count).ceil().max(1.0);
        self.buckets
            .iter()
            .find(|&&(_, n)| n >= wanted)
            .map(|&(le, _)| le)
    }

    /// Upper bound of the highest non-empty bucket (the largest value
    /// recorded is at most this); `None` when empty.
    pub fn max_bound(&self) -> Option<f64> {
        self.quantile_bound(1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRAPE: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n\
        # TYPE lb_score_tick_seconds histogram\n\
        lb_score_tick_seconds_sum 0.5\n\
        lb_score_tick_seconds_count 100\n\
        lb_score_tick_seconds_bucket{le=\"0.001\"} 10\n\
        lb_score_tick_seconds_bucket{le=\"0.004\"} 90\n\
        lb_score_tick_seconds_bucket{le=\"0.016\"} 99\n\
        lb_score_tick_seconds_bucket{le=\"0.064\"} 100\n\
        lb_score_tick_seconds_bucket{le=\"+Inf\"} 100\n\
        lb_map_update_seconds_count{kind=\"publish\"} 2\n\
        lb_map_update_seconds_count{kind=\"scores\"} 7\n\
        lb_flow_table_entries 1000000\n\
        # EOF\n";

    #[test]
    fn samples_are_read_with_their_labels_and_headers_are_skipped() {
        let samples = parse(SCRAPE);
        assert_eq!(samples.len(), 10);
        assert_eq!(
            value(
                &samples,
                "lb_map_update_seconds_count",
                &[("kind", "scores")]
            ),
            Some(7.0)
        );
        assert_eq!(
            value(&samples, "lb_flow_table_entries", &[]),
            Some(1_000_000.0)
        );
        assert_eq!(value(&samples, "lb_missing", &[]), None);
    }

    #[test]
    fn histogram_quantiles_are_bucket_upper_bounds() {
        let h = Histogram::from_samples(&parse(SCRAPE), "lb_score_tick_seconds", &[]).unwrap();
        assert_eq!(h.count, 100.0);
        assert_eq!(h.mean(), Some(0.005));
        assert_eq!(h.quantile_bound(0.5), Some(0.004));
        assert_eq!(h.quantile_bound(0.99), Some(0.016));
        assert_eq!(h.max_bound(), Some(0.064));
        assert_eq!(h.buckets.last().unwrap().0, f64::INFINITY);
    }

    #[test]
    fn a_later_scrape_minus_an_earlier_one_is_what_happened_between() {
        let early = Histogram {
            buckets: vec![(0.001, 10.0), (0.1, 10.0), (f64::INFINITY, 10.0)],
            count: 10.0,
            sum: 0.005,
        };
        let late = Histogram {
            buckets: vec![(0.001, 10.0), (0.1, 30.0), (f64::INFINITY, 30.0)],
            count: 30.0,
            sum: 1.005,
        };
        let d = late.since(&early);
        assert_eq!(d.count, 20.0);
        assert!((d.sum - 1.0).abs() < 1e-12);
        // Every value of the window is in the 0.1 bucket, none at ≤ 1 ms.
        assert_eq!(d.quantile_bound(0.01), Some(0.1));
        assert_eq!(early.since(&early).mean(), None);
        assert_eq!(early.since(&early).quantile_bound(0.5), None);
    }
}
