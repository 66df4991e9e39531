//! Where ranks live: the host of each rank, local ranks, and the 2D grid of the torus.
//!
//! Host identities (hostname plus boot id, or `TOROID_HOST_ID`) are exchanged at set-up; hosts
//! are numbered in order of their lowest rank. From them come each rank's local rank and size,
//! the groups the hierarchical algorithms use (ranks of each host, one root per host), and the
//! torus grid: `X` = ranks per host when every host has the same number of ranks, `Y` = hosts,
//! row `y` = the ranks of host `y`, column `x` = local rank `x` of every host.

use std::fmt;

use crate::error::{Error, Result};

/// Ranks and hosts of a communicator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Host index of each rank (hosts numbered in order of their lowest rank).
    pub host_of: Vec<usize>,
    /// Number of distinct hosts.
    pub hosts: usize,
    /// This rank's index among the ranks of its host.
    pub local_rank: usize,
    /// Number of ranks on this rank's host.
    pub local_size: usize,
    /// The ranks of each host, in rank order.
    pub members: Vec<Vec<usize>>,
    /// Physical machine index of each rank: equal to `host_of` unless hosts are emulated
    /// (`TOROID_HOST_ID`), when several hosts share one machine and its cores.
    pub machine_of: Vec<usize>,
}

impl Topology {
    /// Builds the topology of `rank` from each rank's host identity (and physical machine).
    pub fn from_host_ids(rank: usize, ids: &[String]) -> Topology {
        Topology::from_ids(rank, ids, ids)
    }

    /// Builds the topology of `rank` from each rank's logical host identity and physical
    /// machine identity.
    pub fn from_ids(rank: usize, hosts: &[String], machines: &[String]) -> Topology {
        let mut t = Topology::from_host_of(rank, index_by_first_seen(hosts));
        t.machine_of = index_by_first_seen(machines);
        t
    }

    /// Ranks on this rank's physical machine.
    pub fn machine_ranks(&self, rank: usize) -> usize {
        let m = self.machine_of[rank];
        self.machine_of.iter().filter(|&&x| x == m).count()
    }

    /// Builds the topology of `rank` from the host index of every rank.
    pub fn from_host_of(rank: usize, host_of: Vec<usize>) -> Topology {
        let hosts = host_of.iter().copied().max().map_or(0, |m| m + 1);
        let mut members = vec![Vec::new(); hosts];
        for (r, &h) in host_of.iter().enumerate() {
            members[h].push(r);
        }
        let mine = host_of[rank];
        Topology {
            local_rank: members[mine].iter().position(|&r| r == rank).unwrap_or(0),
            local_size: members[mine].len(),
            hosts,
            members,
            machine_of: host_of.clone(),
            host_of,
        }
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.host_of.len()
    }

    /// Ranks per host when every host has the same number, else `None`.
    pub fn uniform_local_size(&self) -> Option<usize> {
        let k = self.members.first()?.len();
        self.members.iter().all(|m| m.len() == k).then_some(k)
    }

    /// The lowest rank of each host (the local roots of the hierarchical ring).
    pub fn roots(&self) -> Vec<usize> {
        self.members.iter().map(|m| m[0]).collect()
    }

    /// The torus grid: `shape` when given (`TOROID_TORUS_SHAPE`), else ranks-per-host by
    /// hosts; when that does not exist (hosts of different sizes), the factorisation of `n`
    /// closest to the mean ranks per host, with the reason (logged by the caller).
    pub fn grid(&self, shape: Option<(usize, usize)>) -> Result<Grid> {
        let n = self.size();
        if let Some((x, y)) = shape {
            if x * y != n || x == 0 {
                return Err(Error::InvalidArgument(
                    format!("TOROID_TORUS_SHAPE={x}x{y} does not have {n} ranks").into(),
                ));
            }
            return Ok(Grid { x, y, placement: Placement::RankOrder, note: None });
        }
        if let Some(k) = self.uniform_local_size() {
            return Ok(Grid {
                x: k,
                y: self.hosts,
                placement: Placement::Hosts(self.members.clone()),
                note: None,
            });
        }
        let mean = n as f64 / self.hosts.max(1) as f64;
        let x = (1..=n)
            .filter(|d| n.is_multiple_of(*d))
            .min_by(|a, b| (*a as f64 - mean).abs().total_cmp(&(*b as f64 - mean).abs()))
            .unwrap_or(1);
        let sizes: Vec<usize> = self.members.iter().map(Vec::len).collect();
        Ok(Grid {
            x,
            y: n / x,
            placement: Placement::RankOrder,
            note: Some(format!(
                "hosts have different numbers of ranks {sizes:?}: using the grid {x}x{} in rank order \
                 (the divisor of {n} nearest the mean {mean:.1} ranks per host)",
                n / x
            )),
        })
    }
}

