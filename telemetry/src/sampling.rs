//! Sampling decided where a trace enters the process, before its spans
//! cost anything: a layer around the OpenTelemetry layer that lets through
//! only the spans of sampled traces.
//!
//! `tracing-opentelemetry` makes every span it sees an OpenTelemetry span
//! builder (attributes copied, the clock read, ids drawn), runs the
//! sampler when the span starts and drops an unsampled span only when it
//! ends, so a process exporting 1% of its traces paid about what it paid
//! for all of them (`benchmarks/RESULTS.md`, issue 36). [`Sampling`] takes
//! the decision when a span is made:
//!
//! | the span's parent (explicit, else the current span) | the span |
//! |---|---|
//! | one this layer let through | let through (its trace is sampled) |
//! | one it kept back | kept back |
//! | none, and the span continues a caller's trace ([`trace_context::continued`]) | the [`Rule`] on the caller's decision |
//! | none | the [`Rule`] for a new trace (a ratio) |
//!
//! A kept-back span never reaches the OpenTelemetry layer; it carries an
//! [`Untraced`] extension (the caller's, its parent's or a new trace id,
//! and a span id of its own) so that JSON log lines inside it carry ids
//! and calls it makes pass the trace on unsampled, as an unsampled
//! OpenTelemetry span would. What is let through is sampled: the SDK's
//! sampler is `AlwaysOn` (parent-based when the rule is: a span given an
//! unsampled caller's context by hand, after it was made, follows it).

use std::any::TypeId;

use opentelemetry_sdk::trace::{IdGenerator as _, RandomIdGenerator};
use tidepool_security::trace_context::{self, RemoteParent, Untraced, UntracedLookup};
use tracing::span::{Attributes, Id, Record};
use tracing::{Dispatch, Event, Metadata, Subscriber, subscriber::Interest};
use tracing_subscriber::Registry;
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::registry::LookupSpan;

/// Which traces are sampled: the OpenTelemetry SDK's samplers
/// (`OTEL_TRACES_SAMPLER`), decided here.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rule {
    /// The share of new traces sampled (`0..=1`), decided on the trace
    /// id's low 63 bits as the SDK's `TraceIdRatioBased` does.
    pub ratio: f64,
    /// Whether a caller's decision is followed (`parentbased_*`; the
    /// default). Otherwise the ratio also decides for callers' traces, on
    /// their trace ids.
    pub parent_based: bool,
}

impl Default for Rule {
    /// The SDK's default: `parentbased_always_on`.
    fn default() -> Self {
        Rule {
            ratio: 1.0,
            parent_based: true,
        }
    }
}

impl Rule {
    /// `--trace-sampling` (parent-based with this ratio) when given, else
    /// `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG`.
    pub fn new(flag: Option<f64>) -> anyhow::Result<Rule> {
        if let Some(ratio) = flag {
            anyhow::ensure!(
                (0.0..=1.0).contains(&ratio),
                "--trace-sampling must be within 0..=1, not {ratio}"
            );
            return Ok(Rule {
                ratio,
                parent_based: true,
            });
        }
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        Ok(Rule::from_env(
            env("OTEL_TRACES_SAMPLER").as_deref(),
            env("OTEL_TRACES_SAMPLER_ARG").as_deref(),
        ))
    }

    /// The rule the OpenTelemetry specification gives these variables:
    /// `always_on`, `always_off`, `traceidratio`, and each of them
    /// `parentbased_`; the ratio from the argument (`1` when it is missing
    /// or not within `0..=1`). An unknown sampler falls back to the
    /// default, with a warning.
    pub fn from_env(sampler: Option<&str>, arg: Option<&str>) -> Rule {
        let ratio = || {
            arg.and_then(|a| a.trim().parse::<f64>().ok())
                .filter(|r| (0.0..=1.0).contains(r))
                .unwrap_or(1.0)
        };
        let sampler = sampler.map(|s| s.trim().to_ascii_lowercase());
        let (ratio, parent_based) = match sampler.as_deref() {
            None | Some("parentbased_always_on") => (1.0, true),
            Some("always_on") => (1.0, false),
            Some("always_off") => (0.0, false),
            Some("parentbased_always_off") => (0.0, true),
            Some("traceidratio") => (ratio(), false),
            Some("parentbased_traceidratio") => (ratio(), true),
            Some(other) => {
                eprintln!(
                    "OTEL_TRACES_SAMPLER={other:?} is not supported here: using parentbased_always_on"
                );
                (1.0, true)
            }
        };
        Rule {
            ratio,
            parent_based,
        }
    }

