//! Slurm host lists (`SLURM_JOB_NODELIST`): `node[01-04,07],gpu5` and the like.

use crate::error::{Error, Result};

/// More hosts than any job has: a longer expansion is a typo such as `node[1-99999999]`.
const MAX_HOSTS: usize = 1 << 20;

///
/// Ranges keep the zero padding of their lower bound (`[08-10]` gives `08 09 10`), and a name may
/// hold several bracket groups (`r[1-2]n[1-2]` gives `r1n1 r1n2 r2n1 r2n2`).
///
/// ```
/// use toroid::rendezvous::env::expand_hostlist;
/// assert_eq!(expand_hostlist("n[01-03,07],gpu5").unwrap(), ["n01", "n02", "n03", "n07", "gpu5"]);
/// ```
///
/// # Errors
/// [`Error::InvalidArgument`] for unbalanced brackets, ranges that are not numbers or run
/// backwards, and lists longer than a million hosts.
pub fn expand_hostlist(list: &str) -> Result<Vec<String>> {
    let bad = |why: String| Error::InvalidArgument(format!("host list '{list}': {why}").into());
    let mut hosts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in list.char_indices().chain(std::iter::once((list.len(), ','))) {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1).ok_or_else(|| bad("unmatched ']'".into()))?,
            ',' if depth == 0 => {
                let item = list[start..i].trim();
                if !item.is_empty() {
                    expand_item(item, &mut hosts).map_err(bad)?;
                }
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(bad("unclosed '['".into()));
    }
    Ok(hosts)
}

/// Appends the expansion of one host pattern (no top-level commas) to `out`.
fn expand_item(item: &str, out: &mut Vec<String>) -> std::result::Result<(), String> {
    let Some(open) = item.find('[') else {
        if item.contains(']') {
            return Err("unmatched ']'".into());
        }
        out.push(item.to_string());
        return Ok(());
    };
    let close = item[open..].find(']').map(|c| open + c).ok_or("unclosed '['")?;
    let (prefix, ranges, rest) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    let mut tails = Vec::new();
    expand_item_or_empty(rest, &mut tails)?;
    for range in ranges.split(',').map(str::trim) {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let parse = |s: &str| -> std::result::Result<u64, String> {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("'{range}' is not a number or a range a-b"));
            }
            s.parse().map_err(|_| format!("'{s}' is too large"))
        };
        let (a, b) = (parse(lo)?, parse(hi)?);
        if a > b {
            return Err(format!("range '{range}' runs backwards"));
        }
        let count = usize::try_from(b - a + 1).unwrap_or(usize::MAX).saturating_mul(tails.len());
        if out.len().saturating_add(count) > MAX_HOSTS {
            return Err(format!("more than {MAX_HOSTS} hosts"));
        }
        let width = lo.len();
        for n in a..=b {
            for tail in &tails {
                out.push(format!("{prefix}{n:0width$}{tail}"));
            }
        }
    }
    Ok(())
}

/// Like [`expand_item`], with the empty pattern expanding to one empty string.
fn expand_item_or_empty(item: &str, out: &mut Vec<String>) -> std::result::Result<(), String> {
    if item.is_empty() {
        out.push(String::new());
        Ok(())
    } else {
        expand_item(item, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostlists() {
        assert_eq!(
            expand_hostlist("node[01-04,07],gpu5").unwrap(),
            ["node01", "node02", "node03", "node04", "node07", "gpu5"]
        );
        assert_eq!(expand_hostlist("a[8-10]").unwrap(), ["a8", "a9", "a10"]);
        assert_eq!(expand_hostlist("a[098-101]").unwrap(), ["a098", "a099", "a100", "a101"]);
        assert_eq!(
            expand_hostlist("r[1-2]-n[01-02]x").unwrap(),
            ["r1-n01x", "r1-n02x", "r2-n01x", "r2-n02x"]
        );
        assert_eq!(expand_hostlist("single").unwrap(), ["single"]);
        assert_eq!(expand_hostlist(" a , b[3] ,,").unwrap(), ["a", "b3"]);
        assert!(expand_hostlist("").unwrap().is_empty());
        for bad in ["n[1-", "n]1", "n[3-1]", "n[a-b]", "n[1-2-3]", "n[]", "n[0-99999999]", "n[1]]"] {
            assert!(matches!(expand_hostlist(bad), Err(Error::InvalidArgument(_))), "{bad}");
        }
    }
}