/// Numbers strings by first appearance: `[b, a, b]` becomes `[0, 1, 0]`.
fn index_by_first_seen(ids: &[String]) -> Vec<usize> {
    let mut names: Vec<&str> = Vec::new();
    ids.iter()
        .map(|id| match names.iter().position(|n| *n == id) {
            Some(i) => i,
            None => {
                names.push(id);
                names.len() - 1
            }
        })
        .collect()
}

/// How grid positions map to ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Position `(x, y)` is rank `y * X + x`.
    RankOrder,
    /// Position `(x, y)` is local rank `x` of host `y` (these are the hosts' members).
    Hosts(Vec<Vec<usize>>),
}

/// An `X` by `Y` grid of all ranks: rows of `X` (a host each when ranks-per-host is uniform),
/// columns of `Y`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grid {
    /// Row length.
    pub x: usize,
    /// Column length.
    pub y: usize,
    /// Position to rank.
    pub placement: Placement,
    /// Why the grid is not ranks-per-host by hosts, when it is not.
    pub note: Option<String>,
}

impl Grid {
    /// The rank at column `x`, row `y`.
    pub fn rank_at(&self, x: usize, y: usize) -> usize {
        match &self.placement {
            Placement::RankOrder => y * self.x + x,
            Placement::Hosts(m) => m[y][x],
        }
    }

    /// The position of `rank`.
    pub fn position(&self, rank: usize) -> (usize, usize) {
        match &self.placement {
            Placement::RankOrder => (rank % self.x, rank / self.x),
            Placement::Hosts(m) => {
                for (y, row) in m.iter().enumerate() {
                    if let Some(x) = row.iter().position(|&r| r == rank) {
                        return (x, y);
                    }
                }
                (0, 0)
            }
        }
    }

    /// The ranks of row `y`, in order.
    pub fn row(&self, y: usize) -> Vec<usize> {
        (0..self.x).map(|x| self.rank_at(x, y)).collect()
    }

    /// The ranks of column `x`, in order.
    pub fn column(&self, x: usize) -> Vec<usize> {
        (0..self.y).map(|y| self.rank_at(x, y)).collect()
    }
}

impl fmt::Display for Grid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}", self.x, self.y)
    }
}