    /// Whether the trace `trace_id` is sampled by the ratio.
    fn by_ratio(&self, trace_id: &[u8; 16]) -> bool {
        if self.ratio >= 1.0 {
            return true;
        }
        let low = u64::from_be_bytes(trace_id[8..].try_into().expect("8 bytes")) >> 1;
        (low as f64) < self.ratio * (1u64 << 63) as f64
    }

    /// Whether a trace starting here (`remote`: continuing a caller's) is
    /// sampled, given its trace id.
    fn decide(&self, remote: Option<RemoteParent>, trace_id: &[u8; 16]) -> bool {
        match remote {
            Some(remote) if self.parent_based => remote.sampled,
            _ => self.by_ratio(trace_id),
        }
    }
}

/// The layer: `inner` (the OpenTelemetry layer) sees only the spans of
/// sampled traces, and the events inside them.
pub struct Sampling<L> {
    inner: L,
    rule: Rule,
    ids: RandomIdGenerator,
    lookup: UntracedLookup,
}

impl<L> Sampling<L> {
    /// `inner` behind `rule`.
    pub fn new(inner: L, rule: Rule) -> Self {
        Sampling {
            inner,
            rule,
            ids: RandomIdGenerator::default(),
            lookup: UntracedLookup(untraced_in),
        }
    }
}

/// The [`Untraced`] ids of span `id`, looked up in the registry under
/// `dispatch`.
fn untraced_in(dispatch: &Dispatch, id: &Id) -> Option<Untraced> {
    let registry = dispatch.downcast_ref::<Registry>()?;
    let span = registry.span(id)?;
    span.extensions().get::<Untraced>().copied()
}

impl<L> Sampling<L> {
    fn kept_back<S>(id: &Id, ctx: &Context<'_, S>) -> bool
    where
        S: Subscriber + for<'a> LookupSpan<'a>,
    {
        ctx.span(id)
            .is_some_and(|span| span.extensions().get::<Untraced>().is_some())
    }
}

impl<S, L> Layer<S> for Sampling<L>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    L: Layer<S>,
{
    fn on_register_dispatch(&self, subscriber: &Dispatch) {
        self.inner.on_register_dispatch(subscriber);
    }

    fn on_layer(&mut self, subscriber: &mut S) {
        self.inner.on_layer(subscriber);
    }

    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        self.inner.register_callsite(metadata)
    }

    fn enabled(&self, metadata: &Metadata<'_>, ctx: Context<'_, S>) -> bool {
        self.inner.enabled(metadata, ctx)
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        // `None`: let through; else the trace id of a kept-back span. The
        // parent as the OpenTelemetry layer would find it: an explicit one
        // it does not see makes the span a root, as there.
        let kept_back = {
            let parent = match attrs.parent() {
                Some(parent) => ctx.span(parent),
                None if attrs.is_contextual() => ctx.lookup_current(),
                None => None,
            };
            match parent {
                Some(parent) => parent
                    .extensions()
                    .get::<Untraced>()
                    .map(|untraced| untraced.trace_id),
                None => {
                    let remote = trace_context::take_remote_parent();
                    let trace_id = match remote {
                        Some(remote) => remote.trace_id,
                        None => self.ids.new_trace_id().to_bytes(),
                    };
                    (!self.rule.decide(remote, &trace_id)).then_some(trace_id)
                }
            }
        };
        let Some(trace_id) = kept_back else {
            return self.inner.on_new_span(attrs, id, ctx);
        };
        let untraced = Untraced {
            trace_id,
            span_id: self.ids.new_span_id().to_bytes(),
        };
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(untraced);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if !Self::kept_back(id, &ctx) {
            self.inner.on_record(id, values, ctx);
        }
    }

    fn on_follows_from(&self, id: &Id, follows: &Id, ctx: Context<'_, S>) {
        if !Self::kept_back(id, &ctx) && !Self::kept_back(follows, &ctx) {
            self.inner.on_follows_from(id, follows, ctx);
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let span = match event.parent() {
            Some(parent) => ctx.span(parent),
            None if event.is_contextual() => ctx.lookup_current(),
            None => None,
        };
        if span.is_some_and(|span| span.extensions().get::<Untraced>().is_some()) {
            return;
        }
        self.inner.on_event(event, ctx);
    }

    // Entering and leaving: the OpenTelemetry layer finds nothing of its
    // own on a kept-back span and does nothing.
    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        self.inner.on_enter(id, ctx);
    }

