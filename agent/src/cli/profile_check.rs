//! `stallwatch profile check`: what each probe of a profile attaches to,
//! and with `--pid` where it lands in the running process.
use std::io::Write;

use stallwatch_common::MAX_SLOTS;

use crate::{
    profile::{self, Profile, plan::ProbePoint, roles::Deployment},
    util::{
        lineage::{Generation, Lineage},
        text,
    },
};

/// A process's lineage and its deployment's processes, for
/// [`role_report`].
pub struct Family {
    lineage: Lineage,
    descendants: Vec<Generation>,
}

impl Family {
    pub fn read(profile: &Profile, pid: u32) -> Self {
        let lineage = Lineage::read(pid);
        let descendants = Deployment::family(profile, &lineage);
        Self { lineage, descendants }
    }
}

/// `stallwatch profile check --pid`, with a profile that has `[[process]]`
/// tables: which process of its deployment this is, what fires there, and
/// which others a request's life also runs in.
pub fn role_report(profile: &Profile, family: &Family, out: &mut dyn Write) -> std::io::Result<()> {
    if profile.processes.is_empty() {
        return Ok(());
    }
    let Some(deployment) = Deployment::of(profile, &family.lineage, &family.descendants) else {
        return writeln!(out, "the process: gone (its command line could not be read)");
    };
    let this = &deployment.this;
    match this.role {
        Some(role) => {
            writeln!(
                out,
                "the process: pid {} `{}`: {}",
                this.pid,
                text::escaped(&this.title),
                text::escaped(&role.is)
            )?;
            writeln!(out, "  fires here: {}", role.firing())?;
        }
        None => writeln!(
            out,
            "the process: pid {} `{}`: none of the profile's [[process]] kinds: {}",
            this.pid,
            text::escaped(&this.title),
            profile.processes.iter().map(|role| text::escaped(&role.is).into_owned()).collect::<Vec<_>>().join("; ")
        )?,
    }
    if let Some(server) = &deployment.server {
        writeln!(out, "  of the deployment of pid {} `{}`", server.pid, text::escaped(&server.title))?;
    }
    let Some(role) = this.role else {
        return writeln!(
            out,
            "  the profile does not say what fires in such a process: `in the process` above says what can"
        );
    };
    let verdict = match (role.fires(), deployment.partial()) {
        (true, false) => {
            "watch it: the profile's probes fire here and in no other process of its deployment".to_owned()
        }
        (true, true) => format!(
            "watch it with the others, not alone (a request's life also runs in {}): select them all (`--lib`, \
             `--cmdline`) rather than --pid",
            text::escaped(&deployment.others_text())
        ),
        (false, true) => format!(
            "not worth watching: none of the profile's probes fire here; they fire in {}",
            text::escaped(&deployment.others_text())
        ),
        (false, false) => "not worth watching: none of the profile's probes fire here".to_owned(),
    };
    writeln!(out, "  {verdict}")
}

/// `stallwatch profile check --pid`: where each probe lands in the process.
pub fn points_report(points: &[ProbePoint], out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(out, "in the process:")?;
    for point in points {
        let symbol = text::escaped(&point.symbol);
        match &point.found {
            Ok((path, resolved)) => writeln!(
                out,
                "  line {:>3}: {} at {}+{:#x}{}: {}",
                point.line,
                symbol,
                text::escaped(&path.display().to_string()),
                resolved.file_offset,
                if resolved.skipped > 0 { " (after its endbr64)" } else { "" },
                resolved.first_insn
            )?,
            Err(why) => writeln!(out, "  line {:>3}: {symbol}: not attachable: {}", point.line, text::escaped(why))?,
        }
    }
    Ok(())
}

/// `stallwatch profile check`: what each probe of a valid profile attaches
/// to. Names, symbols and paths come from a file anyone may have written:
/// printed escaped, so none can break a line or reach the terminal as a
/// control sequence.
pub fn check_report(profile: &Profile, out: &mut dyn Write) -> std::io::Result<()> {
    use text::escaped;
    writeln!(out, "profile {}: ok", escaped(&profile.name))?;
    let slots = profile.slots_needed();
    let most = MAX_SLOTS as usize / slots.max(1);
    writeln!(
        out,
        "  takes {slots} of an agent's {MAX_SLOTS} probe slots per process: it watches {most} process{} at most",
        if most == 1 { "" } else { "es" }
    )?;
    if let Some(base) = &profile.extends {
        writeln!(out, "  extends {}", escaped(base))?;
    }
    // What a profile inherits names the file it comes from.
    let from =
        |origin: &str| if origin == profile.origin { String::new() } else { format!(" (from {})", escaped(origin)) };
    for probe in &profile.probes {
        let events = match &probe.action {
            profile::Action::Always(stage) => stage.to_string(),
            profile::Action::OnReturn(rules) => {
                rules.iter().map(|(_, stage)| stage.to_string()).collect::<Vec<_>>().join(" | ")
            }
        };
        writeln!(
            out,
            "  line {:>3}: {events:<30} {:?} of `{}` in {}{}",
            probe.line,
            probe.at,
            escaped(&probe.symbol),
            escaped(probe.object.as_deref().unwrap_or("the executable")),
            from(&probe.origin)
        )?;
    }
    if let Some(status) = &profile.status {
        let stages = status.rules.iter().map(|(_, stage)| stage.to_string()).collect::<Vec<_>>().join(" | ");
        writeln!(
            out,
            "  line {:>3}: {stages:<30} read from the target's memory, key {}{:+}, when a stall is due{}",
            status.line,
            status.at.deref.iter().map(|offset| format!("->[{offset:+}]")).collect::<String>(),
            status.at.add,
            from(&status.origin)
        )?;
    }
    for signal in &profile.signals {
        writeln!(
            out,
            "  line {:>3}: {:<30} {:?} of `{}` in {}{}{}",
            signal.line,
            format!("signal {}", escaped(&signal.name)),
            signal.at,
            escaped(&signal.symbol),
            escaped(signal.object.as_deref().unwrap_or("the executable")),
            signal
                .msgpack
                .as_ref()
                .map(|m| format!(", msgpack element {} of `{}`", m.element, escaped(&m.tag)))
                .or_else(|| signal.strings.as_ref().map(|s| format!(
                    ", strings: at most {} records a hit ({} bytes a string)",
                    s.records(),
                    s.bytes
                )))
                .or_else(|| signal.pickle.as_ref().map(|p| format!(
                    ", pickle {} `{}` of `{}`",
                    if p.items { "items of" } else { "keys" },
                    escaped(&p.keys.join("`, `")),
                    escaped(&p.tags.join("` or `"))
                )))
                .unwrap_or_default(),
            from(&signal.origin)
        )?;
    }
    for activity in &profile.activity {
        writeln!(
            out,
            "  line {:>3}: {:<30} Entry of `{}` in {}{}{}",
            activity.line,
            format!("transport {}", activity.kind.as_str()),
            escaped(&activity.symbol),
            escaped(activity.object.as_deref().unwrap_or("the executable")),
            if activity.optional { " (optional)" } else { "" },
            from(&activity.origin)
        )?;
    }
    Ok(())
}
