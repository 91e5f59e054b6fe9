//! The values the settings take, each checked once for the flag and the
//! file alike: durations, pids, counts, named choices, addresses.
use std::{fmt, net::SocketAddr, time::Duration};

use clap::ValueEnum;
use serde::{Deserialize, Deserializer, de};

use crate::export::metrics;

/// A duration written as a string, as the flags take it (`"60s"`, `"1m 30s"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Dur(pub(super) Duration);

impl fmt::Display for Dur {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl de::Visitor<'_> for Visitor {
            type Value = Dur;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration string such as \"60s\", \"500ms\" or \"2m\"")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Dur, E> {
                humantime::parse_duration(text.trim()).map(Dur).map_err(|err| {
                    E::custom(format!("{text:?} is not a duration ({err}): write it like \"60s\", \"500ms\" or \"2m\""))
                })
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Dur, E> {
                Err(E::custom(format!(
                    "a bare number ({n}) has no unit: write the duration as a string, e.g. \"{n}s\""
                )))
            }
            fn visit_f64<E: de::Error>(self, n: f64) -> Result<Dur, E> {
                Err(E::custom(format!(
                    "a bare number ({n}) has no unit: write the duration as a string, e.g. \"{n}s\""
                )))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// The longest `timeout` or `tick` taken: far beyond any use, and far
/// from where the timers' arithmetic would overflow.
const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// `--timeout` and `--tick`: a duration the timers can run on. Zero would
/// stop them (a zero period is a panic in the timer, after attaching).
pub(super) fn parse_duration(text: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(text.trim())
        .map_err(|err| format!("{text:?} is not a duration ({err}): write it like 60s, 500ms or 2m"))?;
    check_duration(duration)?;
    Ok(duration)
}

/// A duration is more than zero and at most [`MAX_DURATION`].
pub(super) fn check_duration(duration: Duration) -> Result<(), String> {
    if duration.is_zero() {
        return Err(
            "a zero duration would stop the timers: give a positive one (e.g. 10ms for the tick, 60s for the timeout)"
                .to_owned(),
        );
    }
    if duration > MAX_DURATION {
        return Err(format!(
            "{} is longer than the longest taken, {}",
            humantime::format_duration(duration),
            humantime::format_duration(MAX_DURATION)
        ));
    }
    Ok(())
}

/// `--pid`: a process id, as the kernel gives them (1 and up).
pub(super) fn parse_pid(text: &str) -> Result<u32, String> {
    let n = text
        .trim()
        .parse::<i64>()
        .map_err(|_| format!("{text:?} is not a process id: give the number `ps` or `pgrep` shows"))?;
    check_pid(n)
}

fn check_pid(n: i64) -> Result<u32, String> {
    match u32::try_from(n) {
        Ok(pid) if pid > 0 && pid <= i32::MAX as u32 => Ok(pid),
        Ok(0) => Err("pid 0 is not a process id (it is the kernel's idle task, not a process one can watch): \
                      give the prefill server's pid, as `ps` or `pgrep` shows it"
            .to_owned()),
        _ => Err(format!("pid {n} is not a process id (a positive integer, as `ps` or `pgrep` shows it)")),
    }
}

/// A pid: a positive integer.
pub(super) struct Pid(pub(super) u32);

impl<'de> Deserialize<'de> for Pid {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let n = i64::deserialize(deserializer)?;
        check_pid(n).map(Pid).map_err(de::Error::custom)
    }
}

/// A positive count on the command line, as the config file takes it
/// ([`Count`]): 0 would track nothing and is refused by both. A count
/// past what a number holds (`--max-tracked 99999999999999999999`, "no
/// limit") saturates, as `18446744073709551615` does: the engine caps
/// either at the most it can track (2^32 - 2).
pub(super) fn parse_count(text: &str) -> Result<usize, String> {
    match text.trim().parse::<u64>() {
        Ok(0) => Err(format!("{text} is not a positive count (1 or more): 0 would track nothing")),
        Ok(count) => Ok(usize::try_from(count).unwrap_or(usize::MAX)),
        Err(err) if *err.kind() == std::num::IntErrorKind::PosOverflow => Ok(usize::MAX),
        Err(_) => Err(format!("{text} is not a positive count (1 or more)")),
    }
}

/// A positive count.
pub(super) struct Count(pub(super) usize);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let n = i64::deserialize(deserializer)?;
        match usize::try_from(n) {
            Ok(count) if count > 0 => Ok(Count(count)),
            _ => Err(de::Error::custom(format!("{n} is not a positive count"))),
        }
    }
}

/// One of a flag's named values (`output = "json"`), spelled as on the
/// command line.
pub(super) struct Choice<T>(pub(super) T);

impl<'de, T: ValueEnum> Deserialize<'de> for Choice<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        T::from_str(text.trim(), true).map(Choice).map_err(|_| {
            let names: Vec<String> = T::value_variants()
                .iter()
                .filter_map(ValueEnum::to_possible_value)
                .map(|value| format!("{:?}", value.get_name()))
                .collect();
            de::Error::custom(format!("{text:?} is not one of {}", names.join(", ")))
        })
    }
}

pub(super) fn choice_name<T: ValueEnum>(value: T) -> String {
    value.to_possible_value().map_or_else(|| "?".to_owned(), |v| v.get_name().to_owned())
}

/// `PORT` or `ADDRESS:PORT`, as `--metrics-addr` takes it.
pub(super) struct Addr(pub(super) SocketAddr);

impl<'de> Deserialize<'de> for Addr {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl de::Visitor<'_> for Visitor {
            type Value = Addr;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a port number or an \"ADDRESS:PORT\" string")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Addr, E> {
                metrics::parse_addr(text).map(Addr).map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Addr, E> {
                self.visit_str(&n.to_string())
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}
