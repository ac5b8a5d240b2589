//! The kernel limits that drop Service traffic without any rule changing: the conntrack
//! table (its entries against `nf_conntrack_max`; insertion failures, drops and early
//! drops from the kernel's per-CPU conntrack statistics) and the sysctls kproxy set,
//! as the calling thread's network namespace shows them in `/proc`. [`parse_stat`] is
//! the pure reading of `/proc/net/stat/nf_conntrack`; [`conntrack_table`] and
//! [`read_sysctl`] read the files.

use crate::error::NftError;

/// The conntrack table of this network namespace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConntrackTable {
    /// `nf_conntrack_count`: entries now (per network namespace).
    pub entries: u64,
    /// `nf_conntrack_max` (one limit for every namespace).
    pub max: u64,
    /// Since boot, summed over CPUs: entries that could not be inserted, packets
    /// dropped because the table was full, and entries evicted early to make room.
    pub insert_failed: u64,
    pub drop: u64,
    pub early_drop: u64,
}

impl ConntrackTable {
    /// The table is full: a new connection (to a Service or anywhere) is dropped unless
    /// an old entry can be evicted.
    pub fn full(&self) -> bool {
        self.max > 0 && self.entries >= self.max
    }
}

/// `(insert_failed, drop, early_drop)` summed over the per-CPU rows of
/// `/proc/net/stat/nf_conntrack` (a header line of column names, then one row of hex
/// numbers per CPU; the columns differ between kernels, so they are found by name).
/// `None` when the header lacks one of them or a row does not parse.
pub fn parse_stat(text: &str) -> Option<(u64, u64, u64)> {
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next()?.split_whitespace().collect();
    let col = |name: &str| header.iter().position(|h| *h == name);
    let cols = [col("insert_failed")?, col("drop")?, col("early_drop")?];
    let mut sums = [0u64; 3];
    for line in lines.filter(|l| !l.trim().is_empty()) {
        let row: Vec<&str> = line.split_whitespace().collect();
        for (sum, c) in sums.iter_mut().zip(cols) {
            *sum = sum.saturating_add(u64::from_str_radix(row.get(c)?, 16).ok()?);
        }
    }
    Some((sums[0], sums[1], sums[2]))
}

fn read(path: &str) -> Result<String, NftError> {
    std::fs::read_to_string(path).map_err(|e| NftError::Io {
        context: format!("reading {path}"),
        source: e,
    })
}

/// A numeric sysctl (`/proc/sys/...`) as the calling thread's namespace shows it.
pub fn read_sysctl(path: &str) -> Result<u64, NftError> {
    let text = read(path)?;
    text.trim()
        .parse()
        .map_err(|_| NftError::Read(format!("{path}: not a number: {:?}", text.trim())))
}

/// The conntrack table of the calling thread's network namespace; an error when
/// conntrack is not loaded (no Service rule has been programmed yet).
pub fn conntrack_table() -> Result<ConntrackTable, NftError> {
    const STAT: &str = "/proc/thread-self/net/stat/nf_conntrack";
    let (insert_failed, drop, early_drop) = parse_stat(&read(STAT)?)
        .ok_or_else(|| NftError::Read(format!("{STAT}: unexpected columns")))?;
    Ok(ConntrackTable {
        entries: read_sysctl("/proc/sys/net/netfilter/nf_conntrack_count")?,
        max: read_sysctl("/proc/sys/net/netfilter/nf_conntrack_max")?,
        insert_failed,
        drop,
        early_drop,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_columns_are_found_by_name_and_summed_over_cpus() {
        // Kernel 6.x layout (two CPUs), then an older one without `clashres`.
        let six = "entries  clashres found new invalid ignore delete chainlength insert insert_failed drop early_drop icmp_error  expect_new expect_create expect_delete search_restart
00000010  00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000002 00000003 0000000a 00000000  00000000 00000000 00000000 00000000
00000010  00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000001 00000000 00000001 00000000  00000000 00000000 00000000 00000000
";
        assert_eq!(parse_stat(six), Some((3, 3, 11)));
        let old = "entries  searched found new invalid ignore delete delete_list insert insert_failed drop early_drop icmp_error  expect_new expect_create expect_delete search_restart
00000001  00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 000000ff 00000001 00000000 00000000  00000000 00000000 00000000 00000000
";
        assert_eq!(parse_stat(old), Some((255, 1, 0)));
        assert_eq!(parse_stat("entries found\n1 2\n"), None);
        assert_eq!(parse_stat(&six.replace("00000002", "zz")), None);
        assert_eq!(parse_stat(""), None);
    }

    #[test]
    fn full_means_at_the_limit() {
        let t = |entries, max| ConntrackTable {
            entries,
            max,
            ..ConntrackTable::default()
        };
        assert!(!t(10, 11).full());
        assert!(t(11, 11).full());
        assert!(!t(5, 0).full());
    }
}