    fn on_exit(&self, id: &Id, ctx: Context<'_, S>) {
        self.inner.on_exit(id, ctx);
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        if !Self::kept_back(&id, &ctx) {
            self.inner.on_close(id, ctx);
        }
    }

    fn on_id_change(&self, old: &Id, new: &Id, ctx: Context<'_, S>) {
        self.inner.on_id_change(old, new, ctx);
    }

    // `Layer::downcast_raw` is an unsafe trait method: overriding it is how
    // a layer offers a type to `Dispatch::downcast_ref` (here the
    // `UntracedLookup`, and whatever the inner layer offers).
    #[allow(unsafe_code)]
    unsafe fn downcast_raw(&self, id: TypeId) -> Option<*const ()> {
        if id == TypeId::of::<Self>() {
            Some(self as *const Self as *const ())
        } else if id == TypeId::of::<UntracedLookup>() {
            Some(&self.lookup as *const UntracedLookup as *const ())
        } else {
            // SAFETY: the inner layer answers for its own types (pointers
            // into itself, which lives as long as this layer), as it would
            // unwrapped.
            unsafe { self.inner.downcast_raw(id) }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
        TracerProvider as _,
    };
    use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
    use tracing_subscriber::layer::SubscriberExt as _;

    use super::*;

    /// An exported span: its name and trace id.
    type Named = (String, [u8; 16]);

    /// The spans exported.
    #[derive(Clone, Debug, Default)]
    struct Exported(Arc<Mutex<Vec<Named>>>);

    impl SpanExporter for Exported {
        fn export(
            &self,
            batch: Vec<SpanData>,
        ) -> impl std::future::Future<Output = opentelemetry_sdk::error::OTelSdkResult> + Send
        {
            self.0.lock().unwrap().extend(batch.into_iter().map(|span| {
                (
                    span.name.to_string(),
                    span.span_context.trace_id().to_bytes(),
                )
            }));
            std::future::ready(Ok(()))
        }
    }

    /// A caller's context, sampled or not.
    fn caller(trace_id: [u8; 16], sampled: bool) -> opentelemetry::Context {
        let flags = if sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        };
        opentelemetry::Context::new().with_remote_span_context(SpanContext::new(
            TraceId::from_bytes(trace_id),
            SpanId::from_bytes([7; 8]),
            flags,
            true,
            TraceState::default(),
        ))
    }

