//! Loads the eBPF programs, arms each hook (naming the ones the kernel
//! refuses), and turns ring-buffer records into `ShutdownSignal`s.
use anyhow::{bail, Context, Result};
use aya::{
    maps::{HashMap, MapData, PerCpuArray, RingBuf},
    programs::TracePoint,
    Btf, Ebpf, EbpfLoader, Endianness,
};
use lastgasp_common::{self as common, RawEvent, RecordSource};
use tokio::io::unix::AsyncFd;

use crate::{
    clock::now_pair,
    detect::hooks::{self, Attach, HookReport, HookState, HOOKS},
    node::NodePidNs,
    signal::ShutdownSignal,
};

mod btf;
pub(crate) mod preflight;

static EBPF_OBJ: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lastgasp.bpf.o"));

pub struct EbpfDetector {
    // Owns the programs and links: dropping it detaches everything.
    _bpf: Ebpf,
    /// The node's records from callers that can shut it down, the node's
    /// others and containers' (both rate-limited in the kernel).
    capable_events: AsyncFd<RingBuf<MapData>>,
    node_events: AsyncFd<RingBuf<MapData>>,
    container_events: AsyncFd<RingBuf<MapData>>,
    drops: PerCpuArray<MapData, u64>,
    errors: PerCpuArray<MapData, u64>,
    /// Capable callers' tool execs, by tgid (`agent-ebpf/src/tool_end.rs`).
    watch: HashMap<MapData, u32, u32>,
    pub report: Vec<HookReport>,
}

/// Records lost before userspace saw them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Drops {
    /// The capable callers' ring buffer was full.
    pub capable_full: u64,
    /// The node's (other callers') ring buffer was full.
    pub node_full: u64,
    /// The node's other callers over their rate in the kernel.
    pub node_rate_limited: u64,
    /// The containers' ring buffer was full.
    pub container_full: u64,
    /// Over the containers' rate in the kernel.
    pub container_rate_limited: u64,
    /// Records a hook failed to write (a helper or a read failed), by
    /// hook, in `RecordSource::ALL`'s order.
    pub hook_errors: [u64; RecordSource::ALL.len()],
}

impl Drops {
    /// (scope, reason, total), as the metric labels them.
    pub fn by_label(&self) -> [(&'static str, &'static str, u64); 5] {
        [
            ("capable", "full", self.capable_full),
            ("node", "full", self.node_full),
            ("node", "rate-limited", self.node_rate_limited),
            ("container", "full", self.container_full),
            ("container", "rate-limited", self.container_rate_limited),
        ]
    }

    /// (hook, total), as the metric labels them.
    pub fn hook_errors_by_label(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        RecordSource::ALL
            .iter()
            .zip(self.hook_errors)
            .map(|(s, n)| (s.name(), n))
    }

    /// Ring-buffer drops (not hook errors).
    pub fn total(&self) -> u64 {
        self.capable_full
            + self.node_full
            + self.node_rate_limited
            + self.container_full
            + self.container_rate_limited
    }
}

/// At most this many records per `next_batch`, capable callers' first: the loop
/// stays fair to the buses and the heartbeat during a flood.
const BATCH: usize = 256;

/// Kernel struct offsets the programs need, from the running kernel's BTF:
/// argv, the binary and AT_SECURE at exec, and the acting task's parent
/// and credentials.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TaskOffsets {
    pub task_mm: u64,
    pub mm_arg_start: u64,
    pub mm_arg_end: u64,
    pub task_real_parent: u64,
    pub task_tgid: u64,
    pub task_comm: u64,
    pub task_cred: u64,
    pub cred_euid: u64,
    pub cred_cap_effective: u64,
    pub cred_user_ns: u64,
    pub user_ns_level: u64,
    /// mm_struct.exe_file, file.f_path.dentry, dentry.d_name.name and
    /// mm_struct.saved_auxv: the binary an exec really ran, and AT_SECURE.
    pub mm_exe_file: u64,
    pub file_dentry: u64,
    pub dentry_name: u64,
    pub mm_saved_auxv: u64,
}

impl TaskOffsets {
    pub fn from_btf(path: &str) -> Result<Self> {
        let data = std::fs::read(path).with_context(|| format!("reading {path}"))?;
        Self::from_btf_bytes(&data)
    }

