//! The agent's own logs (stderr): the filter and the format, from
//! `--log` / `STALLWATCH_LOG` and `--log-format` / `STALLWATCH_LOG_FORMAT`.
//!
//! A filter that does not parse is an error at start-up, never a silent
//! fallback: `tracing`'s syntax takes a bare word as a *target* name, so
//! `STALLWATCH_LOG=json` used to mean "only target `json`" and muted every
//! line. Here a bare word must be a level.
use tracing::level_filters::LevelFilter;
use tracing_subscriber::{EnvFilter, field::MakeExt as _, fmt::format::debug_fn};

use crate::util::text;

/// The filter when none is given.
pub const DEFAULT_FILTER: &str = "info";

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// `LEVEL target: message key=value`, escaped (colour on a terminal).
    #[default]
    Text,
    /// One JSON object a line (`timestamp`, `level`, `target`, `message`
    /// and the fields at the top level), for log collectors.
    Json,
}

/// `--log` / `STALLWATCH_LOG`: checked, and returned with the blanks
/// around its directives dropped (`info, aya=warn` is meant as written).
pub fn parse_filter(text: &str) -> Result<String, String> {
    let directives: Vec<&str> = text.split(',').map(str::trim).filter(|d| !d.is_empty()).collect();
    for &directive in &directives {
        // `target[span{field=value}]=level` is tracing's; a bare word
        // (no `=`, no `[`) must be a level, or it silently filters to a
        // target of that name.
        if !directive.contains(['=', '[']) && directive.parse::<LevelFilter>().is_err() {
            let hint = if directive.eq_ignore_ascii_case("json") || directive.eq_ignore_ascii_case("text") {
                format!(
                    "; for {directive} output set STALLWATCH_LOG_FORMAT={} (or --log-format)",
                    directive.to_ascii_lowercase()
                )
            } else {
                String::new()
            };
            return Err(format!(
                "`{directive}` is not a log level (error, warn, info, debug, trace, off) nor TARGET=LEVEL: \
                 write e.g. `info` or `info,stallwatch=debug`{hint}"
            ));
        }
    }
    let text = directives.join(",");
    EnvFilter::builder()
        .with_regex(false)
        .parse(&text)
        .map(|_| text.clone())
        .map_err(|err| format!("{text:?} is not a log filter ({err}): write e.g. `info` or `info,stallwatch=debug`"))
}

/// Dependencies whose log lines repeat what the agent says itself, once
/// and then with a count: rustls-platform-verifier logs an ERROR for every
/// handshake with a collector whose certificate is not trusted (several a
/// second while spans wait), which the OTLP exporter's own warning names
/// with its cause and fix. Off unless the filter names them.
const REPEATERS: [&str; 1] = ["rustls_platform_verifier"];

/// `filter` with [`REPEATERS`] it does not name turned off.
fn quieted(filter: &str) -> String {
    REPEATERS.iter().filter(|target| !filter.contains(*target)).fold(filter.to_owned(), |filter, target| {
        match filter.as_str() {
            "" => format!("{target}=off"),
            _ => format!("{filter},{target}=off"),
        }
    })
}

/// Install the global subscriber. `filter` was checked by [`parse_filter`].
pub fn init(filter: &str, format: LogFormat) {
    // Checked at parse time; the default is a level.
    let filter = EnvFilter::builder().with_regex(false).parse_lossy(quieted(filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // A stderr gone (its reader exited, a closed fd) loses the logs,
        // not the agent: tracing's own report of a failed write is an
        // `eprintln!`, which panics on that same stderr.
        .log_internal_errors(false);
    match format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            // Logs carry what targets wrote (names, paths, symbols): no
            // field or message may break a line or reach the terminal as
            // a sequence.
            .fmt_fields(
                debug_fn(|writer, field, value| match field.name() {
                    "message" => write!(writer, "{}", text::escaped(&format!("{value:?}"))),
                    name if name.starts_with("log.") => Ok(()),
                    name => write!(writer, "{name}={}", text::escaped(&format!("{value:?}"))),
                })
                .delimited(" "),
            )
            .init(),
        // JSON strings escape every control character themselves.
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(false).with_span_list(false).init(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_are_checked_not_guessed() {
        for good in ["info", "warn,stallwatch=debug", "stallwatch::run=trace", "off", ""] {
            assert_eq!(parse_filter(good).as_deref(), Ok(good), "{good}");
        }
        assert_eq!(parse_filter(" debug , aya=warn ").as_deref(), Ok("debug,aya=warn"));
        let err = parse_filter("json").expect_err("a format is not a filter");
        assert!(err.contains("`json` is not a log level") && err.contains("STALLWATCH_LOG_FORMAT=json"), "{err}");
        let err = parse_filter("info,verbose").expect_err("a bare word");
        assert!(err.contains("`verbose` is not a log level"), "{err}");
        let err = parse_filter("stallwatch=loud").expect_err("a bad level");
        assert!(err.contains("is not a log filter"), "{err}");
    }

    #[test]
    fn repeating_dependencies_are_off_unless_named() {
        assert_eq!(quieted("info"), "info,rustls_platform_verifier=off");
        assert_eq!(quieted(""), "rustls_platform_verifier=off");
        assert_eq!(quieted("info,rustls_platform_verifier=debug"), "info,rustls_platform_verifier=debug");
        assert!(parse_filter(&quieted("warn,stallwatch=debug")).is_ok());
    }
}