    /// Sampling none of the traces it starts, a process exports exactly
    /// the spans of the traces its callers sampled; the spans of the
    /// others (and every span made inside them, explicitly parented or
    /// current) never reach OpenTelemetry, carry their trace's id, and
    /// pass the trace on unsampled.
    #[test]
    fn only_sampled_traces_reach_opentelemetry() {
        let exported = Exported::default();
        let provider = SdkTracerProvider::builder()
            .with_sampler(opentelemetry_sdk::trace::Sampler::AlwaysOn)
            .with_simple_exporter(exported.clone())
            .build();
        let rule = Rule {
            ratio: 0.0,
            parent_based: true,
        };
        let subscriber = tracing_subscriber::registry().with(Sampling::new(
            tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("test"))
                .with_context_activation(false)
                .with_tracked_inactivity(false),
            rule,
        ));
        tracing::subscriber::with_default(subscriber, || {
            // A trace this process starts: not sampled.
            let root = tracing::info_span!("root");
            let root_ids = trace_context::untraced(&root).expect("kept back");
            let inside = root.in_scope(|| tracing::info_span!("inside"));
            let explicit = tracing::info_span!(parent: &inside, "explicit");
            for span in [&inside, &explicit] {
                let ids = trace_context::untraced(span).expect("kept back");
                assert_eq!(ids.trace_id, root_ids.trace_id);
                assert_ne!(ids.span_id, root_ids.span_id);
            }
            tracing::info!(parent: &explicit, "an event inside");
            let mut headers = http::HeaderMap::new();
            trace_context::inject(&explicit, &mut headers);
            let sent = headers["traceparent"].to_str().unwrap();
            assert!(sent.starts_with("00-") && sent.ends_with("-00"), "{sent}");
            let passed_on = trace_context::extract_from_headers(&headers).unwrap();
            assert_eq!(
                passed_on.span().span_context().trace_id().to_bytes(),
                root_ids.trace_id
            );
            assert!(!trace_context::sampled(&explicit));

            // A caller that did not sample: kept back, its trace id kept.
            let unsampled = trace_context::continued(
                Some(caller([1; 16], false)),
                || tracing::info_span!(parent: None, "unsampled request"),
            );
            assert_eq!(
                trace_context::untraced(&unsampled).unwrap().trace_id,
                [1; 16]
            );

            // A caller that sampled: exported, with what is made inside.
            let sampled = trace_context::continued(
                Some(caller([2; 16], true)),
                || tracing::info_span!(parent: None, "sampled request"),
            );
            assert!(trace_context::untraced(&sampled).is_none());
            assert!(trace_context::sampled(&sampled));
            let child = sampled.in_scope(|| tracing::info_span!("sampled child"));
            let mut headers = http::HeaderMap::new();
            trace_context::inject(&child, &mut headers);
            assert!(headers["traceparent"].to_str().unwrap().ends_with("-01"));
            drop((root, inside, explicit, unsampled, child, sampled));
            // The next root is no caller's: the decision was taken once.
            drop(tracing::info_span!("another root"));
        });
        let _ = provider.force_flush();
        let mut names = exported.0.lock().unwrap().clone();
        names.sort();
        assert_eq!(
            names,
            vec![
                ("sampled child".to_string(), [2; 16]),
                ("sampled request".to_string(), [2; 16]),
            ]
        );
    }

    /// Sampling every trace it starts, a process exports a new trace's
    /// spans and follows a caller that did not sample.
    #[test]
    fn a_process_sampling_all_it_starts_still_follows_its_callers() {
        let exported = Exported::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exported.clone())
            .build();
        let subscriber = tracing_subscriber::registry().with(Sampling::new(
            tracing_opentelemetry::layer().with_tracer(provider.tracer("test")),
            Rule::default(),
        ));
        tracing::subscriber::with_default(subscriber, || {
            let root = tracing::info_span!("root");
            root.in_scope(|| drop(tracing::info_span!("child")));
            drop(root);
            let unsampled = trace_context::continued(
                Some(caller([3; 16], false)),
                || tracing::info_span!(parent: None, "unsampled request"),
            );
            unsampled.in_scope(|| drop(tracing::info_span!("unsampled child")));
        });
        let _ = provider.force_flush();
        let mut names: Vec<String> = exported
            .0
            .lock()
            .unwrap()
            .iter()
            .map(|(n, _)| n.clone())
            .collect();
        names.sort();
        assert_eq!(names, ["child", "root"]);
    }

    #[test]
    fn the_environment_names_the_specifications_samplers() {
        let rule = |s: Option<&str>, a: Option<&str>| Rule::from_env(s, a);
        assert_eq!(rule(None, None), Rule::default());
        assert_eq!(
            rule(Some("parentbased_traceidratio"), Some("0.25")),
            Rule {
                ratio: 0.25,
                parent_based: true
            }
        );
        assert_eq!(
            rule(Some("traceidratio"), Some("0.5")),
            Rule {
                ratio: 0.5,
                parent_based: false
            }
        );
        assert_eq!(rule(Some("always_off"), None).ratio, 0.0);
        assert!(rule(Some("parentbased_always_off"), None).parent_based);
        // A ratio out of range or unreadable is 1, as the SDK reads it.
        assert_eq!(rule(Some("traceidratio"), Some("7")).ratio, 1.0);
        assert_eq!(rule(Some("traceidratio"), Some("half")).ratio, 1.0);
        assert_eq!(rule(Some("jaeger_remote"), None), Rule::default());
        assert!(Rule::new(Some(1.5)).is_err());
    }

    #[test]
    fn a_ratio_samples_its_share_of_trace_ids_and_callers_decide_when_parent_based() {
        let rule = Rule {
            ratio: 0.25,
            parent_based: true,
        };
        let ids = RandomIdGenerator::default();
        let sampled = (0..20_000)
            .filter(|_| rule.decide(None, &ids.new_trace_id().to_bytes()))
            .count();
        assert!((4_000..6_000).contains(&sampled), "{sampled} of 20,000");
        let caller = |sampled| {
            Some(RemoteParent {
                trace_id: [0xff; 16],
                sampled,
            })
        };
        // All ones: above any ratio below 1.
        assert!(rule.decide(caller(true), &[0xff; 16]));
        assert!(!rule.decide(caller(false), &[0; 16]));
        let own = Rule {
            parent_based: false,
            ..rule
        };
        assert!(!own.decide(caller(true), &[0xff; 16]));
        assert!(own.decide(caller(false), &[0; 16]));
        assert!(!Rule { ratio: 0.0, ..own }.decide(None, &[0; 16]));
        assert!(Rule { ratio: 1.0, ..own }.decide(None, &[0xff; 16]));
    }
}
