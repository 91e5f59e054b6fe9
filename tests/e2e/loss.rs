//! Nothing lost, nothing invented when the ring buffer overflows: the agent
//! is paused (SIGSTOP, as a throttled cgroup or a blocked stdout would
//! pause it) while the demo runs at a high rate, so the kernel drops
//! records (counted), while its in-flight table keeps every request. The
//! real eBPF object in this kernel, a real target, a real pause.
use std::time::Duration;

use stallwatch_tests::{Agent, Demo, alerts, require_root, summary};

/// A pause long enough to fill the ring buffer (about 35 000 records; the
/// demo sends two a request at this rate) well before the demo pins its
/// requests, so every event of those is lost: only the kernel's table
/// knows of them. Healthy requests whose release record was lost at the
/// edge of the overflow end in the kernel and must not read as stalled.
#[test]
fn a_paused_agent_reports_exactly_the_stalls_the_kernel_holds_after_losing_events() {
    require_root();
    let mut demo =
        Demo::builder().rate(8000).duration("40s").inject_after("4s").waiting_for_peer(1).transfer_hung(1).start();
    let pid = demo.proc.pid();
    let agent = Agent::on_pid(pid).timeout("2s").metrics().watch();
    demo.go();
    // Paused once it follows the demo's requests to their end.
    agent.wait_completed(1);
    agent.proc.signal(libc::SIGSTOP);
    // The demo pins its two requests seconds into the pause, the ring long
    // full: every event of theirs is lost once their `injected` lines are
    // out.
    let mut demo_lines = Vec::new();
    let pinned = demo.wait_injected(2, &mut demo_lines);
    agent.proc.signal(libc::SIGCONT);
    let mut seen = Vec::new();
    // Their stalls come due a timeout after they were pinned. A stall
    // invented from a lost release would be of a request whose last event
    // the agent read before the ring filled, seconds before they were
    // pinned: it would come due, and be reported, before theirs (the demo
    // profile reads no status, so stalls are reported as they come due).
    let stalls = agent.wait_alerts("stalled", 2, Duration::from_secs(10), &mut seen);
    let lines = agent.stop();
    seen.extend(lines.iter().cloned());
    let stalled: Vec<String> =
        alerts(&seen, "stalled").map(|(_, alert)| alert["key"].as_str().expect("key").to_owned()).collect();
    let mut expected: Vec<&String> = pinned.keys().collect();
    expected.sort();
    let mut got: Vec<&String> = stalled.iter().collect();
    got.sort();
    assert_eq!(got, expected, "exactly the pinned requests stall, once each: {stalls:?}\n{seen:?}");
    for (_, alert) in alerts(&seen, "stalled") {
        let injected = &pinned[alert["key"].as_str().expect("key")];
        assert_eq!(alert["class"], injected.stall.as_str(), "{alert}");
    }
    assert_eq!(alerts(&seen, "process_exited").count(), 0, "{seen:?}");
    let summary = summary(&lines);
    assert!(summary["ringbuf_full"].as_u64().expect("ringbuf_full") > 0, "the pause lost records: {summary}");
    assert!(summary["resyncs"].as_u64().expect("resyncs") >= 1, "{summary}");
    assert!(
        summary["restored"].as_u64().expect("restored") >= 2,
        "the pinned were taken over from the table: {summary}"
    );
    assert_eq!(summary["stalled"], 2, "{summary}");
}

/// A request whose quiet post the agent read from the kernel's table when
/// its stall came due, then recovered: the record of its recovery carries
/// the post's time again. That repeat is expected (counted as a caught-up
/// repeat), never a duplicate event, so `duplicate_events` stays 0 on a
/// run where nothing was delivered twice.
#[test]
fn a_caught_up_request_that_recovers_counts_no_duplicate_event() {
    require_root();
    let mut demo = Demo::builder().rate(2000).duration("30s").inject_after("500ms").recover(1, "3s").start();
    let agent = Agent::watch(demo.proc.pid(), "demo", "2s", &[]);
    demo.go();
    let mut seen = Vec::new();
    agent.wait_alerts("recovered", 1, Duration::from_secs(15), &mut seen);
    let lines = agent.stop();
    let summary = summary(&lines);
    assert_eq!(summary["duplicate_events"], 0, "{summary}");
    assert!(summary["caught_up_repeats"].as_u64().expect("caught_up_repeats") >= 1, "{summary}");
    assert_eq!((&summary["stalled"], &summary["recovered"]), (&1.into(), &1.into()), "{summary}");
}
