//! `tidectl bench`: a load generator in the manner of `weed benchmark`,
//! `warp` and `rados bench`, through the SDK as an application would use
//! it.
//!
//! `--concurrency` workers run operations back to back for `--seconds` (or
//! until `--count` operations in all), each picking its operation from the
//! `--mix` weights and its key from `--keys` keys (`<prefix>-<i>`) under a
//! uniform or Zipf distribution. Before the measured run, when the mix
//! reads (get, exists, delete), every key is written once (`--prefill`,
//! not measured). Every second the rates so far go to stderr; at the end,
//! per operation: count, operations/s, MiB/s, latency percentiles (exact:
//! every latency is kept) and errors by stable code; `--json` prints the
//! same as one object. Exit 1 if any operation failed with a code other
//! than `NOT_FOUND` (which deletes in the mix make expected).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use serde_json::json;
use tidepool_client::{Client, ErrorCode};

use crate::{Failure, Outcome, print, usage};

/// The operations a bench runs.
pub const OPS: [&str; 4] = ["put", "get", "exists", "delete"];

/// Weights of the operations, in [`OPS`] order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mix(pub [u32; 4]);

impl std::str::FromStr for Mix {
    type Err = String;

    /// `put=1,get=3` (operations left out weigh 0).
    fn from_str(text: &str) -> Result<Mix, String> {
        let mut weights = [0u32; 4];
        for part in text.split(',').filter(|p| !p.is_empty()) {
            let (name, weight) = part.split_once('=').unwrap_or((part, "1"));
            let slot = OPS
                .iter()
                .position(|op| *op == name.trim())
                .ok_or_else(|| format!("unknown operation {name:?} (put, get, exists, delete)"))?;
            weights[slot] = weight
                .trim()
                .parse()
                .map_err(|_| format!("bad weight {weight:?} for {name}"))?;
        }
        if weights.iter().all(|w| *w == 0) {
            return Err("the mix has no operation".into());
        }
        if weights
            .iter()
            .try_fold(0u32, |sum, w| sum.checked_add(*w))
            .is_none()
        {
            return Err("the mix's weights add up to more than 4294967295".into());
        }
        Ok(Mix(weights))
    }
}

impl Mix {
    fn pick(&self, rng: &mut impl Rng) -> usize {
        let total: u32 = self.0.iter().sum();
        let mut at = rng.random_range(0..total);
        for (op, weight) in self.0.iter().enumerate() {
            if at < *weight {
                return op;
            }
            at -= weight;
        }
        0
    }

    fn reads(&self) -> bool {
        self.0[1..].iter().any(|w| *w > 0)
    }
}

/// How keys are picked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Distribution {
    /// Every key alike.
    Uniform,
    /// Key `i` (from 1) with probability proportional to `1 / i^s`.
    Zipf(f64),
    /// Every operation takes the next key, from the first, wrapping after
    /// the last: `--count N --keys N` writes (or reads) each key once, as
    /// `weed benchmark` does.
    Sequential,
}

impl std::str::FromStr for Distribution {
    type Err = String;

    /// `uniform`, `sequential`, `zipf` (s = 1.0) or `zipf:S`.
    fn from_str(text: &str) -> Result<Distribution, String> {
        match text.split_once(':') {
            None if text == "uniform" => Ok(Distribution::Uniform),
            None if text == "sequential" => Ok(Distribution::Sequential),
            None if text == "zipf" => Ok(Distribution::Zipf(1.0)),
            Some(("zipf", s)) => match s.parse::<f64>() {
                Ok(s) if s > 0.0 && s.is_finite() => Ok(Distribution::Zipf(s)),
                _ => Err(format!("bad Zipf exponent {s:?}")),
            },
            _ => Err(format!(
                "unknown distribution {text:?} (uniform, sequential, zipf, zipf:S)"
            )),
        }
    }
}

/// Most keys a Zipf distribution takes (its table is 8 bytes per key).
pub const MAX_ZIPF_KEYS: u64 = 10_000_000;

/// Picks key indexes.
enum Keys {
    Uniform(u64),
    /// Cumulative probabilities.
    Zipf(Arc<[f64]>),
    /// The next key to take, and how many there are.
    Sequential(AtomicU64, u64),
}

