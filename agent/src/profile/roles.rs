//! Which process of a framework's deployment a process is, and which
//! others a request's life also runs in, as the profile's `[[process]]`
//! tables say ([`ProcessRole`]). A vLLM server is an API server, an
//! engine core and a worker per rank, an SGLang server a main process and
//! a scheduler per rank, each retitled: the one an operator finds first
//! (the server's main process, the one its command line names) is rarely
//! the one, or the only one, where the probes fire.
use super::{ProcessRole, Profile};
use crate::util::lineage::{Generation, Lineage, descendants};

/// A process seen through the profile's `[[process]]` tables.
#[derive(Debug)]
pub struct Placed<'a> {
    pub pid: u32,
    /// Its command line, joined.
    pub title: String,
    pub role: Option<&'a ProcessRole>,
}

/// The deployment a process belongs to: the topmost process of its
/// lineage the profile knows (the server), and what descends from it.
#[derive(Debug)]
pub struct Deployment<'a> {
    pub this: Placed<'a>,
    /// The server process, when the process is not it.
    pub server: Option<Placed<'a>>,
    /// The server's other processes where some of the profile's probes
    /// fire, `this` excluded.
    pub others: Vec<Placed<'a>>,
}

impl<'a> Deployment<'a> {
    /// `lineage` (the process first) and `family` (the server process and
    /// its descendants, see [`Self::server_pid`]) as `profile` tells
    /// them.
    pub fn of(profile: &'a Profile, lineage: &Lineage, family: &[Generation]) -> Option<Self> {
        let place = |generation: &Generation| Placed {
            pid: generation.pid,
            title: generation.args.join(" "),
            role: profile.role_of(&generation.args),
        };
        let this = place(lineage.iter().next()?);
        let server = lineage.iter().skip(1).rfind(|g| profile.role_of(&g.args).is_some()).map(place);
        let others = family
            .iter()
            .filter(|g| g.pid != this.pid)
            .map(place)
            .filter(|placed| placed.role.is_some_and(ProcessRole::fires))
            .collect();
        Some(Self { this, server, others })
    }

    /// Whose descendants make the deployment of the process `lineage`
    /// starts with: its topmost ancestor the profile knows, else itself.
    pub fn server_pid(profile: &Profile, lineage: &Lineage) -> Option<u32> {
        let mut known = lineage.iter().filter(|g| profile.role_of(&g.args).is_some());
        known.next_back().or_else(|| lineage.iter().next()).map(|g| g.pid)
    }

    /// The server process of the process `lineage` starts with and every
    /// process descending from it, read from `/proc` now (blocking: off
    /// the event loop).
    pub fn family(profile: &Profile, lineage: &Lineage) -> Vec<Generation> {
        Self::server_pid(profile, lineage).map(descendants).unwrap_or_default()
    }

    /// Whether watching this process alone misses part of its requests'
    /// lives: the profile knows the process and other processes of its
    /// deployment fire. A process the profile does not know is not said
    /// to be part of the deployment it descends from: a server may start
    /// processes of another (a test's router its decodes, a launcher
    /// script anything), and a warning must not tell the operator of one
    /// to watch another's.
    pub fn partial(&self) -> bool {
        self.this.role.is_some() && !self.others.is_empty()
    }

    /// The selector that watches every process of `profile`'s
    /// deployments where its probes fire: `--cmdline` on their titles
    /// ("--cmdline '^sglang::scheduler'"), what a `--pid` that sees part
    /// of a request is told to use instead.
    pub fn selector(profile: &Profile) -> String {
        let titles: Vec<&str> =
            profile.processes.iter().filter(|role| role.fires()).map(|role| role.title.as_str()).collect();
        format!("--cmdline '{}'", titles.join("|"))
    }