    /// From BTF already read: an index over the same bytes aya parses, not
    /// a second type table.
    pub fn from_btf_bytes(data: &[u8]) -> Result<Self> {
        let btf = btf::Btf::parse(data)?;
        Ok(TaskOffsets {
            task_mm: btf.member_offset("task_struct", "mm")?,
            mm_arg_start: btf.member_offset("mm_struct", "arg_start")?,
            mm_arg_end: btf.member_offset("mm_struct", "arg_end")?,
            task_real_parent: btf.member_offset("task_struct", "real_parent")?,
            task_tgid: btf.member_offset("task_struct", "tgid")?,
            task_comm: btf.member_offset("task_struct", "comm")?,
            task_cred: btf.member_offset("task_struct", "cred")?,
            cred_euid: btf.member_offset("cred", "euid")?,
            cred_cap_effective: btf.member_offset("cred", "cap_effective")?,
            cred_user_ns: btf.member_offset("cred", "user_ns")?,
            user_ns_level: btf.member_offset("user_namespace", "level")?,
            mm_exe_file: btf.member_offset("mm_struct", "exe_file")?,
            file_dentry: btf.member_offset("file", "f_path")?
                + btf.member_offset("path", "dentry")?,
            dentry_name: btf.member_offset("dentry", "d_name")?
                + btf.member_offset("qstr", "name")?,
            mm_saved_auxv: btf.member_offset("mm_struct", "saved_auxv")?,
        })
    }
}

/// The kernel's BTF, read once and parsed once by aya: the loader, the
/// fentry hooks and the offset reader all use it.
const KERNEL_BTF: &str = "/sys/kernel/btf/vmlinux";

impl EbpfDetector {
    /// Loads and attaches every hook. Fails only when nothing could be armed.
    pub fn load(node: NodePidNs) -> Result<Self> {
        crate::node::require_bpf_caps()?;
        crate::node::ensure_tracefs()?;
        let mut report = Vec::new();
        // aya 0.14's `EbpfLoader::new()` parses the kernel's BTF itself, with
        // no way to take it out: drop that one at once. The programs carry no
        // CO-RE relocations (the offsets are the hand-done CO-RE), so the
        // loader needs none. The file is read once, indexed for the offsets,
        // and parsed once, after loading, for the fentry hooks: one parsed
        // BTF alive at a time.
        let data = std::fs::read(KERNEL_BTF).with_context(|| format!("reading {KERNEL_BTF}"));
        let offsets = task_offsets(data.as_deref(), &mut report);
        let mut bpf = load_object(&node, &offsets)?;
        let kernel_btf = match data {
            Ok(d) => {
                Btf::parse(&d, Endianness::default()).map_err(|e| format!("no kernel BTF: {e}"))
            }
            Err(e) => Err(format!("no kernel BTF: {e:#}")),
        };
        let mut tools: HashMap<_, [u8; common::TOOL_NAME_LEN], u32> =
            HashMap::try_from(bpf.map_mut("TOOLS").context("no TOOLS map")?)?;
        for (name, id) in common::TOOLS {
            tools.insert(common::tool_key(name.as_bytes()), *id as u32, 0)?;
        }
        attach_hooks(
            &mut bpf,
            kernel_btf.as_ref().map_err(String::as_str),
            &mut report,
        )?;

        #[allow(unsafe_code)] // the loader: the ring buffer's fd into tokio
        let ring = |bpf: &mut Ebpf, name: &str| -> Result<AsyncFd<RingBuf<MapData>>> {
            let rb = RingBuf::try_from(
                bpf.take_map(name)
                    .with_context(|| format!("no {name} map"))?,
            )?;
            // SAFETY: the ring buffer owns its fd and keeps it open while the
            // AsyncFd holds it.
            Ok(unsafe { AsyncFd::register(rb)? })
        };
        let capable_events = ring(&mut bpf, "EVENTS_CAPABLE")?;
        let node_events = ring(&mut bpf, "EVENTS_NODE")?;
        let container_events = ring(&mut bpf, "EVENTS_CONTAINER")?;
        let drops = PerCpuArray::try_from(bpf.take_map("DROPS").context("no DROPS map")?)?;
        let errors = PerCpuArray::try_from(bpf.take_map("ERRORS").context("no ERRORS map")?)?;
        let watch = HashMap::try_from(bpf.take_map("WATCH").context("no WATCH map")?)?;
        Ok(EbpfDetector {
            _bpf: bpf,
            capable_events,
            node_events,
            container_events,
            drops,
            errors,
            watch,
            report,
        })
    }