/// Parses `XxY` (`TOROID_TORUS_SHAPE`).
pub fn parse_shape(s: &str) -> Result<(usize, usize)> {
    let bad = || Error::InvalidArgument(format!("TOROID_TORUS_SHAPE={s}: expected XxY, e.g. 4x8").into());
    let (a, b) = s
        .trim()
        .to_ascii_lowercase()
        .split_once('x')
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .ok_or_else(bad)?;
    let x: usize = a.trim().parse().map_err(|_| bad())?;
    let y: usize = b.trim().parse().map_err(|_| bad())?;
    if x == 0 || y == 0 {
        return Err(bad());
    }
    Ok((x, y))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo(host_of: &[usize]) -> Topology {
        Topology::from_host_of(0, host_of.to_vec())
    }

    #[test]
    fn local_ranks_and_members() {
        let t = Topology::from_host_of(4, vec![0, 0, 1, 1, 1, 2]);
        assert_eq!((t.hosts, t.local_rank, t.local_size), (3, 2, 3));
        assert_eq!(t.members, vec![vec![0, 1], vec![2, 3, 4], vec![5]]);
        assert_eq!(t.roots(), vec![0, 2, 5]);
        assert_eq!(t.uniform_local_size(), None);
        let ids: Vec<String> = ["b", "a", "b", "a"].iter().map(|s| s.to_string()).collect();
        let t = Topology::from_host_ids(3, &ids);
        assert_eq!(t.host_of, vec![0, 1, 0, 1]);
        assert_eq!((t.local_rank, t.local_size), (1, 2));
    }

    #[test]
    fn grid_from_uniform_hosts_follows_hosts() {
        // Round-robin placement: host 0 has ranks 0 and 2.
        let t = topo(&[0, 1, 0, 1]);
        let g = t.grid(None).unwrap();
        assert_eq!((g.x, g.y), (2, 2));
        assert_eq!(g.row(0), vec![0, 2]);
        assert_eq!(g.column(1), vec![2, 3]);
        for r in 0..4 {
            let (x, y) = g.position(r);
            assert_eq!(g.rank_at(x, y), r);
        }
        assert!(g.note.is_none());
    }

    #[test]
    fn grid_override_and_fallback() {
        let t = topo(&[0; 6]);
        let g = t.grid(Some((2, 3))).unwrap();
        assert_eq!(g.row(2), vec![4, 5]);
        assert_eq!(g.column(1), vec![1, 3, 5]);
        assert!(t.grid(Some((4, 2))).is_err());
        // 7 ranks on hosts of 3, 3 and 1: no uniform grid; 7 is prime, so 1x7 or 7x1.
        let t = topo(&[0, 0, 0, 1, 1, 1, 2]);
        let g = t.grid(None).unwrap();
        assert_eq!(g.x * g.y, 7);
        assert!(g.note.as_deref().unwrap().contains("different numbers"));
        // 8 ranks on hosts of 3, 3, 2: the divisor of 8 nearest 2.67 is 2.
        let g = topo(&[0, 0, 0, 1, 1, 1, 2, 2]).grid(None).unwrap();
        assert_eq!((g.x, g.y), (2, 4));
    }

    #[test]
    fn shape_parsing() {
        assert_eq!(parse_shape("4x8").unwrap(), (4, 8));
        assert_eq!(parse_shape(" 2X3 ").unwrap(), (2, 3));
        assert!(parse_shape("4*8").is_err());
        assert!(parse_shape("0x8").is_err());
    }
}

/// The groups one rank takes part in, computed once per communicator so that no collective
/// allocates them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Ranks of this rank's host.
    pub local: Vec<usize>,
    /// This rank's position in `local`.
    pub local_pos: usize,
    /// The lowest rank of every host.
    pub roots: Vec<usize>,
    /// This rank's position in `roots`, when it is its host's root.
    pub root_pos: Option<usize>,
    /// Largest number of ranks on one host.
    pub max_local: usize,
    /// The torus grid.
    pub grid: Grid,
    /// This rank's row of the grid.
    pub row: Vec<usize>,
    /// This rank's column of the grid.
    pub column: Vec<usize>,
    /// This rank's grid position `(x, y)`.
    pub position: (usize, usize),
}

impl Layout {
    /// The layout of `rank`, with the torus shape override `shape`.
    pub fn new(topology: &Topology, rank: usize, shape: Option<(usize, usize)>) -> Result<Layout> {
        let host = topology.host_of[rank];
        let local = topology.members[host].clone();
        let roots = topology.roots();
        let grid = topology.grid(shape)?;
        let position = grid.position(rank);
        Ok(Layout {
            local_pos: local.iter().position(|&r| r == rank).unwrap_or(0),
            root_pos: roots.iter().position(|&r| r == rank),
            max_local: topology.members.iter().map(Vec::len).max().unwrap_or(1),
            row: grid.row(position.1),
            column: grid.column(position.0),
            position,
            local,
            roots,
            grid,
        })
    }
}