impl Keys {
    fn new(keys: u64, distribution: Distribution) -> Keys {
        match distribution {
            Distribution::Uniform => Keys::Uniform(keys),
            Distribution::Sequential => Keys::Sequential(AtomicU64::new(0), keys),
            Distribution::Zipf(s) => {
                let mut cdf = Vec::with_capacity(keys as usize);
                let mut sum = 0.0;
                for i in 1..=keys {
                    sum += 1.0 / (i as f64).powf(s);
                    cdf.push(sum);
                }
                cdf.iter_mut().for_each(|c| *c /= sum);
                Keys::Zipf(cdf.into())
            }
        }
    }

    fn pick(&self, rng: &mut impl Rng) -> u64 {
        match self {
            Keys::Uniform(n) => rng.random_range(0..*n),
            Keys::Zipf(cdf) => {
                let u: f64 = rng.random();
                cdf.partition_point(|c| *c < u).min(cdf.len() - 1) as u64
            }
            Keys::Sequential(next, n) => next.fetch_add(1, Ordering::Relaxed) % n,
        }
    }
}

/// Settings of `tidectl bench`.
#[derive(Debug)]
pub struct Bench {
    pub namespace: String,
    pub concurrency: usize,
    pub size: usize,
    pub seconds: u64,
    pub count: Option<u64>,
    pub mix: Mix,
    pub keys: u64,
    pub distribution: Distribution,
    pub prefix: String,
    pub prefill: bool,
    pub seed: u64,
}

/// What one operation saw.
#[derive(Default)]
struct OpTally {
    /// Latencies of the successful ones, microseconds.
    latencies_us: Vec<u32>,
    errors: BTreeMap<&'static str, u64>,
}

impl OpTally {
    fn merge(&mut self, other: OpTally) {
        self.latencies_us.extend(other.latencies_us);
        for (code, n) in other.errors {
            *self.errors.entry(code).or_default() += n;
        }
    }
}

fn code_name(code: ErrorCode) -> &'static str {
    let name = code.as_str_name();
    name.strip_prefix("ERROR_CODE_").unwrap_or(name)
}

/// Shared between the workers and the progress printer.
struct Progress {
    done: [AtomicU64; 4],
    failed: AtomicU64,
    started: AtomicU64,
    stop: AtomicBool,
}

async fn one(
    client: &Client,
    settings: &Bench,
    op: usize,
    key: &[u8],
    value: &[u8],
) -> Result<(), ErrorCode> {
    let namespace = &settings.namespace;
    let result = match op {
        0 => client.put(namespace, key, value).await.map(|_| ()),
        1 => client.get(namespace, key).await.map(|_| ()),
        2 => client.exists(namespace, key).await.map(|_| ()),
        _ => client.delete(namespace, key).await.map(|_| ()),
    };
    result.map_err(|e| e.code())
}

async fn worker(
    client: Client,
    settings: Arc<Bench>,
    keys: Arc<Keys>,
    progress: Arc<Progress>,
    value: Arc<[u8]>,
    worker: usize,
    deadline: Instant,
) -> [OpTally; 4] {
    let mut tallies: [OpTally; 4] = Default::default();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(
        settings.seed ^ (worker as u64).wrapping_mul(0x9E37_79B9),
    );
    loop {
        if progress.stop.load(Ordering::Relaxed) || Instant::now() >= deadline {
            break;
        }
        if let Some(count) = settings.count
            && progress.started.fetch_add(1, Ordering::Relaxed) >= count
        {
            break;
        }
        let op = settings.mix.pick(&mut rng);
        let key = format!("{}-{}", settings.prefix, keys.pick(&mut rng));
        let began = Instant::now();
        match one(&client, &settings, op, key.as_bytes(), &value).await {
            Ok(()) => {
                let us = began.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
                tallies[op].latencies_us.push(us);
                progress.done[op].fetch_add(1, Ordering::Relaxed);
            }
            Err(code) => {
                *tallies[op].errors.entry(code_name(code)).or_default() += 1;
                progress.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    tallies
}

/// Writes every key once (not measured).
async fn prefill(client: &Client, settings: &Bench, value: &Arc<[u8]>) -> Outcome {
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..settings.concurrency {
        let (client, next) = (client.clone(), next.clone());
        let (namespace, prefix, keys) = (
            settings.namespace.clone(),
            settings.prefix.clone(),
            settings.keys,
        );
        let value = value.clone();
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= keys {
                    return Ok::<(), tidepool_client::Error>(());
                }
                client
                    .put(&namespace, format!("{prefix}-{i}").as_bytes(), &value)
                    .await?;
            }
        });
    }
    while let Some(result) = tasks.join_next().await {
        match result {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(Failure::from(e)),
            Err(e) => return Err(usage(format!("a prefill task failed: {e}"))),
        }
    }
    Ok(())
}

