//! `--pid` of one process of a deployment whose requests run in several
//! (a vLLM server's engine core and workers, an SGLang server's main
//! process and its schedulers): said once at start, naming the others,
//! since a request seen in part is judged wrong (a prefill's requests look
//! never read when its worker is not watched) and a process where nothing
//! fires sees none (an SGLang server's main process).
use tokio::task::spawn_blocking;
use tracing::warn;

use crate::{
    profile::{Profile, plan::READ_DEADLINE, roles::Deployment},
    util::{lineage::Lineage, text},
};

/// Warn when the process `lineage` starts with is one of several of its
/// deployment where the profile's probes fire. The process table is read
/// off the loop, within [`READ_DEADLINE`]; what cannot be read in time is
/// not said.
pub async fn warn_if_partial(profile: &Profile, lineage: &Lineage) {
    if profile.processes.is_empty() {
        return;
    }
    let (profile, lineage) = (profile.clone(), lineage.clone());
    let selector = Deployment::selector(&profile);
    let said = spawn_blocking(move || {
        let family = Deployment::family(&profile, &lineage);
        let deployment = Deployment::of(&profile, &lineage, &family)?;
        if !deployment.partial() {
            return None;
        }
        let this = match deployment.this.role {
            Some(role) => format!("{}: {}, where {} fire", deployment.this.title, role.is, role.firing()),
            None => deployment.this.title.clone(),
        };
        Some((deployment.this.pid, this, deployment.others_text()))
    });
    if let Ok(Ok(Some((pid, this, others)))) = tokio::time::timeout(READ_DEADLINE, said).await {
        warn!(
            pid,
            process = %text::value(&this),
            others = %text::value(&others),
            selector = %text::value(&selector),
            "--pid watches one process of a deployment whose requests also run in others: each request is seen in \
             part, or not at all where this process fires nothing, and may be judged wrong (a prefill's requests look \
             never read); watch them all with a selector instead of --pid (`selector`: the processes where the \
             profile's probes fire, by their titles; add --lib or --cgroup to keep to one server's; `stallwatch \
             profile check PROFILE --pid PID` says what each process is)"
        );
    }
}
