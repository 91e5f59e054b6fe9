//! Text from outside the agent, made safe for what a human reads.
//!
//! External ids come from the target's memory and process names from the
//! target itself: a `\n` in one would forge a whole alert line, a `class=`
//! a field, an ESC or OSC sequence would reach the operator's terminal.
//! Every human output (alert lines, the summary, the `inflight` table, the
//! logs) writes such text through [`value`] or [`escaped`]; JSON output
//! needs neither (its encoder escapes).
use std::{borrow::Cow, fmt::Write as _};

/// `text` as a `key=value` value or a table cell: as it is when it is
/// plain, otherwise in double quotes with `"` and `\` escaped and every
/// control character written as an escape (`\n`, `\u{1b}`), so it is one
/// token on one line whatever it holds. Empty text is `""`.
pub fn value(text: &str) -> Cow<'_, str> {
    if !text.is_empty() && !text.chars().any(|c| c.is_whitespace() || matches!(c, '=' | '"' | '\\') || is_unsafe(c)) {
        return text.into();
    }
    let mut quoted = String::with_capacity(text.len() + 2);
    quoted.push('"');
    for c in text.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            c if is_unsafe(c) => push_escape(&mut quoted, c),
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted.into()
}

/// `text` (free text: a log message, an error) with every control
/// character written as an escape: never a line break of its own, never a
/// terminal sequence.
pub fn escaped(text: &str) -> Cow<'_, str> {
    if !text.chars().any(is_unsafe) {
        return text.into();
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if is_unsafe(c) { push_escape(&mut out, c) } else { out.push(c) }
    }
    out.into()
}

/// Control characters (C0, DEL, C1: line breaks, ESC, BEL, CSI...), the
/// Unicode line and paragraph separators, and the bidirectional controls
/// that reorder what a terminal shows.
fn is_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{2028}' | '\u{2029}' | '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

fn push_escape(out: &mut String, c: char) {
    match c {
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        c => {
            let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_values_stay_as_they_are() {
        assert_eq!(value("room-42"), "room-42");
        assert_eq!(value("demo-prefill"), "demo-prefill");
        assert_eq!(value("ünïcode·名前"), "ünïcode·名前");
    }

    #[test]
    fn values_that_could_forge_a_field_or_a_line_are_quoted_and_escaped() {
        assert_eq!(value(""), "\"\"");
        assert_eq!(value("a b"), "\"a b\"");
        assert_eq!(value("x class=y"), "\"x class=y\"");
        assert_eq!(value("a\"b\\c"), "\"a\\\"b\\\\c\"");
        assert_eq!(value("1\n2026-01-01T00:00:00Z STALLED pid=1"), "\"1\\n2026-01-01T00:00:00Z STALLED pid=1\"");
        assert_eq!(value("\u{1b}]0;owned\u{7}\u{1b}[2J"), "\"\\u{1b}]0;owned\\u{7}\\u{1b}[2J\"");
        assert_eq!(value("\u{9b}31m\u{202e}"), "\"\\u{9b}31m\\u{202e}\"");
        assert_eq!(value("bad\u{fffd}"), "bad\u{fffd}", "invalid UTF-8, replaced when read, is printable");
    }

    #[test]
    fn free_text_keeps_its_spaces_and_loses_its_controls() {
        assert_eq!(escaped("no file `x` mapped"), "no file `x` mapped");
        assert_eq!(escaped("a\nb\r\tc\u{1b}[31m\u{7f}"), "a\\nb\\r\\tc\\u{1b}[31m\\u{7f}");
    }
}