fn percentile(sorted: &[u32], q: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Runs the bench and prints its report.
pub async fn bench(json: bool, client: &Client, settings: Bench) -> Outcome {
    if settings.keys == 0 {
        return Err(usage("--keys must be at least 1"));
    }
    if matches!(settings.distribution, Distribution::Zipf(_)) && settings.keys > MAX_ZIPF_KEYS {
        return Err(usage(format!(
            "--keys is at most {MAX_ZIPF_KEYS} with a Zipf distribution"
        )));
    }
    if settings.seconds == 0 && settings.count.is_none() {
        return Err(usage("give --seconds or --count"));
    }
    // One value, shared by every worker (a copy each made memory grow
    // with --concurrency times --size).
    let value: Arc<[u8]> = vec![0xA5u8; settings.size].into();
    if settings.prefill && settings.mix.reads() {
        let began = Instant::now();
        prefill(client, &settings, &value).await?;
        eprintln!(
            "prefill: {} keys of {} B in {:.1} s",
            settings.keys,
            settings.size,
            began.elapsed().as_secs_f64()
        );
    }
    let settings = Arc::new(settings);
    let keys = Arc::new(Keys::new(settings.keys, settings.distribution));
    let progress = Arc::new(Progress {
        done: Default::default(),
        failed: AtomicU64::new(0),
        started: AtomicU64::new(0),
        stop: AtomicBool::new(false),
    });
    let started = Instant::now();
    let deadline = if settings.seconds > 0 {
        started + Duration::from_secs(settings.seconds)
    } else {
        started + Duration::from_secs(365 * 24 * 3600)
    };
    let mut workers = Vec::new();
    for n in 0..settings.concurrency.max(1) {
        workers.push(tokio::spawn(worker(
            client.clone(),
            settings.clone(),
            keys.clone(),
            progress.clone(),
            value.clone(),
            n,
            deadline,
        )));
    }
    let ticker = tokio::spawn(report_progress(progress.clone(), started));
    let mut tallies: [OpTally; 4] = Default::default();
    for task in workers {
        let result = task
            .await
            .map_err(|e| usage(format!("a bench worker failed: {e}")))?;
        for (tally, more) in tallies.iter_mut().zip(result) {
            tally.merge(more);
        }
    }
    progress.stop.store(true, Ordering::Relaxed);
    ticker.abort();
    let elapsed = started.elapsed();
    summarize(json, &settings, &mut tallies, elapsed)
}

async fn report_progress(progress: Arc<Progress>, started: Instant) {
    let mut last = [0u64; 4];
    let mut interval = tokio::time::interval(Duration::from_secs(1));
    interval.tick().await;
    loop {
        interval.tick().await;
        let mut line = format!("{:>4.0}s", started.elapsed().as_secs_f64());
        for (op, name) in OPS.iter().enumerate() {
            let now = progress.done[op].load(Ordering::Relaxed);
            if now > 0 {
                line.push_str(&format!("  {name} {}/s", now - last[op]));
            }
            last[op] = now;
        }
        line.push_str(&format!(
            "  errors {}",
            progress.failed.load(Ordering::Relaxed)
        ));
        eprintln!("{line}");
    }
}

fn summarize(
    json: bool,
    settings: &Bench,
    tallies: &mut [OpTally; 4],
    elapsed: Duration,
) -> Outcome {
    let seconds = elapsed.as_secs_f64();
    let mut rows = serde_json::Map::new();
    let mut text = format!(
        "{} workers, {} B values, {} keys ({:?}), {:.1} s\n| op | ops | ops/s | MiB/s | p50 | p90 | p99 | p99.9 | max | errors |\n|---|---|---|---|---|---|---|---|---|---|\n",
        settings.concurrency, settings.size, settings.keys, settings.distribution, seconds
    );
    let mut failed = false;
    let (mut total_ops, mut total_errors) = (0u64, 0u64);
    for (op, tally) in tallies.iter_mut().enumerate() {
        if settings.mix.0[op] == 0 {
            continue;
        }
        tally.latencies_us.sort_unstable();
        let count = tally.latencies_us.len() as u64;
        let errors: u64 = tally.errors.values().sum();
        total_ops += count;
        total_errors += errors;
        failed |= tally.errors.keys().any(|code| *code != "NOT_FOUND");
        let rate = count as f64 / seconds;
        let carries = matches!(op, 0 | 1);
        let mib = if carries {
            rate * settings.size as f64 / f64::from(1 << 20)
        } else {
            0.0
        };
        let p = |q| percentile(&tally.latencies_us, q);
        let errors_text: Vec<String> = tally
            .errors
            .iter()
            .map(|(c, n)| format!("{c} {n}"))
            .collect();
        text.push_str(&format!(
            "| {} | {count} | {rate:.0} | {mib:.1} | {} µs | {} µs | {} µs | {} µs | {} µs | {} |\n",
            OPS[op],
            p(0.5),
            p(0.9),
            p(0.99),
            p(0.999),
            tally.latencies_us.last().copied().unwrap_or(0),
            if errors_text.is_empty() { "0".to_string() } else { errors_text.join(", ") },
        ));
        rows.insert(
            OPS[op].into(),
            json!({
                "count": count,
                "ops_per_s": rate,
                "mib_per_s": mib,
                "p50_us": p(0.5),
                "p90_us": p(0.9),
                "p99_us": p(0.99),
                "p999_us": p(0.999),
                "max_us": tally.latencies_us.last().copied().unwrap_or(0),
                "errors": tally.errors,
            }),
        );
    }
    text.push_str(&format!(
        "total: {total_ops} operations, {:.0}/s, {total_errors} failed",
        total_ops as f64 / seconds
    ));
    print(
        json,
        json!({
            "namespace": settings.namespace,
            "concurrency": settings.concurrency,
            "value_bytes": settings.size,
            "keys": settings.keys,
            "distribution": format!("{:?}", settings.distribution),
            "seconds": seconds,
            "ops": rows,
            "total": {"count": total_ops, "ops_per_s": total_ops as f64 / seconds, "failed": total_errors},
        }),
        text,
    );
    if failed {
        return Err(Failure {
            code: 1,
            message: "some operations failed (errors by code above)".into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixes_and_distributions_parse_or_say_why() {
        assert_eq!("put=1,get=3".parse::<Mix>().unwrap(), Mix([1, 3, 0, 0]));
        assert_eq!("get".parse::<Mix>().unwrap(), Mix([0, 1, 0, 0]));
        assert!("put=0".parse::<Mix>().is_err());
        // Weights whose sum wraps made every worker panic.
        assert!("put=4294967295,get=1".parse::<Mix>().is_err());
        assert!(
            "scan=1"
                .parse::<Mix>()
                .unwrap_err()
                .contains("unknown operation")
        );
        assert_eq!(
            "zipf:1.2".parse::<Distribution>().unwrap(),
            Distribution::Zipf(1.2)
        );
        assert!("zipf:-1".parse::<Distribution>().is_err());
        assert!("pareto".parse::<Distribution>().is_err());
        assert_eq!(
            "sequential".parse::<Distribution>().unwrap(),
            Distribution::Sequential
        );
        let keys = Keys::new(3, Distribution::Sequential);
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        let taken: Vec<u64> = (0..7).map(|_| keys.pick(&mut rng)).collect();
        assert_eq!(taken, [0, 1, 2, 0, 1, 2, 0]);
    }

    #[test]
    fn zipf_favours_the_first_keys_and_stays_in_range() {
        let keys = Keys::new(1_000, Distribution::Zipf(1.0));
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        let mut first = 0;
        for _ in 0..10_000 {
            let k = keys.pick(&mut rng);
            assert!(k < 1_000);
            first += u32::from(k == 0);
        }
        // P(first) = 1 / H(1000) ≈ 0.134.
        assert!((1_100..1_600).contains(&first), "{first}");
        assert_eq!(percentile(&[1, 2, 3, 4], 0.5), 2);
        assert_eq!(percentile(&[1, 2, 3, 4], 0.99), 4);
    }
}