    /// The others, for a person: "pid 12 (VLLM::Worker_TP0: a vLLM
    /// worker: the transfers, vllm_notifs)".
    pub fn others_text(&self) -> String {
        let text: Vec<String> = self
            .others
            .iter()
            .map(|placed| match placed.role {
                Some(role) => format!("pid {} ({}: {}: {})", placed.pid, placed.title, role.is, role.firing()),
                None => format!("pid {} ({})", placed.pid, placed.title),
            })
            .collect();
        text.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn generation(pid: u32, args: &[&str]) -> Generation {
        Generation { pid, args: args.iter().map(|a| (*a).to_owned()).collect() }
    }

    fn vllm() -> Profile {
        Profile::load("vllm").expect("built-in vllm")
    }

    #[test]
    fn an_engine_core_is_placed_in_its_server_beside_its_worker() {
        let profile = vllm();
        let server = generation(10, &["/venv/bin/python3", "/venv/bin/vllm", "serve", "/m"]);
        let engine = generation(20, &["VLLM::EngineCore"]);
        let worker = generation(30, &["VLLM::Worker_TP0"]);
        let lineage = Lineage(vec![engine.clone(), server.clone(), generation(1, &["/sbin/init"])]);
        assert_eq!(Deployment::server_pid(&profile, &lineage), Some(10));
        let deployment = Deployment::of(&profile, &lineage, &[engine, worker]).expect("placed");
        assert!(deployment.this.role.is_some_and(|role| role.signals.contains(&"vllm_outputs".to_owned())));
        assert_eq!(deployment.server.as_ref().map(|s| s.pid), Some(10));
        assert_eq!(deployment.others.iter().map(|p| p.pid).collect::<Vec<_>>(), [30]);
        assert!(deployment.partial());
        assert!(deployment.others_text().starts_with("pid 30 (VLLM::Worker_TP0: "), "{}", deployment.others_text());
        assert_eq!(Deployment::selector(&profile), r"--cmdline '^\S+::EngineCore|^\S+::Worker'");
    }

    #[test]
    fn the_api_server_fires_nothing_and_names_the_processes_that_do() {
        let profile = vllm();
        let server = generation(10, &["/venv/bin/python3", "/venv/bin/vllm", "serve", "/m"]);
        let lineage = Lineage(vec![server]);
        let family = [generation(20, &["VLLM::EngineCore"]), generation(30, &["VLLM::Worker_TP0"])];
        let deployment = Deployment::of(&profile, &lineage, &family).expect("placed");
        assert!(deployment.this.role.is_some_and(|role| !role.fires()));
        assert_eq!(deployment.others.len(), 2);
        assert!(deployment.partial());
        // A process the profile does not know, alone: nothing to say.
        let lone = Lineage(vec![generation(40, &["python3", "bench.py"])]);
        let deployment = Deployment::of(&profile, &lone, &[]).expect("placed");
        assert!(deployment.this.role.is_none() && !deployment.partial());
    }

    fn sglang() -> Profile {
        Profile::load("sglang").expect("built-in sglang")
    }

    /// A TP2 SGLang prefill as `ps` shows it: the main process, two
    /// schedulers and a detokenizer retitled by setproctitle.
    fn sglang_prefill() -> (Generation, [Generation; 3]) {
        let main = generation(
            10,
            &[
                "/venv/bin/python3",
                "-m",
                "sglang.launch_server",
                "--model-path",
                "/m",
                "--disaggregation-mode",
                "prefill",
            ],
        );
        let family = [
            generation(20, &["sglang::scheduler_TP0"]),
            generation(21, &["sglang::scheduler_TP1"]),
            generation(22, &["sglang::detokenizer"]),
        ];
        (main, family)
    }

    #[test]
    fn sglangs_main_process_fires_nothing_and_names_every_scheduler() {
        let profile = sglang();
        let (main, family) = sglang_prefill();
        let lineage = Lineage(vec![main.clone()]);
        let everyone: Vec<Generation> = [main].into_iter().chain(family).collect();
        let deployment = Deployment::of(&profile, &lineage, &everyone).expect("placed");
        let role = deployment.this.role.expect("the main process is known");
        assert!(!role.fires() && role.is.contains("main process"), "{role:?}");
        // The schedulers, not the detokenizer: nothing fires there.
        assert_eq!(deployment.others.iter().map(|p| p.pid).collect::<Vec<_>>(), [20, 21]);
        assert!(deployment.partial());
        let text = deployment.others_text();
        assert!(text.starts_with("pid 20 (sglang::scheduler_TP0: an SGLang scheduler"), "{text}");
        assert!(text.contains("pid 21 (sglang::scheduler_TP1: "), "{text}");
        assert_eq!(Deployment::selector(&profile), "--cmdline '^sglang::scheduler'");
        // `sglang serve` is the same process.
        let serve = generation(11, &["/venv/bin/python3", "/venv/bin/sglang", "serve", "--model-path", "/m"]);
        assert!(profile.role_of(&serve.args).is_some_and(|role| !role.fires()));
    }

    #[test]
    fn an_sglang_scheduler_fires_everything_and_names_its_other_ranks() {
        let profile = sglang();
        let (main, family) = sglang_prefill();
        let scheduler = family[0].clone();
        let lineage = Lineage(vec![scheduler, main.clone(), generation(1, &["/sbin/init"])]);
        assert_eq!(Deployment::server_pid(&profile, &lineage), Some(10));
        let everyone: Vec<Generation> = [main].into_iter().chain(family).collect();
        let deployment = Deployment::of(&profile, &lineage, &everyone).expect("placed");
        let role = deployment.this.role.expect("a scheduler is known");
        assert!(role.transfers && role.signals.contains(&"sglang_request_room".to_owned()), "{role:?}");
        assert_eq!(deployment.others.iter().map(|p| p.pid).collect::<Vec<_>>(), [21]);
        // TP1: the one scheduler alone sees every room whole.
        let tp1 = [generation(20, &["sglang::scheduler"]), generation(22, &["sglang::detokenizer"])];
        let lineage = Lineage(vec![tp1[0].clone(), generation(10, &["python3", "-m", "sglang.launch_server"])]);
        let deployment = Deployment::of(&profile, &lineage, &tp1).expect("placed");
        assert!(deployment.this.role.is_some_and(ProcessRole::fires) && !deployment.partial());
    }

    /// A process the profile does not know, started by an SGLang main
    /// process (a test router's decode, a helper script): not said to be
    /// part of that server, even though its schedulers fire.
    #[test]
    fn an_unknown_child_of_an_sglang_server_is_not_told_to_watch_its_schedulers() {
        let profile = sglang();
        let (main, family) = sglang_prefill();
        let decode = generation(30, &["/venv/bin/python", "decode.py", "--tp-rank", "0"]);
        let lineage = Lineage(vec![decode.clone(), main.clone()]);
        let everyone: Vec<Generation> = [main, decode].into_iter().chain(family).collect();
        let deployment = Deployment::of(&profile, &lineage, &everyone).expect("placed");
        assert!(deployment.this.role.is_none() && !deployment.partial(), "{deployment:?}");
    }

    #[test]
    fn sglang_mooncakes_schedulers_fire_and_its_main_process_does_not() {
        let profile = Profile::load("sglang-mooncake").expect("built-in sglang-mooncake");
        let scheduler = profile.role_of(&["sglang::scheduler_DP0_TP3".to_owned()]).expect("a scheduler");
        assert!(scheduler.transfers && scheduler.signals.contains(&"mooncake_submit".to_owned()), "{scheduler:?}");
        let main = ["python", "-m", "sglang.launch_server", "--disaggregation-mode", "decode"].map(str::to_owned);
        assert!(profile.role_of(&main).is_some_and(|role| !role.fires()));
    }
}