    /// Asks the kernel to report the end of the tool exec'd in `tgid` (a
    /// capable caller's, which the exec hook put in `WATCH`). False: it has
    /// ended already (or was never there); then everything it wrote before
    /// its end is in the capable ring ([`EbpfDetector::drain_capable`]).
    pub fn watch(&mut self, tgid: u32) -> bool {
        const BPF_EXIST: u64 = 2;
        self.watch.insert(tgid, 1, BPF_EXIST).is_ok()
    }

    /// The capable callers' records waiting now, without waiting for more.
    pub fn drain_capable(&mut self) -> Vec<ShutdownSignal> {
        let mut out = Vec::new();
        drain(&mut self.capable_events, &mut out, usize::MAX);
        out
    }

    /// Records lost in the kernel, all CPUs.
    pub fn drops_by_cause(&self) -> Drops {
        let slot = |i: u32| -> u64 { self.drops.get(&i, 0).map(|v| v.iter().sum()).unwrap_or(0) };
        Drops {
            capable_full: slot(common::DropCause::CapableFull as u32),
            node_full: slot(common::DropCause::NodeFull as u32),
            node_rate_limited: slot(common::DropCause::NodeRate as u32),
            container_full: slot(common::DropCause::ContainerFull as u32),
            container_rate_limited: slot(common::DropCause::ContainerRate as u32),
            hook_errors: RecordSource::ALL.map(|s| {
                self.errors
                    .get(&(s as u32), 0)
                    .map(|v| v.iter().sum())
                    .unwrap_or(0)
            }),
        }
    }

    /// Records lost in the kernel, every cause.
    pub fn drops(&self) -> u64 {
        self.drops_by_cause().total()
    }

    /// Waits for the next records and returns them decoded (not yet enriched
    /// from /proc: see `actor::enrich_with`): capable callers' first, then
    /// the node's others, then containers', at most `BATCH`.
    pub async fn next_batch(&mut self) -> Result<Vec<ShutdownSignal>> {
        loop {
            let mut out = Vec::new();
            drain(&mut self.capable_events, &mut out, BATCH);
            drain(&mut self.node_events, &mut out, BATCH);
            drain(&mut self.container_events, &mut out, BATCH);
            if !out.is_empty() {
                return Ok(out);
            }
            tokio::select! {
                g = self.capable_events.readable_mut() => g?.clear_ready(),
                g = self.node_events.readable_mut() => g?.clear_ready(),
                g = self.container_events.readable_mut() => g?.clear_ready(),
            }
        }
    }
}

/// Takes up to `max` records (in all) from `rb` into `out`.
fn drain(rb: &mut AsyncFd<RingBuf<MapData>>, out: &mut Vec<ShutdownSignal>, max: usize) {
    let rb = rb.get_mut();
    while out.len() < max {
        let Some(item) = rb.next() else { break };
        match RawEvent::from_bytes(&item) {
            Some(raw) => out.push(hooks::decode(&raw, now_pair())),
            None => tracing::warn!(len = item.len(), "short ring-buffer record"),
        }
    }
}

fn attach_tracepoint(bpf: &mut Ebpf, prog: &str, category: &str, name: &str) -> Result<()> {
    let p: &mut TracePoint = bpf
        .program_mut(prog)
        .context("program missing from the object")?
        .try_into()?;
    p.load()?;
    p.attach(category, name)?;
    Ok(())
}

