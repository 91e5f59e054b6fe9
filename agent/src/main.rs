fn main() -> anyhow::Result<()> {
    let mut ebpf = aya::Ebpf::load(stallwatch::probes::ebpf_object())?;
    for (name, _) in ebpf.programs_mut() { println!("{name}"); }
    Ok(())
}
