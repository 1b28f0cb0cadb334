//! Property-based fuzzing of decoders on stable Rust: well-formed inputs
//! (seeds) mutated by a seeded generator — bit flips, overwritten length
//! fields, truncation, extension, splices, random bytes — each fed to the
//! decoder under test, which must return (a value or a typed error)
//! without panicking and without one allocation out of proportion to its
//! input.
//!
//! A test binary that fuzzes installs [`CountingAllocator`] as its global
//! allocator (the largest single allocation is what is bounded) and runs
//! its targets from one `#[test]`, so no other test allocates meanwhile:
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOCATOR: tidepool_testkit::fuzz::CountingAllocator =
//!     tidepool_testkit::fuzz::CountingAllocator;
//! ```
//!
//! Cases per target: `FUZZ_CASES` (default [`DEFAULT_CASES`], what `make
//! ci` runs; raise it for a long run). Seed: `FUZZ_SEED` (printed).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Cases per target in `make ci`.
pub const DEFAULT_CASES: usize = 3_000;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, remembering the largest single allocation since
/// [`reset_largest`].
#[derive(Debug)]
pub struct CountingAllocator;

// SAFETY: every call is forwarded unchanged to the system allocator; the
// only addition is an atomic maximum of the requested size.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Forgets the largest allocation seen so far.
pub fn reset_largest() {
    LARGEST.store(0, Ordering::Relaxed);
}

/// The largest single allocation since [`reset_largest`].
pub fn largest() -> usize {
    LARGEST.load(Ordering::Relaxed)
}

/// Decodes bytes: `true` when accepted, `false` for a typed error.
pub type Decode = Box<dyn Fn(&[u8]) -> bool>;

/// A decoder under test.
pub struct Target {
    /// What it decodes (for messages).
    pub name: &'static str,
    /// Well-formed inputs.
    pub seeds: Vec<Vec<u8>>,
    /// Decodes `bytes`: `true` when accepted, `false` for a typed error.
    /// Must not panic.
    pub decode: Decode,
}

/// Cases per target: `FUZZ_CASES` or [`DEFAULT_CASES`].
pub fn cases() -> usize {
    std::env::var("FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

/// Largest single allocation a decoder may make for `len` input bytes.
pub fn allocation_bound(len: usize) -> usize {
    (1 << 20) + 64 * len
}

/// Runs decoders given as `(name, seeds, decode)` — the shape the crates'
/// hidden `fuzzing::targets()` return — with the seed from `FUZZ_SEED`
/// (printed) and [`cases`] mutants each, printing how many each accepted.
pub fn run_all(targets: Vec<(&'static str, Vec<Vec<u8>>, Decode)>) {
    let seed = crate::seed_from_env("FUZZ_SEED");
    let targets: Vec<Target> = targets
        .into_iter()
        .map(|(name, seeds, decode)| Target {
            name,
            seeds,
            decode,
        })
        .collect();
    let cases = cases();
    for (name, accepted) in run(&targets, seed, cases) {
        println!("{name}: {accepted} of {cases} mutants accepted");
    }
}

/// Runs every target: each seed as is, then `cases` mutants. Panics (with
/// the seed, the case and the input in hex) at the first panic inside a
/// decoder or allocation beyond [`allocation_bound`]. Returns, per target,
/// how many mutants were accepted (a decoder accepting most mutants checks
/// too little).
pub fn run(targets: &[Target], seed: u64, cases: usize) -> Vec<(&'static str, usize)> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut accepted = Vec::new();
    for target in targets {
        assert!(!target.seeds.is_empty(), "{}: no seeds", target.name);
        for (i, input) in target.seeds.iter().enumerate() {
            assert!(
                check(target, input, seed, i),
                "{}: seed input {i} is not accepted",
                target.name
            );
        }
        let mut count = 0;
        for case in 0..cases {
            let input = mutate(&mut rng, &target.seeds);
            if check(target, &input, seed, case) {
                count += 1;
            }
        }
        accepted.push((target.name, count));
    }
    accepted
}

/// One input through the decoder: no panic, bounded allocation.
fn check(target: &Target, input: &[u8], seed: u64, case: usize) -> bool {
    reset_largest();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (target.decode)(input)));
    let largest = largest();
    let hex: String = input.iter().map(|b| format!("{b:02x}")).collect();
    let ok = match outcome {
        Ok(ok) => ok,
        Err(_) => panic!(
            "{}: the decoder panicked (FUZZ_SEED={seed}, case {case}) on {} bytes: {hex}",
            target.name,
            input.len()
        ),
    };
    assert!(
        largest <= allocation_bound(input.len()),
        "{}: one allocation of {largest} bytes for {} input bytes (FUZZ_SEED={seed}, case {case}): {hex}",
        target.name,
        input.len()
    );
    ok
}

/// A mutant of one of `seeds` (or of two spliced, or random bytes).
fn mutate(rng: &mut SmallRng, seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut bytes = seeds[rng.random_range(0..seeds.len())].clone();
    let rounds = rng.random_range(1..=4);
    for _ in 0..rounds {
        match rng.random_range(0..8) {
            0 if !bytes.is_empty() => {
                let at = rng.random_range(0..bytes.len());
                bytes[at] ^= 1 << rng.random_range(0..8);
            }
            1 if !bytes.is_empty() => {
                let at = rng.random_range(0..bytes.len());
                bytes[at] = rng.random();
            }
            2 if bytes.len() >= 4 => {
                // A length or count field: huge, zero, or off by a little.
                let at = rng.random_range(0..=bytes.len() - 4);
                let value: u32 = match rng.random_range(0..4) {
                    0 => u32::MAX,
                    1 => 0,
                    2 => rng.random_range(0..1 << 24),
                    _ => u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4"))
                        .wrapping_add(rng.random_range(0..16))
                        .wrapping_sub(8),
                };
                bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
            }
            3 if bytes.len() >= 8 => {
                let at = rng.random_range(0..=bytes.len() - 8);
                let value: u64 = if rng.random_bool(0.5) {
                    u64::MAX
                } else {
                    rng.random()
                };
                bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
            }
            4 => {
                let keep = rng.random_range(0..=bytes.len());
                bytes.truncate(keep);
            }
            5 => {
                let extra = rng.random_range(1..64);
                bytes.extend((0..extra).map(|_| rng.random::<u8>()));
            }
            6 => {
                let other = &seeds[rng.random_range(0..seeds.len())];
                let cut = rng.random_range(0..=bytes.len());
                let from = rng.random_range(0..=other.len());
                bytes.truncate(cut);
                bytes.extend_from_slice(&other[from..]);
            }
            _ => {
                let len = rng.random_range(0..256);
                bytes = (0..len).map(|_| rng.random()).collect();
            }
        }
    }
    bytes
}