/// The kernel's struct offsets from its BTF; without them (said in the
/// report) the programs run without argv, parents and credentials.
fn task_offsets(btf: Result<&[u8], &anyhow::Error>, report: &mut Vec<HookReport>) -> TaskOffsets {
    match btf
        .map_err(|e| anyhow::anyhow!("{e:#}"))
        .and_then(TaskOffsets::from_btf_bytes)
    {
        Ok(o) => o,
        Err(e) => {
            report.push(HookReport {
                hook: "task offsets".into(),
                attach: KERNEL_BTF.into(),
                state: HookState::Degraded(format!(
                    "no kernel BTF ({e:#}): exec without argv, actors without parent or credentials (who can reboot is judged by uid 0 alone)"
                )),
            });
            TaskOffsets::default()
        }
    }
}

/// The object loaded with the node's identity and the offsets set.
fn load_object(node: &NodePidNs, o: &TaskOffsets) -> Result<Ebpf> {
    let memlock = crate::node::bpf_memlock_limit();
    let mut loader = EbpfLoader::new();
    loader.btf(None);
    loader
        .override_global("NODE_PIDNS_DEV", &node.dev, true)
        .override_global("NODE_PIDNS_INO", &node.ino, true)
        .override_global("NODE_INIT_PID", &node.init_pid, true)
        .override_global("TASK_MM_OFF", &o.task_mm, true)
        .override_global("MM_ARG_START_OFF", &o.mm_arg_start, true)
        .override_global("MM_ARG_END_OFF", &o.mm_arg_end, true)
        .override_global("TASK_REAL_PARENT_OFF", &o.task_real_parent, true)
        .override_global("TASK_TGID_OFF", &o.task_tgid, true)
        .override_global("TASK_COMM_OFF", &o.task_comm, true)
        .override_global("TASK_CRED_OFF", &o.task_cred, true)
        .override_global("CRED_EUID_OFF", &o.cred_euid, true)
        .override_global("CRED_CAP_EFFECTIVE_OFF", &o.cred_cap_effective, true)
        .override_global("CRED_USER_NS_OFF", &o.cred_user_ns, true)
        .override_global("USER_NS_LEVEL_OFF", &o.user_ns_level, true)
        .override_global("MM_EXE_FILE_OFF", &o.mm_exe_file, true)
        .override_global("FILE_DENTRY_OFF", &o.file_dentry, true)
        .override_global("DENTRY_NAME_OFF", &o.dentry_name, true)
        .override_global("MM_SAVED_AUXV_OFF", &o.mm_saved_auxv, true)
        .load(EBPF_OBJ)
        .map_err(|e| match memlock {
            Some(limit) => anyhow::Error::new(e).context(format!(
                "loading the eBPF object: {}",
                crate::node::memlock_advice(limit)
            )),
            None => anyhow::Error::new(e).context("loading the eBPF object"),
        })
}

/// Every hook of `HOOKS` attached, each with its report line; a required
/// tracepoint refused stops the start. A program no hook attaches is a hook
/// half added (see README's "Adding a shutdown path"): reported unavailable.
fn attach_hooks(
    bpf: &mut Ebpf,
    kernel_btf: Result<&Btf, &str>,
    report: &mut Vec<HookReport>,
) -> Result<()> {
    for hook in HOOKS {
        match hook.attach {
            Attach::Tracepoint {
                prog,
                category,
                name,
                required,
            } => {
                let state = match attach_tracepoint(bpf, prog, category, name) {
                    Ok(()) => HookState::Armed,
                    Err(e) => HookState::Unavailable(format!("{e:#}")),
                };
                if required && state != HookState::Armed {
                    bail!("the kernel refused the {category}/{name} tracepoint, so lastgasp cannot work: {state}");
                }
                report.push(HookReport {
                    hook: prog.to_string(),
                    attach: format!("tracepoint {category}/{name}"),
                    state,
                });
            }
            Attach::KernelFunctions(functions) => {
                hooks::kernel::arm(bpf, kernel_btf, functions, report);
            }
        }
    }
    let attached: Vec<String> = HOOKS.iter().flat_map(|h| h.attach.programs()).collect();
    for (name, _) in bpf.programs() {
        if !attached.iter().any(|a| a == name) {
            report.push(HookReport {
                hook: name.to_string(),
                attach: "-".into(),
                state: HookState::Unavailable(
                    "in the eBPF object, but no hook in agent/src/detect/hooks attaches it".into(),
                ),
            });
        }
    }
    Ok(())
}
