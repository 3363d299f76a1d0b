//! Log lines on stderr, as text or JSON (`--log-format`), filtered by
//! `--log`.
//!
//! Text is coloured only when stderr is a terminal and `NO_COLOR` is unset
//! or empty (<https://no-color.org>): escape codes in a file or a log
//! collector are noise.
//!
//! JSON lines have tracing-subscriber's shape (`timestamp`, `level`,
//! `fields`, `target`), written by [`JsonLines`] so that a list logged with
//! `?` (`masters = ?topo.masters`) is a JSON array rather than a string
//! holding Rust's `Debug` text: tracing-subscriber's own JSON writer turns
//! every `Debug` value into a string, and its `valuable` support needs
//! `--cfg tracing_unstable` for the whole build.

use std::fmt;
use std::io::IsTerminal;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

use crate::config::{ConfigError, LogFormat};

/// Sets up logging to stderr in the chosen format; a filter that does not
/// parse is a configuration error, not a silent `info`.
pub fn init(format: LogFormat, filter: &str) -> Result<(), ConfigError> {
    let env_filter = EnvFilter::builder()
        .parse(filter)
        .map_err(|e| ConfigError(format!("--log filter {filter:?} is not valid: {e}")))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(env_filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour());
    // Fails only when a subscriber is already set (tests, an embedding
    // program), which then keeps logging as it was set up.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.event_format(JsonLines).try_init(),
    };
    Ok(())
}

/// Whether text logs get ANSI colours.
fn colour() -> bool {
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    !no_color && std::io::stderr().is_terminal()
}

/// One JSON object per event.
pub struct JsonLines;

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let mut fields = Fields::default();
        event.record(&mut fields);
        let timestamp = time::OffsetDateTime::now_utc()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default();
        let mut line = Map::new();
        line.insert("timestamp".into(), timestamp.into());
        line.insert("level".into(), meta.level().as_str().into());
        line.insert("fields".into(), Value::Object(fields.0));
        line.insert("target".into(), meta.target().into());
        let text = serde_json::to_string(&line).map_err(|_| fmt::Error)?;
        writeln!(writer, "{text}")
    }
}

/// An event's fields as JSON values.
#[derive(Default)]
struct Fields(Map<String, Value>);

impl Fields {
    fn put(&mut self, field: &Field, value: impl Into<Value>) {
        self.0.insert(field.name().to_owned(), value.into());
    }
}

impl Visit for Fields {
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, value);
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, value);
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, value);
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, value);
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, value);
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.put(field, value.to_string());
    }

    /// The `Debug` text of a list of strings or numbers (`["a", "b"]`,
    /// `[1, 2]`) is valid JSON: such a value is written as the array it is.
    /// Anything else stays text.
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let text = format!("{value:?}");
        if field.name() != "message" && text.starts_with('[') {
            if let Ok(list @ Value::Array(_)) = serde_json::from_str(&text) {
                self.put(field, list);
                return;
            }
        }
        self.put(field, text);
    }
}
